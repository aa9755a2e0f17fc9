"""The console command's faults end in one line, ``goodput CMD: error: ...``, and a non-zero exit: no traceback,
no silently accepted nonsense, no work done (or files created) before a bad argument is refused."""

from __future__ import annotations

import json
import sys

import pytest

from goodput import GoodputTable, Profile, save_tables
from cli import main
from tests.test_model import observations


def error_line(capsys, command: str, *fragments: str) -> str:
    """The single ``goodput COMMAND: error:`` line on stderr (argparse may print its usage before it)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(f"goodput {command}: error: ")]
    assert len(lines) == 1 and err.rstrip("\n").endswith(lines[0]), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def profile_file(tmp_path, name="p.jsonl", job="j"):
    path = tmp_path / name
    Profile(observations(job), job=job, init_batch_size=64).save(path)
    return path


def table(job: str) -> GoodputTable:
    return GoodputTable(job, [{"gpu_type": "t4", "num_nodes": 1, "num_gpus": g, "goodput": 100.0 * g} for g in (1, 2)])


@pytest.fixture
def no_profiling(monkeypatch):
    """``goodput demo`` must refuse its arguments before it profiles anything."""
    import profilers

    def refuse(**kwargs):
        raise AssertionError("profile_job ran before the arguments were checked")

    monkeypatch.setattr(profilers, "profile_job", refuse)


# ---------------------------------------------------------------- 1. profile MODULE:FACTORY from the working directory


def test_profile_factory_imports_a_package_in_the_working_directory(tmp_path, monkeypatch, capsys):
    package = tmp_path / "cwd_jobs_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "jobs.py").write_text("def make_job():\n    return {'job': 'mine'}\n")
    # as the console script runs: sys.path[0] is its bin/ folder, not the working directory
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    for name in ("cwd_jobs_pkg", "cwd_jobs_pkg.jobs"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert main(["profile", "cwd_jobs_pkg.jobs:make_job", "--no-progress"]) == 2
    error_line(capsys, "profile", "the returned mapping lacks")  # imported and called: not "cannot import"
    assert sys.modules["cwd_jobs_pkg.jobs"].__file__ == str(package / "jobs.py")
    sys.modules.pop("cwd_jobs_pkg.jobs")
    sys.modules.pop("cwd_jobs_pkg")


# ---------------------------------------------------------------- 2. fit --out, then allocate


def test_allocate_reads_the_table_fit_writes(tmp_path, capsys):
    assert main(["fit", str(profile_file(tmp_path)), "--cluster", "t4:2x4", "--out", "table.json"]) == 0
    capsys.readouterr()
    assert main(["allocate", "table.json", "--cluster", "t4:2x4", "--json"]) == 0
    allocation = json.loads(capsys.readouterr().out)
    assert list(allocation["allocations"]) == ["j"], allocation


def test_allocate_reads_several_table_files_and_refuses_a_job_twice(tmp_path, capsys):
    table("a").to_json("a.json")
    save_tables([table("b"), table("c")], "bc.json")
    assert main(["allocate", "a.json", "bc.json", "--cluster", "t4:1x4", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["allocations"]) == {"a", "b", "c"}
    save_tables([table("a")], "again.json")
    assert main(["allocate", "a.json", "again.json", "--cluster", "t4:1x4"]) == 2
    error_line(capsys, "allocate", "tables='again.json'", "job 'a' is in a.json already")


# ---------------------------------------------------------------- 3. OS errors


def test_a_directory_given_for_a_file_is_a_one_line_error(tmp_path, capsys):
    assert main(["fit", str(tmp_path), "--cluster", "t4:1x1"]) == 2
    error_line(capsys, "fit", f"Is a directory: {tmp_path}")
    assert main(["allocate", str(tmp_path), "--cluster", "t4:1x1"]) == 2
    error_line(capsys, "allocate", f"Is a directory: {tmp_path}")


def test_unusable_out_paths_are_refused_before_the_work(tmp_path, monkeypatch, capsys):
    from goodput import JobModel

    def refuse(*args, **kwargs):
        raise AssertionError("fitted before --out was checked")

    monkeypatch.setattr(JobModel, "from_profile", refuse)
    profile = str(profile_file(tmp_path))
    (tmp_path / "afile.json").write_text("{}")
    assert main(["fit", profile, "--cluster", "t4:1x1", "--out", str(tmp_path)]) == 2
    error_line(capsys, "fit", "out=", "is a directory; expected a file")
    assert main(["fit", profile, "--cluster", "t4:1x1", "--out", "afile.json/t.json"]) == 2
    error_line(capsys, "fit", "out='afile.json/t.json'", f"{tmp_path / 'afile.json'} is not a directory")
    assert main(["profile", "--zoo", "mlp", "--out", str(tmp_path), "--no-progress"]) == 2
    error_line(capsys, "profile", "is a directory; expected a file")
    assert main(["accuracy", str(tmp_path), "--out", "afile.json", "--no-mlflow"]) == 2
    error_line(capsys, "accuracy", "out='afile.json': is a file; expected a directory")
    assert main(["compare", "sweep", "--out", "afile.json"]) == 2
    error_line(capsys, "compare", "out='afile.json': is a file; expected a directory")


def test_an_os_error_names_the_users_path_not_a_temporary_file():
    from cli import _message
    from cli._common import writing

    with pytest.raises(FileNotFoundError) as info:
        with writing("/somewhere/a.json"):
            raise FileNotFoundError(2, "No such file or directory", "/somewhere/.a.json.x1y2.tmp")
    assert _message(info.value) == "No such file or directory: /somewhere/a.json"
    replaced = IsADirectoryError(21, "Is a directory", "/x/.t.json.abc.tmp", None, "/x/t.json")  # os.replace(tmp, path)
    assert _message(replaced) == "Is a directory: /x/t.json"


def test_fit_out_failing_midway_names_the_users_path(tmp_path, monkeypatch, capsys):
    """The table's atomic write fails on its temporary file: the message names --out, not the temporary."""
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "t.json"

    def refuse(self, path):
        raise PermissionError(13, "Permission denied", str(tmp_path / ".t.json.x1y2.tmp"))

    monkeypatch.setattr(GoodputTable, "to_json", refuse)
    assert main(["fit", str(profile_file(tmp_path)), "--cluster", "t4:1x1", "--out", str(target)]) == 2
    error_line(capsys, "fit", f"Permission denied: {target}")


# ---------------------------------------------------------------- 4, 6, 7. demo's arguments


def test_demo_refuses_a_cluster_without_a_profiled_type(no_profiling, capsys):
    assert main(["demo", "--zoo", "mlp", "--no-mlflow", "--cluster", "fakegpu:1x4"]) == 2
    error_line(capsys, "demo", "cluster='fakegpu:1x4'", "none of its GPU type(s) fakegpu is profiled here")


def test_demo_refuses_negative_replicas_and_no_jobs(no_profiling, capsys):
    assert main(["demo", "--zoo", "mlp", "--replicas", "-3", "--no-mlflow"]) == 2
    error_line(capsys, "demo", "replicas=-3: must be >= 0")
    assert main(["demo", "--zoo", "", "--no-mlflow"]) == 2
    error_line(capsys, "demo", "zoo=''")


def test_demo_help_says_what_zero_replicas_means(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "0 or 1: none" in " ".join(capsys.readouterr().out.split())


# ---------------------------------------------------------------- 5, 7. accuracy's arguments


@pytest.fixture
def profiles_dir(tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir()
    profile_file(folder, "j.jsonl")
    return folder


def test_accuracy_unknown_models_protocols_and_methods_are_clean_errors(profiles_dir, capsys):
    assert main(["accuracy", str(profiles_dir), "--models", "ghost", "--no-mlflow", "--no-progress"]) == 2
    error_line(capsys, "accuracy", "models='ghost'", "unknown model(s) ghost", "holds j")
    for option, value in (("--protocols", "P9"), ("--methods", "foo"), ("--methods", ",")):
        with pytest.raises(SystemExit) as info:
            main(["accuracy", str(profiles_dir), option, value, "--no-mlflow"])
        assert info.value.code == 2
        error_line(capsys, "accuracy", f"argument {option}: {option[2:]}={value!r}", "choose from")


def test_accuracy_on_a_file_says_it_is_not_a_directory(tmp_path, capsys):
    save_tables([table("a")], "tables.json")
    assert main(["accuracy", "tables.json", "--no-mlflow", "--no-progress"]) == 2
    error_line(capsys, "accuracy", "data_dir='tables.json': is a file, not a directory")


def test_accuracy_harness_refuses_bad_subsets_as_validation_errors():
    from experiments.accuracy_args import checked_subset
    from goodput.errors import ValidationError

    with pytest.raises(ValidationError, match="protocols='P9'"):
        checked_subset("protocols", "P9", ("P1", "P2"))
    with pytest.raises(ValidationError, match="none given"):
        checked_subset("methods", " , ", ("bayes",))
    assert checked_subset("protocols", "P2,P1,P2", ("P1", "P2")) == ["P2", "P1"]
    for bad in (None, 3, ["P1", ["P2"]]):  # had been TypeErrors
        with pytest.raises(ValidationError, match="protocols"):
            checked_subset("protocols", bad, ("P1", "P2"))


# ---------------------------------------------------------------- 5, 6, 9. simulate's arguments


def test_simulate_refuses_a_file_that_is_not_a_catalog(tmp_path, capsys):
    (tmp_path / "notcatalog.json").write_text("{}")
    assert main(["simulate", "--synthetic", "2", "--truth", "notcatalog.json", "--no-mlflow"]) == 2
    error_line(capsys, "simulate", "notcatalog.json: families=None")
    (tmp_path / "partial.json").write_text(json.dumps({"families": {"a": {"params": {"t4": {}}}}}))
    assert main(["simulate", "--synthetic", "2", "--truth", "partial.json", "--cluster", "t4:1x4", "--no-mlflow"]) == 2
    error_line(capsys, "simulate", "partial.json: families.a.init_batch_size=None: missing")


@pytest.mark.parametrize("option, value, message", [
    ("--policy", ",", "policy=','"),
    ("--processes", "0", "processes=0: must be >= 1"),
    ("--processes", "-1", "processes=-1: must be >= 1"),
    ("--round", "0", "round_s=0.0: must be > 0"),
    ("--max-hours", "-1", "max_hours=-1.0: must be > 0"),
    ("--seed", "-1", "seed=-1: must be >= 0"),  # had been numpy's traceback
])
def test_simulate_refuses_bad_options_before_simulating(monkeypatch, capsys, option, value, message):
    from experiments.simulator import runner

    def refuse(*args, **kwargs):
        raise AssertionError("loaded the truth before the options were checked")

    monkeypatch.setattr(runner, "load_truth", refuse)
    assert main(["simulate", "--synthetic", "2", "--policy", "sia,fifo", option, value, "--no-mlflow"]) == 2
    error_line(capsys, "simulate", message)


def test_run_sweep_checks_every_task_before_its_worker_processes(monkeypatch):
    from experiments.simulator import runner
    from goodput.errors import ValidationError

    def refuse(*args, **kwargs):
        raise AssertionError("worker processes started before the tasks were checked")

    monkeypatch.setattr(runner, "ProcessPoolExecutor", refuse)
    tasks = [runner.Task(f"w{i}", (), "sia", "t4:1x4", round_s=0.0 if i else None) for i in range(2)]
    with pytest.raises(ValidationError, match="round_s=0.0"):
        runner.run_sweep(tasks, processes=2)
    with pytest.raises(ValidationError, match="processes=0"):
        runner.run_sweep(tasks, processes=0)


# ---------------------------------------------------------------- 5, 8. compare only reads


def test_compare_creates_no_tracking_store(tmp_path, capsys):
    assert main(["compare", "my-sweep"]) == 2  # the default store: $MLFLOW_TRACKING_URI, tmp_path/mlflow.db here
    error_line(capsys, "compare", f"no tracking store at {tmp_path / 'mlflow.db'}")
    assert not (tmp_path / "mlflow.db").exists()
    uri = f"sqlite:///{tmp_path / 'deep' / 'er' / 'mlflow.db'}"
    assert main(["compare", "my-sweep", "--tracking-uri", uri]) == 2
    error_line(capsys, "compare", "no tracking store at")
    assert not (tmp_path / "deep").exists()


def test_compare_on_an_unsupported_store_is_a_clean_error(capsys):
    assert main(["compare", "x", "--tracking-uri", "bogus://x"]) == 2
    error_line(capsys, "compare", "tracking_uri='bogus://x': cannot read the MLflow store")


def test_compare_leaves_a_sqlite_file_that_is_not_an_mlflow_store_as_it_was(tmp_path, capsys):
    import sqlite3

    from service.store import Store

    text = tmp_path / "bad.json"
    text.write_text("not json")
    assert main(["compare", "x", "--tracking-uri", f"sqlite:///{text}"]) == 2  # had been SQLAlchemy's traceback
    error_line(capsys, "compare", "cannot read the MLflow store: file is not a database")
    Store(f"sqlite:///{tmp_path / 'goodput.db'}").close()
    assert main(["compare", "x", "--tracking-uri", f"sqlite:///{tmp_path / 'goodput.db'}"]) == 2
    error_line(capsys, "compare", "is not an MLflow store")
    with sqlite3.connect(tmp_path / "goodput.db") as connection:  # MLflow's migrations had added 65 tables
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables == {"goodput_jobs", "goodput_observations", "goodput_cluster_priors"}
    (tmp_path / "empty.db").touch()
    assert main(["compare", "x", "--tracking-uri", f"sqlite:///{tmp_path / 'empty.db'}"]) == 2
    error_line(capsys, "compare", "is empty")
    assert (tmp_path / "empty.db").stat().st_size == 0
