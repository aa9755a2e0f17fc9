"""Benchmarks stay runnable: each one's quick mode runs and saves its figures (no timing asserted here)."""

from __future__ import annotations

import json

import pytest

from experiments import bench


def test_bench_core_quick(tmp_path):
    assert bench.main(["--only", "core", "--quick", "--out-dir", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "bench_core.json").read_text())
    assert {row["what"].split(",")[0] for row in figures["rows"]} >= {"fit_throughput", "optimize_goodput", "JobModel.table"}
    assert all(row["median_ms"] > 0 for row in figures["rows"])


def test_bench_figures_reach_mlflow_under_names_it_takes(tmp_path, monkeypatch, capsys):
    """Row labels such as 'utilisation (mean)' had been refused as metric names: every --mlflow run had failed;
    a row set wider than a console's table is printed a line per row (bench_service's cells had all read '…')."""
    import argparse

    import mlflow

    from experiments.benchutil import report

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    rows = [{"what": "observe(1) + table(20 configurations), 200 obs", "median_ms": 5.0},
            {"what": "utilisation (mean)", "value": 0.5, **{f"extra_{i}": i for i in range(14)}}]
    report("bench_names", rows, argparse.Namespace(out_dir=str(tmp_path), mlflow=True))
    printed = capsys.readouterr().out
    assert "extra_13=13" in printed and "…" not in printed
    runs = mlflow.search_runs(experiment_names=["benchmarks"])
    assert runs["metrics.observe_1____table_20_configurations___200_obs.median_ms"].iloc[0] == 5.0
    assert runs["metrics.utilisation__mean_.value"].iloc[0] == 0.5


def test_bench_profiler_quick(tmp_path):
    assert bench.main(["--only", "profiler", "--quick", "--out-dir", str(tmp_path)]) == 0
    cost = json.loads((tmp_path / "bench_profiler_cost.json").read_text())["rows"]
    assert [row["what"] for row in cost] == ["profiling cost mlp"], cost
    assert cost[0]["seconds"] > 0 and cost[0]["batch_sizes"] >= 1 and cost[0]["budget_s"] == 4.0, cost
    accuracy = json.loads((tmp_path / "bench_profiler_accuracy.json").read_text())["rows"]
    assert accuracy[0]["profiler_ms"] > 0 and accuracy[0]["timer_ms"] > 0 and accuracy[0]["rel_error_pct"] >= 0, accuracy


def test_bench_model_quick(tmp_path):
    assert bench.main(["--only", "model", "--quick", "--out-dir", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "bench_model.json").read_text())
    whats = [row["what"] for row in figures["rows"]]
    assert any(w.startswith("observe(1) + table(20") for w in whats) and any(w.startswith("full refit") for w in whats)
    assert all(row["median_ms"] > 0 for row in figures["rows"]) and figures["gp_points"] >= 200
    # the path of a job partly predicted by transfer, with a cluster prior: timed without refits
    transfer = [row for row in figures["rows"] if "by transfer" in row["what"]]
    assert len(transfer) == 1 and transfer[0]["refits_during"] == 0, transfer
    assert any("hierarchy by EM" in w for w in whats)


def test_bench_service_quick(tmp_path):
    from experiments import bench_service

    assert "bench_service" in bench.discover()
    # the kill -9 part runs in tests/test_service_restart.py
    assert bench_service.main(["--quick", "--parts", "load,reporter,prior", "--out-dir", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "bench_service.json").read_text())
    rows = {row["what"].split(",")[0]: row for row in figures["rows"]}
    assert rows["ingest"]["observations"] == 5 * 40 and rows["ingest"]["failed"] == 0 and rows["ingest"]["per_s"] > 0
    queries = [row for row in figures["rows"] if row["what"].startswith("GET")]
    assert len(queries) == 6 and all(row["errors"] == 0 and 0 < row["p50_ms"] <= row["p99_ms"] for row in queries)
    assert rows["reporter cost per training step"]["reporter_us"] > 0
    prior = rows["cluster prior learned beside the worker (5 jobs x 40"]
    assert prior["learned"] and prior["cells"] == 5 * 3 and prior["failed"] == 0 and 0 < prior["learn_s"] < prior["start_to_republished_s"]
    assert prior["learning_probes"] == prior["refresh_probes"] == 4
    assert 0 < prior["learning_absorbed_median_s"] <= prior["learning_absorbed_max_s"]
    assert 0 < prior["refresh_absorbed_median_s"] <= prior["refresh_absorbed_max_s"] <= prior["refresh_republished_s"]
    assert prior["restart_restored"] and 0 < prior["restart_to_republished_s"]
    assert figures["load_average_before"] and figures["jobs"] == 5


def test_bench_heterogeneous_quick(tmp_path):
    assert bench.main(["--only", "heterogeneous", "--quick", "--out-dir", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "bench_heterogeneous.json").read_text())
    means = {row["what"].split(":")[0]: row for row in figures["rows"] if "mean over" in row["what"]}
    assert set(means) == {"sia", "unaware", "gavel"}
    for row in means.values():
        assert row["finished"] == row["jobs"] > 0
        assert 0 < row["avg_jct_s"] <= row["p99_jct_s"] and row["makespan_s"] > 0 and row["gpu_hours"] > 0
    assert figures["restart_cost"] == "per application" and len(figures["load_average_before"]) == 3


def test_bench_scale_quick(tmp_path):
    """The scale benchmark's smoke run (256 GPUs, half an hour): every part measured and saved."""
    from experiments import bench_scale

    assert bench_scale.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "bench_scale.json").read_text())
    rows = {row["what"]: row for row in figures["rows"]}
    assert rows["wall seconds"]["value"] > 0 and len(figures["round_s"]) == len(figures["active_per_round"]) > 20
    assert max(figures["active_per_round"]) >= figures["threshold"]  # some rounds at "scale"
    assert any(w.startswith("allocate ms at") for w in rows) and figures["solvers_at_scale"]
    assert figures["milp_distances"] and figures["milp_distances"][0]["milp_status"] == "optimal"
    assert abs(figures["milp_distances"][0]["vs_milp"]) < 1e-3  # the answer against the exact optimum
    assert figures["online"]["model_s"] > 0 and figures["online"]["jobs_with_models"] > 0
    assert figures["load_average_before"] and figures["policy"] == "sia-oracle"


def test_bench_simulator_quick_with_time_split(tmp_path):
    from experiments import bench_simulator

    assert bench_simulator.main(["--quick", "--policies", "sia,sia-oracle", "--processes", "1",
                                 "--out-dir", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "bench_simulator.json").read_text())
    split = figures["split"]
    assert sum(v for k, v in split["spent"].items() if k.startswith("model: refit")) > 0
    assert split["spent"]["allocate (ILP, inputs, placement)"] > 0
    assert sum(split["spent"].values()) == pytest.approx(split["wall_s"], rel=0.05)  # the parts add up
    swept = [row for row in figures["rows"] if row["what"] == "sia wall seconds, slowest workload in the sweep (1 at a time)"][0]
    assert swept["target"] == 20.0 and swept["sia_simulator_s"] == 408.0
    alone = [row for row in figures["rows"] if row["what"].startswith("sia wall seconds, slowest workload alone")][0]
    assert alone["target"] == 20.0 and alone["value"] == pytest.approx(split["wall_s"])


def test_gpu_check_script_refuses_a_machine_without_cuda(tmp_path):
    """experiments/gpu_check.sh parses, and on a machine without CUDA stops before any step, saying why."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the script itself")
    root = Path(__file__).resolve().parents[1]
    script = root / "experiments" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    done = subprocess.run(["bash", str(script), str(tmp_path / "out"), sys.executable], cwd=root, capture_output=True, text=True)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
    assert not any((tmp_path / "out").iterdir())
