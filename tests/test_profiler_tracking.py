"""Profiles logged to MLflow, and the goodput profile / demo commands, end to end on the CPU."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest

from goodput import Profile, tracking
from cli import main
from profilers import log_profile, profile_job
from profilers.tracking import metric_key
from tests.profiler_jobs import tiny_mlp


def _artifacts(run_id: str) -> set[str]:
    return {Path(a.path).name for a in mlflow.MlflowClient().list_artifacts(run_id)}


def test_profile_job_logs_params_metrics_and_artifacts(tmp_path):
    out = tmp_path / "logged.jsonl"
    profile = profile_job(**tiny_mlp().profile_args(), batch_sizes=[4, 16], replicas=[], cpu_threads=1,
                          time_budget_s=5, out=out, progress=False, mlflow=True)
    runs = mlflow.search_runs(experiment_names=["profiles"])
    assert len(runs) == 1
    run = runs.iloc[0]
    assert run["params.job"] == "zoo-mlp" and run["params.init_batch_size"] == "16"
    assert run["params.device_types"] == '["cpu"]' and run["params.grid"] == "[4, 16]"
    for obs in profile.observations:
        assert run[f"metrics.{metric_key(obs)}"] == pytest.approx(obs.throughput)
        assert run[f"metrics.step_time.cpu.r1.b{obs.local_bsz}"] == pytest.approx(obs.step_time)
    assert run["metrics.seconds.cpu"] > 0
    assert _artifacts(run["run_id"]) == {"logged.jsonl", "throughput.png"}


def test_log_profile_without_a_file_saves_one(tmp_path):
    profile = profile_job(**tiny_mlp().profile_args(), batch_sizes=[4], replicas=[], cpu_threads=1,
                          time_budget_s=5, progress=False)
    run_id = log_profile(profile, experiment="profiles-2", run_name="x")
    assert _artifacts(run_id) == {"zoo-mlp.jsonl", "throughput.png"}
    local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="zoo-mlp.jsonl", dst_path=str(tmp_path))
    assert Profile.load(local).observations == profile.observations
    png = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="throughput.png", dst_path=str(tmp_path))
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profiles_logged_under_one_active_run_go_to_it_then_to_nested_runs(tmp_path):
    first = profile_job(**tiny_mlp().profile_args(), batch_sizes=[4], replicas=[], cpu_threads=1, time_budget_s=5,
                        progress=False)
    second = profile_job(**tiny_mlp(init_batch_size=8).profile_args(), batch_sizes=[8], replicas=[], cpu_threads=1,
                         time_budget_s=5, progress=False)
    with tracking.start_run("profiles-active") as outer:  # the caller's own run, on the test's store
        assert log_profile(first, tmp_path / "a.jsonl") == outer.info.run_id  # the caller's run
        inner = log_profile(second, tmp_path / "b.jsonl")  # its params are set: a nested run of its own
    assert inner != outer.info.run_id
    run = mlflow.get_run(inner)
    assert run.data.tags["mlflow.parentRunId"] == outer.info.run_id and run.data.params["init_batch_size"] == "8"
    assert mlflow.get_run(outer.info.run_id).data.params["init_batch_size"] == "16"


def test_cli_profile_zoo_and_factory(tmp_path, capsys):
    out = tmp_path / "zoo.jsonl"
    assert main(["profile", "--zoo", "mlp", "--out", str(out), "--batch-sizes", "4,16", "--replicas", "0",
                 "--time-budget", "5", "--memory-cap", "1G", "--cpu-threads", "1", "--no-progress"]) == 0
    assert "observations of zoo-mlp on cpu" in capsys.readouterr().out
    profile = Profile.load(out)
    assert sorted(o.local_bsz for o in profile.observations) == [4, 16]
    assert profile.metadata["profiler"]["memory_cap_bytes"] == 2**30 and profile.metadata["profiler.cpu"]["threads"] == 1

    out2 = tmp_path / "factory.jsonl"
    assert main(["profile", "tests.profiler_jobs:workload_dict", "--out", str(out2), "--batch-sizes", "4",
                 "--replicas", "0", "--time-budget", "5", "--cpu-threads", "1", "--mlflow"]) == 0
    printed = capsys.readouterr().out
    assert "profile of dict-job" in printed and "logged MLflow run" in printed
    assert Profile.load(out2).init_batch_size == 8


def test_cli_profile_that_measures_nothing_says_why_and_fails(tmp_path, capsys):
    out = tmp_path / "empty.jsonl"
    assert main(["profile", "--zoo", "mlp", "--memory-cap", "1K", "--time-budget", "3", "--no-progress", "--out", str(out)]) == 1
    assert "nothing measured (cpu: memory_cap)" in capsys.readouterr().err


def test_cli_profile_errors_are_clean(capsys):
    assert main(["profile", "no_such_module:f", "--no-progress"]) == 2
    assert "cannot import" in capsys.readouterr().err
    assert main(["profile", "--zoo", "vgg", "--no-progress"]) == 2
    assert "unknown zoo model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["profile", "--zoo", "mlp", "--memory-cap", "lots"])
    with pytest.raises(SystemExit):
        main(["profile"])  # a factory or --zoo is required


def test_a_profile_goes_into_a_nested_run_when_the_caller_s_run_holds_one_of_its_params_with_another_value(tmp_path):
    profile = profile_job(**tiny_mlp().profile_args(), batch_sizes=[4], replicas=[], cpu_threads=1, time_budget_s=5,
                          progress=False)
    with tracking.start_run("profiles-active") as outer:
        mlflow.log_param("replicas", 4)  # the training script's own parameter of that name
        inner = log_profile(profile, tmp_path / "a.jsonl")  # MLflow would refuse to change it: nested
    assert inner != outer.info.run_id
    assert mlflow.get_run(inner).data.tags["mlflow.parentRunId"] == outer.info.run_id
    assert mlflow.get_run(outer.info.run_id).data.params == {"replicas": "4"}
