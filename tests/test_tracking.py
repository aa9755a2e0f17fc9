"""MLflow at the edges (goodput.tracking): what the store refuses is one clear error, and a sweep's parent run
ends with the sweep's fate."""

from __future__ import annotations

import argparse

import mlflow
import pytest

from cli import main
from experiments import benchutil
from goodput import tracking
from goodput.errors import ValidationError


def test_a_store_mlflow_refuses_is_a_validation_error_naming_it(tmp_path, monkeypatch):
    store = tracking.tracking_uri()
    uri = (tmp_path / "mlruns").as_uri()  # MLflow 3's file store is in maintenance mode: it refuses new runs
    with pytest.raises(tracking.TrackingError, match="tracking_uri") as caught:
        with tracking.start_run("x", uri=uri):
            pass
    assert isinstance(caught.value, ValidationError) and caught.value.value == uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # mlflow.set_tracking_uri had set it to the file store
    with tracking.start_run("gone"):
        pass
    mlflow.MlflowClient().delete_experiment(mlflow.get_experiment_by_name("gone").experiment_id)
    with pytest.raises(tracking.TrackingError, match="deleted experiment"):
        with tracking.start_run("gone"):
            pass


def test_a_command_whose_store_is_refused_says_so_in_one_line_after_saving_its_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    out = tmp_path / "sim"
    code = main(["simulate", "--synthetic", "2", "--policy", "fifo", "--cluster", "t4:1x4", "--max-hours", "2",
                 "--processes", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "tracking_uri" in err and "Traceback" not in err
    assert (out / "synthetic-2-seed0" / "fifo" / "summary.json").exists()  # the simulation's files are kept


@pytest.mark.parametrize("raised, status", [(None, "FINISHED"), (KeyboardInterrupt, "KILLED"), (RuntimeError, "FAILED")])
def test_a_parent_run_ends_with_what_happened_under_it(raised, status):
    seen = {}
    with pytest.raises(raised) if raised else _nothing():
        with tracking.parent_run("sweeps", "sweep:a,b", {"policies": ["a", "b"], "seed": 0}) as parent_id:
            seen["during"] = mlflow.get_run(parent_id).info.status
            with tracking.start_run("sweeps", run_name="a", tags={"mlflow.parentRunId": parent_id}):
                pass
            if raised:
                raise raised()
    run = mlflow.get_run(parent_id)
    assert seen["during"] == "RUNNING" and run.info.status == status
    assert run.data.params == {"policies": '["a", "b"]', "seed": "0"}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_synthetic_sweep_records_its_arrival_window_and_its_parent_ends_finished(tmp_path):
    code = main(["simulate", "--synthetic", "2", "--hours", "1", "--policy", "fifo,gavel", "--cluster", "t4:1x4",
                 "--max-hours", "2", "--processes", "1", "--out", str(tmp_path / "sim")])
    assert code == 0
    runs = mlflow.search_runs(experiment_names=["goodput-sim"])
    parent = runs[runs["tags.mlflow.parentRunId"].isna()]
    children = runs[runs["tags.mlflow.parentRunId"].notna()]
    assert list(parent["status"]) == ["FINISHED"] and len(children) == 2
    assert set(children["params.arrival_hours"]) == {"1.0"} and set(children["params.workload"]) == {"synthetic-2-seed0-1h"}


def test_benchmark_runs_carry_their_options_and_machine(tmp_path):
    args = argparse.Namespace(out_dir=str(tmp_path), mlflow=True, quick=True, online_rounds=3)
    path = benchutil.report("bench_x", [{"what": "fit", "ms": 1.5}], args)
    assert '"quick": true' in path.read_text()
    (run,) = mlflow.search_runs(experiment_names=["benchmarks"], output_format="list")
    assert run.data.params["quick"] == "True" and run.data.params["online_rounds"] == "3"
    assert run.data.params["machine.cpus"].isdigit()


def test_errors_inside_a_run_are_the_callers_not_the_stores():
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException, match="Changing param values"):
        with tracking.start_run("mine"):
            mlflow.log_param("a", 1)
            mlflow.log_param("a", 2)


def test_the_store_s_refusals_inside_a_run_are_tracking_errors():
    """A store locked or gone mid-run (MLflow's TEMPORARILY_UNAVAILABLE; a locked SQLite store gives it after
    its busy timeout) is the store's refusal, as when the run is opened: goodput accuracy prints its results first."""
    from mlflow.exceptions import MlflowException

    with pytest.raises(tracking.TrackingError, match="database is locked"):
        with tracking.start_run("mine"):
            raise MlflowException("(sqlite3.OperationalError) database is locked", error_code="TEMPORARILY_UNAVAILABLE")
