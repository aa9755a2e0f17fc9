"""Benchmarks stay runnable: each one's quick mode runs and saves its figures (no timing asserted here)."""

from __future__ import annotations

import json

from experiments import bench


def test_bench_core_quick(tmp_path):
    assert bench.main(["--only", "core", "--quick", "--out-dir", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "bench_core.json").read_text())
    assert {row["what"].split(",")[0] for row in figures["rows"]} >= {"fit_throughput", "optimize_goodput", "JobModel.table"}
    assert all(row["median_ms"] > 0 for row in figures["rows"])


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
    assert any("calibrations" in w for w in whats)
