"""Hybrid-parallel jobs in the simulator: pipeline tables, whole-pipeline allocations, exact progress."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.simulator.engine import SimConfig, Simulator
from experiments.simulator.policies import make_policy
from experiments.simulator.truth import ParametricFamily, load_catalog, load_measured, pipeline_step_time
from experiments.simulator.workload import WorkloadJob, write_workload
from goodput import Cluster
from goodput.errors import DataFormatError, ValidationError
from goodput.throughput import ThroughputParams, predict_step_time
from tests.sim_doubles import FixedPolicy, pipeline_forward, pipeline_sync, write_pipeline_model

PARAMS = ThroughputParams(0.05, 0.001, 0.3, 0.01, 0.1, 0.005, 1.5)


def hybrid_family(stages=None, work=20_000.0, restart=40.0):
    """Pollux's model with replicas = pipelines; a constant noise scale, so its truth is known in closed form."""
    return ParametricFamily(name="hyb", init_batch_size=32, max_batch_size=512, min_local_bsz=2,
                            max_local_bsz={"t4": 16, "a100": 32}, work=work, noise=((0.0, 400.0),),
                            restart_cost_s=restart, num_stages=stages or {"a100": 2, "t4": 4},
                            params={"t4": PARAMS, "a100": PARAMS})


# ---------------------------------------------------------------------------- the truth
def test_pipeline_tables_are_read_in_sias_format(tmp_path):
    write_pipeline_model(tmp_path)
    family = load_measured(tmp_path)["pipe"]
    assert family.hybrid and family.stages("a100") == 2 and family.stages("t4") == 4
    assert family.restart_cost_s == 60.0  # application.json
    assert family.replicas("a100", 8) == 4 and family.replicas("a100", 6) == 3 and family.replicas("a100", 5) == 0
    # a measured placement: 2 nodes x 8 A100 = 8 pipelines; 12 micro-batches of 2
    forward, sync = pipeline_forward("a100", 2), pipeline_sync(2, 8)
    t_iter, got_sync = family.iter_time("a100", 2, 16, 2, 11)
    assert t_iter == pytest.approx(3.0 * (2 - 1 + 12) * forward + sync) and got_sync == pytest.approx(sync)
    assert sync > forward  # sync above the per-micro-batch step time: valid in a pipeline table
    assert family.iter_time("t4", 2, 8, 1, 0)[0] == pytest.approx(pipeline_step_time(pipeline_forward("t4", 1),
                                                                                     pipeline_sync(2, 2), 4, 1))
    # progress: E(M)·M/M0/T_iter with M = pipelines x micro-batch x micro-batches
    rate = family.rate("a100", 2, 16, 2, 11, 0.0)
    batch = 8 * 2 * 12
    assert rate == pytest.approx(float(family.efficiency(0.0, batch)) * batch / family.init_batch_size / t_iter)
    assert family.rate("a100", 1, 5, 2, 0, 0.0) == 0.0  # not whole pipelines
    with pytest.raises(ValidationError, match="pipelines"):
        family.iter_time("t4", 1, 2, 1, 0)
    best = family.best_config("a100", np.array([1, 1, 1]), np.array([2, 3, 4]), 0.0)
    assert best.goodput[0] > 0 and best.goodput[1] == 0 and best.goodput[2] > best.goodput[0]


def test_scalability_rows_of_a_pipeline_table_count_gpus(tmp_path):
    folder = write_pipeline_model(tmp_path)
    (folder / "scalability-a100.csv").write_text("local_bsz,step_time,sync_time,num_nodes,num_replicas\n"
                                                 "1,0.03,0.9,4,32\n2,0.04,0.9,4,32\n")
    family = load_measured(tmp_path)["pipe"]
    assert family.step_sync("a100", 4, 32, 1) == pytest.approx((0.03, 0.9))  # 4 nodes of 8: 16 pipelines of 2


@pytest.mark.parametrize("settings, table, field", [
    ({"num_stages": {"a100": 2, "t4": 4}}, "3,1,0.1,0.2", "placement"),  # 3 GPUs: not pipelines of 2
    ({"num_stages": {"a100": 0}}, None, "num_stages"),
    ({"num_stages": 2, "colour": "red"}, None, "colour"),
    ({"restart_cost_s": -5, "num_stages": 2}, None, "restart_cost_s"),
    ({"num_stages": {"a100": 2, "t4": 4}}, "4,1,,0.2", "step_time"),
])
def test_a_bad_pipeline_table_or_settings_file_is_one_line_naming_file_row_and_field(tmp_path, settings, table, field):
    folder = write_pipeline_model(tmp_path, settings=settings)
    if table is not None:
        path = folder / "placements-a100.csv"
        path.write_text(path.read_text() + table + "\n")
    with pytest.raises(DataFormatError) as info:
        load_measured(tmp_path)
    message = str(info.value)
    assert info.value.field.startswith(field) and "\n" not in message
    if table is not None:
        lines = (folder / "placements-a100.csv").read_text().splitlines()
        assert info.value.line == len(lines) and message.startswith(f"{folder / 'placements-a100.csv'}:{len(lines)}:")
    else:
        assert message.startswith(str(folder / "application.json"))


def test_a_pipeline_table_without_its_stage_count_names_the_fix(tmp_path):
    write_pipeline_model(tmp_path, settings={})
    with pytest.raises(DataFormatError, match="application.json") as info:
        load_measured(tmp_path)
    assert info.value.field == "sync_time" and info.value.line is not None  # Sia's pipeline rows: sync > step


# ---------------------------------------------------------------------------- the simulator
def test_a_hybrid_job_progresses_by_its_known_truth():
    """One job on 4 A100s = 2 pipelines of 2: finish time from Pollux's formula with 2 replicas, in closed form."""
    family = hybrid_family()
    cluster = Cluster.parse("a100:1x8")
    job = WorkloadJob("solo", 30.0, "hyb", 4, 64)
    sim = Simulator([job], {"hyb": family}, SimConfig(cluster=cluster), FixedPolicy("a100", 4))
    result = sim.run()
    best = family.best_config("a100", 1, 4, 0.0)
    bsz, accum = int(best.local_bsz[0]), int(best.accum_steps[0])
    batch = 2 * bsz * (accum + 1)  # two pipelines
    assert batch == int(best.batch_size[0])
    t_iter = float(predict_step_time(PARAMS, 1, 2, bsz, accum))  # the model's replicas are pipelines
    efficiency = (400.0 + 32) / (400.0 + batch)
    rate = efficiency * batch / 32 / t_iter
    assert family.rate("a100", 1, 4, bsz, accum, 0.0) == pytest.approx(rate)
    expected = 60.0 + family.restart_cost_s + family.work / rate
    assert result.jobs["finish_s"].iloc[0] == pytest.approx(expected, rel=1e-9)
    assert result.jobs["gpu_hours"].iloc[0] == pytest.approx(4 * (expected - 60.0) / 3600)


def test_a_partial_pipeline_is_refused():
    cluster = Cluster.parse("a100:1x8")
    with pytest.raises(ValidationError, match="not whole pipelines"):
        Simulator([WorkloadJob("h", 0.0, "hyb", 4, 64)], {"hyb": hybrid_family()}, SimConfig(cluster=cluster),
                  FixedPolicy("a100", 3)).run()


class Recording:
    """A policy under test that records every allocation it makes."""

    def __init__(self, policy) -> None:
        self.policy, self.seen = policy, []
        for attr in ("name", "round_s", "oracle", "adaptive_batch", "pooled_model"):
            setattr(self, attr, getattr(policy, attr))

    def decide(self, now, cluster, jobs):
        decisions = self.policy.decide(now, cluster, jobs)
        self.seen += [(name, a.gpu_type, a.num_gpus, dict(a.placement)) for name, a in decisions.items() if a is not None]
        return decisions


@pytest.mark.parametrize("name", ["sia", "sia-oracle", "gavel", "fifo"])
def test_every_policy_runs_hybrid_jobs_in_whole_pipelines(name):
    families = {**load_catalog(), "hyb": hybrid_family(work=6_000.0)}
    cluster = Cluster.parse("t4:2x4,a100:1x8")
    jobs = [WorkloadJob("h0", 0.0, "hyb", 4, 64), WorkloadJob("c0", 60.0, "cifar10", 2, 256),
            WorkloadJob("h1", 120.0, "hyb", 8, 128), WorkloadJob("c1", 180.0, "cifar10", 1, 128)]
    policy = Recording(make_policy(name))
    sim = Simulator(jobs, families, SimConfig(cluster=cluster, max_hours=12), policy)
    result = sim.run()
    assert result.summary["finished"] == len(jobs)
    hybrid = [(gpu, gpus, placement) for job, gpu, gpus, placement in policy.seen if job.startswith("h")]
    assert hybrid
    for gpu, gpus, placement in hybrid:
        stages = {"a100": 2, "t4": 4}[gpu]
        assert gpus % stages == 0 and all(g % stages == 0 for g in placement.values()), (gpu, gpus, placement)
    if name == "sia":  # the jobs' models learn in pipelines
        model = next(j for j in sim.jobs if j.name == "h0").model
        assert model.num_stages == {"t4": 4, "a100": 2}
        assert all(o.num_stages == {"t4": 4, "a100": 2}[o.gpu_type] for o in model.observations)
        assert {o.num_replicas * o.num_stages for o in model.observations if o.gpu_type == "t4"} >= {4}


@pytest.mark.parametrize("name", ["sia", "sia-oracle", "gavel", "fifo"])
def test_a_pipeline_longer_than_a_node_spans_nodes(name):
    """8 stages on nodes of 4 T4s: one pipeline on 2 nodes (the candidates had assumed 1 stage and refused it)."""
    family = hybrid_family(stages={"t4": 8, "a100": 2}, work=6_000.0)
    assert family.candidates("t4", 2, 8).batch.size  # one pipeline over 2 nodes
    result = Simulator([WorkloadJob("h0", 0.0, "hyb", 8, 64)], {"hyb": family},
                       SimConfig(cluster=Cluster.parse("t4:2x4,a100:1x8"), max_hours=12), make_policy(name)).run()
    assert result.summary["finished"] == 1


def test_the_unaware_policy_runs_hybrid_jobs_with_one_stage_count_and_refuses_others():
    cluster = Cluster.parse("t4:2x4,a100:1x8")
    jobs = [WorkloadJob("h0", 0.0, "hyb", 4, 64), WorkloadJob("h1", 60.0, "hyb", 4, 64)]
    same = Recording(make_policy("unaware"))
    result = Simulator(jobs, {"hyb": hybrid_family(stages=2, work=6_000.0)}, SimConfig(cluster=cluster), same).run()
    assert result.summary["finished"] == 2 and all(gpus % 2 == 0 for _, _, gpus, _ in same.seen)
    with pytest.raises(ValidationError, match="heterogeneity-unaware"):
        Simulator(jobs, {"hyb": hybrid_family()}, SimConfig(cluster=cluster), make_policy("unaware"))


def test_a_pipeline_that_fits_no_node_pool_is_refused():
    with pytest.raises(ValidationError, match="fits no node pool"):
        Simulator([WorkloadJob("h", 0.0, "hyb", 4, 64)], {"hyb": hybrid_family(stages=16)},
                  SimConfig(cluster=Cluster.parse("t4:2x4,a100:1x8")), make_policy("sia-oracle"))


def test_goodput_simulate_runs_measured_pipeline_tables(tmp_path, capsys):
    from cli import main

    truth = tmp_path / "truth"
    write_pipeline_model(truth)
    write_workload([WorkloadJob("p0", 0.0, "pipe", 4, 32), WorkloadJob("p1", 60.0, "pipe", 8, 64)], tmp_path / "w.csv")
    code = main(["simulate", "--workload", str(tmp_path / "w.csv"), "--truth", str(truth), "--cluster", "t4:4x4,a100:2x8",
                 "--policy", "sia-oracle,gavel", "--processes", "1", "--no-mlflow", "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    for policy in ("sia-oracle", "gavel"):
        summary = json.loads((tmp_path / "out" / "w" / policy / "summary.json").read_text())
        assert summary["metrics"]["finished"] == 2
        assert summary["settings"]["restart_cost_s"] == "per application"


@pytest.mark.parametrize("requested", [1, 3])
def test_a_rigid_request_that_is_not_whole_pipelines_runs_on_the_smallest_that_is(requested):
    """The allocator serves a request with the fewest allowed GPUs not below it (one pipeline here): the
    simulator's up-front check had refused such a job as if its batch could not run."""
    families = {"hyb": hybrid_family(work=6_000.0)}
    cluster = Cluster.parse("t4:2x4,a100:1x8")
    result = Simulator([WorkloadJob("h", 0.0, "hyb", requested, 64)], families, SimConfig(cluster=cluster, max_hours=2),
                       make_policy("fifo")).run()
    assert result.summary["finished"] == 1

