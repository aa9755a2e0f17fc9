"""Simulator policies end to end: oracle vs a misinformed model, every policy runs, sweeps and compare."""

from __future__ import annotations

import json

import pytest

from experiments.simulator.engine import SimConfig, Simulator
from experiments.simulator.policies import POLICY_NAMES, make_policy
from experiments.simulator.truth import load_catalog
from experiments.simulator.workload import WorkloadJob, write_workload
from goodput import Cluster
from cli import main
from goodput.errors import ValidationError

CLUSTER = Cluster.parse("t4:2x4,a100:1x4")


def small_workload(n=8, gap=120.0):
    apps = ["cifar10", "deepspeech2", "cifar10", "yolov3"]
    return [WorkloadJob(f"j{i}", gap * i, apps[i % len(apps)], 2, 256) for i in range(n)]


def test_oracle_beats_a_deliberately_misinformed_model():
    """One job at a time on 4 T4s or 4 A100s: a model told that A100s are 6x slower than they are picks T4s."""
    families = load_catalog()
    cluster = Cluster.parse("t4:1x4,a100:1x4")
    jobs = [WorkloadJob(f"c{i}", 4000.0 * i, "cifar10", 4, 512) for i in range(3)]
    oracle = Simulator(jobs, families, SimConfig(cluster=cluster), make_policy("sia-oracle")).run()
    wrong = Simulator(jobs, families, SimConfig(cluster=cluster, observation_bias={"a100": 6.0}), make_policy("sia")).run()
    assert oracle.summary["finished"] == wrong.summary["finished"] == len(jobs)
    assert (oracle.jobs["gpu_types_used"] == "a100").all()
    assert (wrong.jobs["gpu_types_used"] == "t4").all()
    assert oracle.summary["avg_jct_s"] < 0.6 * wrong.summary["avg_jct_s"]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_finishes_a_small_workload_within_capacity(name):
    result = Simulator(small_workload(6), load_catalog(), SimConfig(cluster=CLUSTER), make_policy(name)).run()
    assert result.summary["finished"] == 6
    assert (result.rounds["gpus_t4"] <= 8).all() and (result.rounds["gpus_a100"] <= 4).all()
    assert result.settings["round_s"] == (360.0 if name == "gavel" else 60.0)


@pytest.mark.parametrize("name", ["gavel", "fifo"])
def test_rigid_policies_serve_a_request_larger_than_any_gpu_type_at_the_largest_type(name):
    """12 GPUs asked of a cluster whose types have 8 and 4: run on 8 T4s, not wait forever."""
    jobs = [WorkloadJob("big", 0.0, "cifar10", 12, 512), *small_workload(2)]
    result = Simulator(jobs, load_catalog(), SimConfig(cluster=CLUSTER, max_hours=24), make_policy(name)).run()
    assert result.summary["finished"] == 3
    big = result.jobs.set_index("name").loc["big"]
    assert big["gpu_types_used"] == "t4" and big["progress_fraction"] == 1.0
    assert result.rounds["gpus_t4"].max() == 8


@pytest.mark.parametrize("name", ["gavel", "fifo"])
def test_rigid_policies_refuse_a_job_whose_batch_cannot_run_on_its_gpus(name):
    """cifar10's micro-batches hold at least 32 samples: batch 16 on 1 GPU, or 64 on 4, had never been placed
    and the simulation had spun to max_hours with the job unfinished."""
    families = load_catalog()
    assert families["cifar10"].min_local_bsz == 32
    for gpus, batch in ((1, 16), (4, 64)):
        jobs = [WorkloadJob("small-batch", 0.0, "cifar10", gpus, batch), *small_workload(1)]
        with pytest.raises(ValidationError, match="small-batch.batch_size"):
            Simulator(jobs, families, SimConfig(cluster=CLUSTER), make_policy(name))
    Simulator([WorkloadJob("ok", 0.0, "cifar10", 2, 64)], families, SimConfig(cluster=CLUSTER), make_policy(name))
    # 3 GPUs are served by 4 (Sia's configuration set: 1, 2, 4 on a node), where batch 100 cannot split into 32s
    with pytest.raises(ValidationError, match="at least the 3 GPUs"):
        Simulator([WorkloadJob("three", 0.0, "cifar10", 3, 100)], families, SimConfig(cluster=CLUSTER), make_policy(name))
    # an adaptive policy picks its own batch: the same job runs
    result = Simulator([WorkloadJob("small-batch", 0.0, "cifar10", 4, 64)], families,
                       SimConfig(cluster=CLUSTER), make_policy("sia-oracle")).run()
    assert result.summary["finished"] == 1


def test_unknown_policy_is_refused():
    with pytest.raises(ValidationError, match="policy"):
        make_policy("lottery")


def test_sweep_runs_are_logged_and_found_by_compare(tmp_path, capsys):
    folder = tmp_path / "workloads"
    for i in (1, 2):
        write_workload(small_workload(4, gap=200.0 + 50 * i), folder / f"workload-{i}.csv")
    code = main(["simulate", "--workload", str(folder), "--policy", "sia-oracle,fifo,fifo", "--cluster", "t4:2x4,a100:1x4",
                 "--processes", "2", "--out", str(tmp_path / "out"), "--experiment", "sweep-test"])
    assert code == 0
    summary = json.loads((tmp_path / "out" / "workload-1" / "fifo" / "summary.json").read_text())
    assert summary["metrics"]["finished"] == 4 and len(summary["jcts"]) == 4
    for name in ("jobs.csv", "rounds.csv", "jct_cdf.png", "utilization.png", "allocation_timeline.png"):
        assert (tmp_path / "out" / "workload-2" / "sia-oracle" / name).stat().st_size > 0
    capsys.readouterr()
    assert main(["compare", "sweep-test", "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert "sia-oracle" in printed and "fifo" in printed
    import pandas as pd

    table = pd.read_csv(tmp_path / "cmp" / "comparison.csv")
    assert dict(zip(table["policy"], table["runs"])) == {"fifo": 2, "sia-oracle": 2}
    assert (tmp_path / "cmp" / "compare_avg_jct_s.png").exists()
    import mlflow

    runs = mlflow.search_runs(experiment_names=["sweep-test"])
    children = runs[runs["tags.mlflow.parentRunId"].notna()]
    assert len(children) == 4  # 2 workloads x 2 policies (fifo named twice runs once), under one parent sweep run


def test_compare_pools_a_policy_only_over_runs_with_the_same_settings(tmp_path):
    import mlflow

    from experiments.simulator.compare import compare_runs

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("mixed")
    for cluster, jct in (("t4:2x4", 100.0), ("t4:2x4", 300.0), ("t4:16x4", 50.0)):
        with mlflow.start_run():
            mlflow.log_params({"policy": "sia", "cluster": cluster, "round_s": 60.0})
            mlflow.log_metric("avg_jct_s", jct)
    frame = compare_runs("mixed", uri=uri).set_index("cluster")
    assert "round_s" not in frame  # the same everywhere: not a column
    assert frame.loc["t4:2x4", "runs"] == 2 and frame.loc["t4:2x4", "avg_jct_s_mean"] == pytest.approx(200.0)
    assert frame.loc["t4:16x4", "runs"] == 1 and frame.loc["t4:16x4", "avg_jct_s_mean"] == pytest.approx(50.0)
    mlflow.set_experiment("restarts")  # goodput simulate --restart-cost: had been pooled into one row
    for cost, jct in (("1.0", 100.0), ("3000.0", 900.0), ("per application", 400.0)):
        with mlflow.start_run():
            mlflow.log_params({"policy": "fifo", "cluster": "t4:2x4", "restart_cost_s": cost})
            mlflow.log_metric("avg_jct_s", jct)
    frame = compare_runs("restarts", uri=uri).set_index("restart_cost_s")
    assert frame["runs"].tolist() == [1, 1, 1] and frame.loc["3000.0", "avg_jct_s_mean"] == pytest.approx(900.0)


def test_compare_on_a_missing_experiment_is_a_clean_error(capsys):
    assert main(["compare", "no-such-experiment"]) == 2
    assert "no MLflow experiment" in capsys.readouterr().err


def test_unaware_jobs_model_every_gpu_type_as_one():
    """The Pollux-like baseline: one model per job that cannot tell GPU types apart; its table is the same on each type."""
    families = load_catalog()
    sim = Simulator(small_workload(3), families, SimConfig(cluster=CLUSTER), make_policy("unaware"))
    sim.run()
    model = sim.jobs[0].model
    assert model.gpu_types == ["pooled"]
    table = sim.jobs[0].table.frame
    t4 = table[(table.gpu_type == "t4") & (table.num_gpus == 4)].goodput.iloc[0]
    a100 = table[(table.gpu_type == "a100") & (table.num_gpus == 4)].goodput.iloc[0]
    assert t4 == pytest.approx(a100)


def test_a_goodput_quantile_names_the_policy_and_is_recorded(tmp_path, capsys):
    policy = make_policy("sia", goodput_quantile=0.25)
    assert policy.name == "sia-q0.25" and policy.options == {"goodput_quantile": 0.25}
    assert make_policy("sia", goodput_quantile=0.5).name == "sia"
    for bad in (0.0, 1.5):
        with pytest.raises(ValidationError, match="goodput_quantile"):
            make_policy("sia", goodput_quantile=bad)
    folder = tmp_path / "workloads"
    write_workload(small_workload(4, gap=200.0), folder / "workload-1.csv")
    code = main(["simulate", "--workload", str(folder), "--policy", "sia", "--goodput-quantile", "0.25,0.5",
                 "--cluster", "t4:2x4,a100:1x4", "--processes", "1", "--out", str(tmp_path / "out"), "--no-mlflow"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "sia-q0.25" in printed
    for label in ("sia-q0.25", "sia"):
        summary = json.loads((tmp_path / "out" / "workload-1" / label / "summary.json").read_text())
        assert summary["metrics"]["finished"] == 4
        assert summary["settings"]["policy"] == label
    quantiled = json.loads((tmp_path / "out" / "workload-1" / "sia-q0.25" / "summary.json").read_text())
    assert quantiled["settings"]["goodput_quantile"] == 0.25
    assert main(["simulate", "--synthetic", "2", "--goodput-quantile", "1", "--no-mlflow"]) == 2
    assert "goodput_quantile" in capsys.readouterr().err
