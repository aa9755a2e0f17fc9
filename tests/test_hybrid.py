"""Hybrid-parallel jobs in the core: pipelines of num_stages GPUs per data-parallel replica (goodput.hybrid)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from goodput import Cluster, GoodputTable, JobModel, Observation, Profile
from goodput.cluster import NodePool
from goodput.errors import ValidationError
from goodput.hybrid import Stages, replicas_of, stages_of
from goodput.throughput import ThroughputParams, predict_step_time

# The truth of a synthetic pipelined job: Pollux's model with replicas = pipelines (one pipeline's
# micro-batch, the all-reduce between pipelines). 2 stages on A100, 8 on RTX 2080 Ti, as Sia's GPT job.
TRUTH = {"a100": ThroughputParams(0.02, 0.004, 0.25, 0.01, 0.05, 0.004, 1.3),
         "rtx2080ti": ThroughputParams(0.06, 0.012, 0.4, 0.02, 0.1, 0.01, 1.3)}
STAGES = {"a100": 2, "rtx2080ti": 8}


def pipeline_observations(job="gpt"):
    out = []
    for gpu, params in TRUTH.items():
        for replicas, nodes in ((1, 1), (2, 2), (3, 3)) if gpu == "rtx2080ti" else ((1, 1), (2, 1), (4, 1), (8, 2)):
            for bsz in (1, 2, 4):
                for accum in (0, 7):
                    step = float(predict_step_time(params, nodes, replicas, bsz, accum))
                    out.append(Observation(job, gpu, nodes, replicas, bsz, step_time=step, accum_steps=accum,
                                           grad_sqr=1.0, grad_var=4.0, num_stages=STAGES[gpu]))
    return out


def test_stages_parse_a_count_or_one_per_gpu_type():
    assert Stages.parse(4).of("t4") == 4 and Stages.parse(4).value == 4
    stages = Stages.parse({"RTX2080Ti": 8, "a100": 2})
    assert stages.of("rtx2080ti") == 8 and stages.of("t4") == 1 and stages.hybrid
    assert stages.replicas("rtx2080ti", 16) == 2 and stages.replicas("rtx2080ti", 12) == 0
    assert not Stages.parse(1).hybrid
    for bad in (0, -2, 1.5, True, {"a100": 0}, {"a100": 2, "A100": 4}):
        with pytest.raises(ValidationError, match="num_stages"):
            Stages.parse(bad)


@pytest.mark.parametrize("stages, gpn, nodes, expected", [
    (1, 8, 3, [1, 2, 4, 8, 16, 24]),        # Sia's set
    (2, 8, 3, [2, 4, 8, 16, 24]),           # pipelines within a node, then whole nodes
    (3, 8, 3, [3, 6, 24]),                  # 6 = the most whole pipelines one node holds; 16 GPUs are not 3-stage pipelines
    (8, 4, 6, [8, 16, 24]),                 # a pipeline longer than a node: whole nodes only
    (16, 4, 3, []),                         # not one pipeline fits the pool
])
def test_configurations_of_a_hybrid_job_are_whole_pipelines(stages, gpn, nodes, expected):
    pool = NodePool("a100", nodes, gpn)
    configs = pool.configurations(stages)
    assert [g for _, _, g in configs] == expected
    for _, n, g in configs:
        assert g % stages == 0
        assert (n == 1 and g <= gpn) or g == n * gpn  # Sia's shapes: one node, or whole nodes
    assert [g for _, _, g in pool.configurations(stages, min_replicas=2)] == [g for g in expected if g >= 2 * stages]
    assert pool.configurations(1) == pool.configurations()


def test_observation_num_stages_is_validated_and_round_trips(tmp_path):
    obs = Observation("gpt", "rtx2080ti", 2, 2, 1, step_time=1.5, sync_time=0.2, accum_steps=47, num_stages=8,
                      placement=(8, 8))
    assert obs.num_gpus == 16 and obs.batch_size == 2 * 1 * 48
    assert Observation.from_dict(obs.to_dict()) == obs
    # a pipeline longer than a node: 1 replica of 8 stages on 2 nodes of 4
    assert Observation("gpt", "t4", 2, 1, 1, step_time=1.0, num_stages=8, placement=(4, 4)).num_gpus == 8
    with pytest.raises(ValidationError, match="placement"):
        Observation("gpt", "rtx2080ti", 2, 2, 1, step_time=1.5, num_stages=8, placement=(8, 4))
    with pytest.raises(ValidationError, match="num_replicas"):
        Observation("gpt", "t4", 3, 1, 1, step_time=1.0, num_stages=2)  # 2 GPUs cannot span 3 nodes
    for bad in (0, 1.5, "2"):
        with pytest.raises(ValidationError, match="num_stages"):
            Observation("gpt", "t4", 1, 1, 1, step_time=1.0, num_stages=bad)
    # data-parallel records keep their content (and the service its record ids): no num_stages key
    plain = Observation("c", "t4", 1, 2, 64, step_time=0.1)
    assert "num_stages" not in plain.to_dict() and plain.num_stages == 1
    path = tmp_path / "p.jsonl"
    Profile([obs, plain], job=None).save(path)
    assert Profile.load(path).observations == [obs, plain]
    assert json.loads(path.read_text().splitlines()[-2])["num_stages"] == 8


def test_job_model_tables_hold_whole_pipelines_only():
    model = JobModel("gpt", 16, max_batch_size=512, local_bsz_bounds=(1, 4), num_stages=STAGES, bayesian=False)
    model.observe(pipeline_observations())
    assert model.num_stages == STAGES and model.stages("a100") == 2 and model.stages("t4") == 1
    cluster = Cluster.parse("a100:2x8,rtx2080ti:3x8")
    frame = model.table(cluster).frame
    for gpu, stages in STAGES.items():
        rows = frame[frame.gpu_type == gpu]
        assert (rows.num_gpus % stages == 0).all()
        assert (rows.num_replicas == rows.num_gpus // stages).all()
        expected = [g for _, _, g in cluster.pool(gpu).configurations(stages)]
        assert rows.num_gpus.tolist() == expected
        # each row's goodput is the model's for that many pipelines
        for row in rows.itertuples():
            direct = model.goodput(gpu, row.num_nodes, num_replicas=row.num_replicas)
            assert row.goodput == pytest.approx(direct.goodput)
            assert row.batch_size == row.num_replicas * row.local_bsz * (row.accum_steps + 1)
    # the plain model recovers the truth: a whole-pipeline configuration's step time is the true one
    pred = model.predict("rtx2080ti", 2, 2, 2, 7).step_time
    assert pred == pytest.approx(float(predict_step_time(TRUTH["rtx2080ti"], 2, 2, 2, 7)), rel=0.02)


def test_goodput_by_gpu_count_maps_to_pipelines_and_refuses_partial_ones():
    model = JobModel("gpt", 16, max_batch_size=512, local_bsz_bounds=(1, 4), num_stages=STAGES, bayesian=False,
                     min_replicas=2)
    model.observe(pipeline_observations())
    by_gpus = model.goodput("a100", 1, num_gpus=8)
    by_replicas = model.goodput("a100", 1, num_replicas=4)
    assert by_gpus == by_replicas and by_gpus.num_replicas == 4 and by_gpus.goodput > 0
    assert model.goodput("a100", 1, num_gpus=6).goodput > 0  # 3 pipelines: a valid count, if outside Sia's set
    for gpus in (3, 7, 2):  # partial pipelines; one pipeline is below min_replicas=2
        choice = model.goodput("a100", 1, num_gpus=gpus)
        assert choice.goodput == 0 and not choice.feasible and choice.local_bsz == 0
    assert model.goodput("rtx2080ti", 1, num_gpus=12).goodput == 0
    assert all(r >= 2 for r in model.table(Cluster.parse("a100:2x8")).frame.num_replicas)
    empty = model.table(Cluster.parse("a100:1x2"))  # not two whole pipelines: no rows, the same columns
    assert len(empty) == 0 and "num_replicas" in empty.frame.columns and model.empty_table_reason(Cluster.parse("a100:1x2"))
    with pytest.raises(ValidationError, match="num_replicas"):
        model.goodput("a100", 1)  # neither replicas nor GPUs
    with pytest.raises(ValidationError, match="num_replicas"):
        model.goodput("a100", 1, 2, num_gpus=4)  # both
    with pytest.raises(ValidationError, match="num_replicas"):
        model.goodput("a100", 3, num_replicas=1)  # one 2-GPU pipeline cannot span 3 nodes
    with pytest.raises(ValidationError, match="min_replicas"):
        JobModel("gpt", 16, min_replicas=0)


@pytest.mark.parametrize("bayesian", [False, True])
def test_a_pipeline_longer_than_a_node_is_predicted_and_tabled(bayesian):
    truth = TRUTH["a100"]
    obs = [Observation("long", "a100", nodes, replicas, bsz, float(predict_step_time(truth, nodes, replicas, bsz, num_stages=8)),
                       grad_sqr=1.0, grad_var=4.0, num_stages=8)
           for nodes, replicas in ((2, 1), (4, 2)) for bsz in (1, 2, 4, 8)]
    model = JobModel("long", 8, max_batch_size=64, num_stages=8, bayesian=bayesian).observe(obs)
    cluster = Cluster.parse("a100:4x4")  # 4 GPUs a node: one 8-stage pipeline spans 2 nodes
    assert cluster.configurations(num_stages=8) == [("a100", 2, 8), ("a100", 4, 16)]
    step = model.predict("a100", 4, 2, 4).step_time
    assert step == pytest.approx(float(predict_step_time(truth, 4, 2, 4, num_stages=8)), rel=0.05)
    frame = model.table(cluster).frame
    assert frame[["num_nodes", "num_replicas"]].values.tolist() == [[2, 1], [4, 2]] and (frame.goodput > 0).all()
    assert model.goodput("a100", 2, num_gpus=8).goodput == pytest.approx(frame.goodput.iloc[0])
    with pytest.raises(ValidationError, match="num_replicas"):
        model.predict("a100", 9, 1, 4)  # one pipeline's 8 GPUs cannot span 9 nodes
    with pytest.raises(ValidationError, match="num_replicas"):
        model.predict("a100", 1, 0.5, 4)  # half a pipeline
    data_parallel = JobModel("dp", 8, bayesian=False).observe([Observation("dp", "a100", 1, 1, 4, 0.1)])
    with pytest.raises(ValidationError, match="num_replicas"):
        data_parallel.predict("a100", 2, 1, 4)  # every node holds a replica


def test_observations_must_match_the_jobs_stage_count():
    model = JobModel("gpt", 16, num_stages={"a100": 2})
    with pytest.raises(ValidationError, match=r"observations\[0\].num_stages"):
        model.observe(Observation("gpt", "a100", 1, 2, 4, step_time=0.5, num_stages=4))
    with pytest.raises(ValidationError, match="num_stages"):
        model.observe(Observation("gpt", "t4", 1, 1, 4, step_time=0.5, num_stages=2))  # t4 left out: 1 stage
    model.observe(Observation("gpt", "a100", 1, 2, 4, step_time=0.5, num_stages=2))
    assert len(model.observations) == 1


def test_from_profile_takes_the_stage_counts_of_the_observations():
    profile = Profile(pipeline_observations(), job="gpt", init_batch_size=16, max_batch_size=512)
    model = JobModel.from_profile(profile, bayesian=False)
    assert model.num_stages == STAGES
    assert stages_of([Observation("c", "t4", 1, 1, 4, step_time=0.1)]) == 1
    mixed = [Observation("g", "a100", 1, 1, 4, step_time=0.1, num_stages=2),
             Observation("g", "a100", 1, 1, 4, step_time=0.1, num_stages=4)]
    with pytest.raises(ValidationError, match="num_stages"):
        stages_of(mixed)


def test_table_num_replicas_column_is_validated():
    row = {"gpu_type": "a100", "num_nodes": 1, "num_gpus": 8, "goodput": 10.0}
    assert GoodputTable("g", [{**row, "num_replicas": 4}]).lookup("a100", 1, 8)["num_replicas"] == 4
    for bad in (3, 0):
        with pytest.raises(ValidationError, match="num_replicas"):
            GoodputTable("g", [{**row, "num_replicas": bad}])


def test_a_data_parallel_model_is_unchanged():
    """num_stages=1 (the default) gives Sia's configuration set and no num_replicas column."""
    model = JobModel("c", 64, max_batch_size=1024, local_bsz_bounds=(8, 256), bayesian=False)
    params = ThroughputParams(0.05, 0.001, 0.3, 0.01, 0.1, 0.005, 1.5)
    model.observe([Observation("c", "t4", n, r, b, step_time=float(predict_step_time(params, n, r, b)), grad_sqr=1.0,
                               grad_var=2.0) for n, r in ((1, 1), (1, 2), (1, 4), (2, 8)) for b in (16, 64, 256)])
    cluster = Cluster.parse("t4:4x4")
    frame = model.table(cluster).frame
    assert "num_replicas" not in frame and len(frame) == len(cluster.configurations())
    assert model.goodput("t4", 1, num_gpus=3) == model.goodput("t4", 1, 3)
    assert np.isclose(model.goodput("t4", 2, num_gpus=8).goodput, frame[frame.num_gpus == 8].goodput.iloc[0])


def test_stage_counts_are_looked_up_by_any_spelling_of_the_type():
    """parse stores normalized keys; of('A100') had looked the raw name up and fallen back to 1 stage."""
    stages = Stages.parse({"A100": 2})
    assert stages.of("A100") == stages.of("a100") == 2
    assert stages.replicas("A100", 8) == 4 and not stages.valid("A100", 7)
    assert replicas_of(stages, "A100", 1, num_gpus=8) == 4
    assert stages.of("t4") == 1


def test_sync_time_takes_a_pipeline_that_spans_nodes():
    from goodput.throughput import predict_sync_time

    params = TRUTH["rtx2080ti"]
    assert float(predict_sync_time(params, 2, 1, num_stages=8)) == 0.0  # one pipeline: nothing to all-reduce
    assert float(predict_sync_time(params, 2, 2, num_stages=8)) > 0.0
    with pytest.raises(ValidationError, match="num_replicas"):
        predict_sync_time(params, 2, 1)  # one data-parallel replica cannot span two nodes


def test_goodput_fit_says_when_no_pipeline_fits_the_cluster(tmp_path, capsys):
    from cli import main

    profile = Profile([o for o in pipeline_observations() if o.gpu_type == "rtx2080ti"], job="gpt", init_batch_size=8,
                      max_batch_size=64)
    path = profile.save(tmp_path / "gpt.jsonl")
    assert main(["fit", str(path), "--cluster", "rtx2080ti:1x4"]) == 2  # 8-GPU pipelines, 4-GPU node
    err = capsys.readouterr().err
    assert "pipeline(s) of 8 rtx2080ti GPUs" in err and "no observations" not in err


def test_empty_table_reason_names_what_is_missing():
    from goodput import Cluster

    model = JobModel("gpt", 16, max_batch_size=512, local_bsz_bounds=(1, 4), num_stages=STAGES, bayesian=False).observe(
        [o for o in pipeline_observations() if o.gpu_type == "rtx2080ti"])
    assert model.empty_table_reason(Cluster.parse("rtx2080ti:2x8")) == ""
    assert "1 pipeline(s) of 8 rtx2080ti GPUs" in model.empty_table_reason(Cluster.parse("rtx2080ti:1x4"))
    reason = model.empty_table_reason(Cluster.parse("v100:1x8"))
    assert "no observations for its GPU type(s) v100" in reason and "rtx2080ti" in reason
    with pytest.raises(ValidationError, match="cluster"):
        model.empty_table_reason("rtx2080ti:2x8")
