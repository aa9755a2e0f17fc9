"""Edge cases of the experiments: accuracy resume and options, simulator inputs, fairness of starved
jobs, recorded settings, the simulate and compare CLIs, notebook saving."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from experiments import accuracy
from experiments.simulator.engine import Assignment, SimConfig, Simulator
from experiments.simulator.runner import Task, load_truth, run_task, truth_settings
from experiments.simulator.truth import ParametricFamily
from experiments.simulator.workload import WorkloadJob, write_workload
from goodput import Cluster
from cli import main
from goodput.errors import ValidationError
from goodput.throughput import ThroughputParams
from tests.sim_doubles import FixedPolicy
from tests.test_accuracy import _write_layout

TOY = ParametricFamily(name="toy", init_batch_size=32, max_batch_size=32, min_local_bsz=1, max_local_bsz={"t4": 64},
                       work=1000.0, noise=((0.0, 1e9), (1.0, 1e9)), restart_cost_s=30.0,
                       params={"t4": ThroughputParams(0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0)})  # 100 s of work on 1 GPU


class Plan:
    """An oracle, fixed-batch policy whose allocation per job a function gives."""

    name = "plan"
    round_s = 60.0
    oracle = True
    adaptive_batch = False
    pooled_model = False

    def __init__(self, plan):
        self.plan = plan

    def decide(self, now, cluster, jobs):
        return {j.name: self.plan(j) for j in jobs}


def _toy_run(plan, jobs, **config):
    cfg = SimConfig(cluster=Cluster.parse("t4:2x4"), step_noise=0, grad_noise=0, **config)
    return Simulator(jobs, {"toy": TOY}, cfg, Plan(plan)).run()


# ====================================================================== accuracy


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    return _write_layout(tmp_path / "measured")


def test_resume_refuses_a_folder_written_with_model_sizes_when_run_without(layout, tmp_path):
    out = tmp_path / "res"
    kw = dict(models=["small"], protocols=["P1"], methods=["pollux"], mlflow=False, progress=False)
    accuracy.run(layout, out, model_sizes={"small": 1e6, "resnet": 2e6}, **kw)
    with pytest.raises(accuracy.ResumeMismatchError, match="model_sizes"):
        accuracy.run(layout, out, model_sizes="none", resume=True, **kw)
    # the other way round too
    accuracy.run(layout, out, model_sizes="none", **kw)
    with pytest.raises(accuracy.ResumeMismatchError, match="model_sizes"):
        accuracy.run(layout, out, model_sizes={"small": 1e6}, resume=True, **kw)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["default_gpu_type"] == "t4"  # a setting that changes results is recorded


@pytest.mark.parametrize("option, value", [("seeds", -2), ("seeds", 0), ("p4_max_test", 0), ("p4_max_test", -1)])
def test_accuracy_options_are_validated(tmp_path, option, value):
    with pytest.raises(ValidationError, match=option):
        accuracy.run(tmp_path / "not-read", tmp_path / "out", mlflow=False, progress=False, **{option: value})


def test_cli_accuracy_rejects_a_negative_p4_max_test(layout, capsys):
    assert main(["accuracy", str(layout), "--p4-max-test", "-1", "--protocols", "P4", "--no-mlflow", "--no-progress"]) == 2
    assert "p4_max_test" in capsys.readouterr().err


# ====================================================================== simulator


def test_a_starved_job_counts_as_treated_unfairly():
    jobs = [WorkloadJob("a", 0.0, "toy", 1, 32), WorkloadJob("b", 0.0, "toy", 1, 32)]
    both = _toy_run(lambda j: Assignment("t4", 1, 1, ((("t4-0" if j.name == "a" else "t4-1"), 1),)), jobs, max_hours=1.0)
    starved = _toy_run(lambda j: Assignment("t4", 1, 1, (("t4-0", 1),)) if j.name == "a" else None, jobs, max_hours=1.0)
    assert both.summary["unfair_fraction"] == 0.0
    assert starved.summary["unfinished"] == 1
    assert starved.summary["unfair_fraction"] == pytest.approx(0.5)
    assert starved.summary["ftf_rho_median"] > both.summary["ftf_rho_median"]


def test_duplicate_job_names_are_refused():
    jobs = [WorkloadJob("a", 0.0, "toy", 4, 32), WorkloadJob("a", 10.0, "toy", 4, 32)]
    with pytest.raises(ValidationError, match="duplicate job name"):
        _toy_run(lambda j: Assignment("t4", 1, 4, (("t4-0", 4),)), jobs)
    with pytest.raises(ValidationError, match="duplicate job name"):
        Task("w", tuple(jobs), "fifo", "t4:2x4")


def test_cluster_types_without_ground_truth_are_refused(tmp_path, capsys):
    cluster = Cluster.parse("t4:1x4,h100:1x8")
    with pytest.raises(ValidationError, match="h100"):
        Simulator([WorkloadJob("a", 0.0, "toy", 1, 32)], {"toy": TOY}, SimConfig(cluster=cluster), FixedPolicy("t4", 1))
    with pytest.raises(ValidationError, match="h100"):
        load_truth("catalog", cluster)
    with pytest.raises(ValidationError, match=r"the truth covers a100, rtx2080ti, t4, v100\)"):  # not the cluster's
        load_truth("catalog", Cluster.parse("h100:1x8"))  # had said "covers none"
    path = write_workload([WorkloadJob("c", 0.0, "cifar10", 1, 128)], tmp_path / "w.csv")
    code = main(["simulate", "--workload", str(path), "--policy", "fifo", "--cluster", "t4:1x4,h100:1x8", "--processes", "1",
                 "--no-mlflow", "--out", str(tmp_path / "out")])
    assert code == 2 and "h100" in capsys.readouterr().err


def test_observation_bias_keys_must_be_cluster_types():
    with pytest.raises(ValidationError, match="v100"):
        SimConfig(cluster=Cluster.parse("t4:1x4"), observation_bias={"v100": 2.0})
    with pytest.raises(ValidationError, match="V100"):
        SimConfig(cluster=Cluster.parse("t4:1x4"), observation_bias={"V100": 2.0})
    assert SimConfig(cluster=Cluster.parse("t4:1x4"), observation_bias={"t4": 2.0}).observation_bias == {"t4": 2.0}


@pytest.mark.parametrize("field, value", [("seed", -1), ("seed", 1.5), ("bootstrap_batches", 2.5), ("report_every", "3"),
                                          ("report_every", 0)])
def test_sim_config_integers_are_checked(field, value):
    """These had reached numpy or a comparison as a TypeError (seed=1.5: 'SeedSequence expects int')."""
    with pytest.raises(ValidationError, match=f"{field}="):
        SimConfig(cluster=Cluster.parse("t4:1x4"), **{field: value})


def test_settings_that_change_results_are_recorded():
    result = _toy_run(lambda j: Assignment("t4", 1, 1, (("t4-0", 1),)), [WorkloadJob("a", 0.0, "toy", 1, 32)],
                      max_hours=2.0, bootstrap_batches=3, table_refresh=0.1, observation_bias={"t4": 1.5})
    settings = result.settings
    assert settings["max_hours"] == 2.0 and settings["bootstrap_batches"] == 3 and settings["table_refresh"] == 0.1
    assert settings["observation_bias"] == {"t4": 1.5}
    json.dumps(settings)  # summary.json takes it as is
    task = Task("w", (WorkloadJob("c", 0.0, "cifar10", 1, 128),), "fifo", "t4:1x4", config={"max_hours": 1.0})
    _, done = run_task(task)
    assert done.settings["truth"] == "catalog" and "truth_gpu_type" not in done.settings
    assert truth_settings("some/measured-dir", "a100") == {"truth": "some/measured-dir", "truth_gpu_type": "a100"}


def test_a_sweep_that_fails_stops_at_once():
    """A failed simulation, Ctrl-C or an error in ``on_done`` ends a parallel sweep now: leaving the pool had
    waited for every queued simulation (a Ctrl-C'd 20-workload sweep exited 20 s later, its results discarded)."""
    import time
    from dataclasses import replace

    from experiments.simulator.runner import run_sweep

    jobs = tuple(WorkloadJob(f"c{i}", 60.0 * i, "cifar10", 1, 128) for i in range(12))
    task = Task("w", jobs, "sia", "t4:1x4", config={"max_hours": 2.0})  # about 1.5 s each on this VM
    seen = []

    def stop(task, result):
        seen.append(time.perf_counter())
        raise RuntimeError("stop")

    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="stop"):
        run_sweep([replace(task, workload_name=f"w{i}") for i in range(16)], processes=2, on_done=stop)
    # the first result came after the workers' start and one simulation; the 15 left would take 7 more
    assert len(seen) == 1 and time.perf_counter() - seen[0] < seen[0] - start


def test_compare_counts_a_workload_run_again_once(tmp_path, monkeypatch):
    import mlflow

    from experiments.simulator.compare import compare_runs

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_experiment("e")
    for workload, jct in (("wA", 510.0), ("wB", 780.0), ("wA", 520.0)):  # wA again: a sweep rerun after Ctrl-C
        with mlflow.start_run():
            mlflow.log_params({"policy": "fifo", "workload": workload, "cluster": "t4:1x1"})
            mlflow.log_metric("avg_jct_s", jct)
    row = compare_runs("e", metrics=("avg_jct_s",), uri=f"sqlite:///{tmp_path / 'mlflow.db'}").iloc[0]
    assert row["runs"] == 2 and row["avg_jct_s_mean"] == pytest.approx((520.0 + 780.0) / 2)  # had been 3 runs


def test_idle_time_counts_in_the_mean_utilisation():
    """Two short jobs 10 h apart on one GPU: the engine records no round between them (it jumps to the next
    arrival); the mean over the recorded rounds had been 1.0."""
    cluster = Cluster.parse("t4:1x1")
    jobs = [WorkloadJob("early", 0.0, "toy", 1, 32), WorkloadJob("late", 36000.0, "toy", 1, 32)]
    result = Simulator(jobs, {"toy": TOY}, SimConfig(cluster=cluster), FixedPolicy("t4", 1)).run()
    used = float((result.jobs["gpu_hours"] * 3600.0).sum())  # GPU-seconds, against 36,000 s and more of the run
    assert used < 1000 and 0 < result.summary["utilization_mean"] < 0.05


def test_the_utilisation_plot_drops_to_zero_across_idle_gaps():
    """The plot's series gets one zero row where the engine skipped rounds while idle: it had held the
    last busy round's 1.0, or drawn a line to the next, across 10 h of an idle cluster."""
    from experiments.simulator.report import with_idle_rounds

    cluster = Cluster.parse("t4:1x1")
    jobs = [WorkloadJob("early", 0.0, "toy", 1, 32), WorkloadJob("late", 36000.0, "toy", 1, 32)]
    result = Simulator(jobs, {"toy": TOY}, SimConfig(cluster=cluster), FixedPolicy("t4", 1)).run()
    round_s = float(result.settings["round_s"])
    padded = with_idle_rounds(result.rounds, round_s)
    assert len(padded) == len(result.rounds) + 1 and list(padded.dtypes) == list(result.rounds.dtypes)
    times = padded["time_s"].to_numpy()
    gap = int(np.argmax(np.diff(times)))  # the idle stretch starts at the padded row and lasts to the next
    assert times[gap + 1] - times[gap] > 30000 and padded["utilization"].iloc[gap] == 0.0
    assert padded["utilization"].iloc[gap - 1] > 0 and times[gap] - times[gap - 1] == round_s
    assert with_idle_rounds(result.rounds.iloc[:1], round_s).equals(result.rounds.iloc[:1])


def test_a_catalog_entry_whose_micro_batches_cannot_fit_is_refused_at_load(tmp_path):
    from experiments.simulator.truth import CATALOG_PATH, load_catalog
    from goodput.errors import DataFormatError

    data = json.loads(Path(CATALOG_PATH).read_text())
    name = next(iter(data["families"]))
    entry = data["families"][name]
    gpu = next(iter(entry["max_local_bsz"]))
    entry["max_local_bsz"][gpu] = entry["min_local_bsz"] - 1 if entry["min_local_bsz"] > 1 else 0
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(data))
    with pytest.raises(DataFormatError, match=rf"families.{name}.*max_local_bsz\[{gpu}\]"):
        load_catalog(path)  # had failed only when a job of it arrived, naming neither file nor family


def test_compare_does_not_pool_runs_with_other_time_limits(tmp_path):
    import mlflow

    from experiments.simulator.compare import compare_runs

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("limits")
    for max_hours, jct in ((336.0, 100.0), (336.0, 300.0), (0.05, 10.0)):
        with mlflow.start_run():
            mlflow.log_params({"policy": "sia", "cluster": "t4:2x4", "max_hours": max_hours})
            mlflow.log_metric("avg_jct_s", jct)
    frame = compare_runs("limits", uri=uri).set_index("max_hours")
    assert len(frame) == 2
    assert frame.loc["336.0", "runs"] == 2 and frame.loc["336.0", "avg_jct_s_mean"] == pytest.approx(200.0)
    assert frame.loc["0.05", "runs"] == 1


@pytest.mark.parametrize("count", ["0", "-3"])
def test_simulate_rejects_a_synthetic_count_below_one(count, capsys):
    assert main(["simulate", "--synthetic", count, "--no-mlflow"]) == 2
    assert "synthetic" in capsys.readouterr().err


def test_simulate_rejects_hours_with_a_workload_file(tmp_path, capsys):
    path = write_workload([WorkloadJob("c", 0.0, "cifar10", 1, 128)], tmp_path / "w.csv")
    assert main(["simulate", "--workload", str(path), "--hours", "3", "--no-mlflow", "--out", str(tmp_path / "o")]) == 2
    assert "hours" in capsys.readouterr().err


# ====================================================================== notebooks


def test_notebooks_save_is_atomic(tmp_path, monkeypatch):
    """A write that fails midway leaves the file as it was (nbformat.write truncated it first)."""
    import nbformat

    from experiments import notebooks

    path = tmp_path / "demo.ipynb"
    good = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    nbformat.write(good, path)
    before = path.read_text()
    # serialises, but cannot be encoded as UTF-8: the write fails after the file was opened
    bad = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = '" + chr(0xD800) + "'")])  # a lone surrogate
    monkeypatch.setattr(notebooks, "NOTEBOOKS", tmp_path)
    monkeypatch.setattr(notebooks, "execute", lambda *a, **k: bad)
    with pytest.raises(UnicodeEncodeError):
        notebooks.main(["demo.ipynb", "--save"])
    assert path.read_text() == before
    monkeypatch.setattr(notebooks, "execute", lambda *a, **k: good)
    assert notebooks.main(["demo.ipynb", "--save"]) == 0
    assert nbformat.read(path, as_version=4).cells[0].source == "1 + 1"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left behind


@pytest.mark.parametrize("module, argv, message", [
    ("experiments.simulator.build_catalog", ["--gpu-types", "t4,h100", "--data-dir", "."], "unknown h100"),
    ("experiments.bench_simulator", ["--synthetic", "--seeds", "0"], "--seeds 0: must be >= 1"),
    ("experiments.bench_simulator", ["--synthetic", "--jobs", "0"], "--jobs 0: must be >= 1"),
    # these had ended in tracebacks, bench_scale's after its whole simulation
    ("experiments.bench_scale", ["--quick", "--milp-samples", "-1"], "--milp-samples -1: must be >= 0"),
    ("experiments.bench_scale", ["--quick", "--factor", "0"], "--factor 0: must be >= 1"),
    ("experiments.bench_allocator", ["--quick", "--sizes", "64x0"], "holds no job"),
    ("experiments.bench_allocator", ["--quick", "--sizes", "abc"], "is not GPUS or GPUSxJOBS"),
    ("experiments.bench_heterogeneous", ["--quick", "--synthetic", "--policies", "nope"], "policy='nope'"),
    ("experiments.fidelity", ["--data-dir", "/nonexistent-goodput-data"], "No such file"),
])
def test_developer_tools_refuse_bad_options_in_one_line(module, argv, message, capsys):
    """These had ended in a KeyError, statistics.StatisticsError or ValidationError traceback."""
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_module_entry_points_print_one_line_errors_for_missing_or_malformed_data(tmp_path, capsys):
    """A missing folder (OSError) and a malformed table (DataFormatError) had ended these in tracebacks."""
    from experiments import accuracy, noise_floor

    assert accuracy.main([str(tmp_path / "nothing-here"), "--no-mlflow", "--no-progress"]) == 2
    assert "nothing-here" in capsys.readouterr().err
    bad = tmp_path / "bad" / "m"
    bad.mkdir(parents=True)
    (bad / "placements-t4.csv").write_text("placement,local_bsz,step_time\n1,32,abc\n")
    assert noise_floor.main([str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "placements-t4.csv:2" in err and "step_time" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [(["--processes", "0"], "processes=0"), (["--out", "/"], "is a directory")])
def test_fidelity_refuses_its_options_before_the_simulations(data_dir, argv, message, capsys):
    from experiments import fidelity

    with pytest.raises(SystemExit) as exit_info:
        fidelity.main(["--data-dir", str(data_dir), "--workloads", "1", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
