"""Simulator ground truth (catalog, measured tables) and workloads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.simulator.truth import CATALOG_PATH, ParametricFamily, load_catalog, load_measured, catalog_workload_stats
from experiments.simulator.workload import WorkloadJob, read_workload, synthetic_workload, write_workload
from goodput.errors import DataFormatError, ValidationError
from goodput.throughput import ThroughputParams, predict_step_time


def test_catalog_is_complete_and_consistent():
    catalog = json.loads(CATALOG_PATH.read_text())
    assert "provenance" in catalog and "speed_model" in catalog
    families = load_catalog()
    assert set(families) == {"bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3"}
    for family in families.values():
        assert {"t4", "a100", "rtx2080ti"} <= set(family.gpu_types)
        assert family.work > 0 and family.init_batch_size <= family.max_batch_size
        # a faster type is never slower on the same configuration (compute scales by speed, sync by bandwidth)
        t4 = family.iter_time("t4", 1, 1, family.min_local_bsz, 0)[0]
        a100 = family.iter_time("a100", 1, 1, family.min_local_bsz, 0)[0]
        assert a100 <= t4


def test_catalog_rate_matches_pollux_progress_definition():
    family = load_catalog()["cifar10"]
    progress = family.work / 3
    m0, batch = family.init_batch_size, 4 * 256
    phi = family.noise_scale(progress, batch)  # the noise of training at this batch
    t_iter = float(predict_step_time(family.params["t4"], 1, 4, 256, 0))
    expected = (phi + m0) / (phi + batch) * batch / m0 / t_iter
    assert family.rate("t4", 1, 4, 256, 0, progress) == pytest.approx(expected)


def test_noise_scale_interpolates_between_knots():
    family = ParametricFamily(name="x", init_batch_size=10, max_batch_size=100, min_local_bsz=1,
                              max_local_bsz={"t4": 50}, work=100.0, noise=((0.0, 10.0), (1.0, 1000.0)),
                              params={"t4": ThroughputParams(0.1, 0.01, 0.2, 0.0, 0.1, 0.0, 1.0)})
    assert family.noise_scale(0) == pytest.approx(10.0)
    assert family.noise_scale(50) == pytest.approx(100.0)  # log-linear midpoint
    assert family.noise_scale(1e9) == pytest.approx(1000.0)


def test_oracle_best_config_respects_limits():
    family = load_catalog()["yolov3"]
    best = family.best_config("rtx2080ti", np.array([1, 1]), np.array([1, 8]), family.work / 2)
    assert np.all(best.local_bsz <= family.max_local_bsz["rtx2080ti"])
    assert np.all(best.batch_size <= family.max_batch_size)
    assert np.all(best.goodput > 0)


@pytest.mark.data
def test_measured_tables_interpolate_the_pollux_traces(pollux_traces):
    families = load_measured(pollux_traces)
    cifar = families["cifar10"]
    # a measured placement and batch size reproduces the measurement
    step, sync = cifar.step_sync("t4", 1, 1, 32)
    assert step == pytest.approx(0.0427886962890625) and sync == pytest.approx(0.0004995360016822816)
    # between measured batch sizes: between the neighbours
    low, high = cifar.step_sync("t4", 1, 1, 32)[0], cifar.step_sync("t4", 1, 1, 45)[0]
    assert low < cifar.step_sync("t4", 1, 1, 40)[0] < high
    # an unmeasured placement is interpolated to a finite, positive value
    step, sync = cifar.step_sync("t4", 5, 20, 100)
    assert 0 < sync <= step < 10
    # work: progress at the last epoch, the least over the batch sizes' runs (Pollux)
    from experiments.datasets import read_validation

    last = [read_validation(p)[-1].progress for p in (pollux_traces / "cifar10").glob("validation-*.csv")]
    assert cifar.work == pytest.approx(min(last)) and min(last) < max(last)


def test_read_workload_and_round_trip(tmp_path):
    path = tmp_path / "w.csv"
    path.write_text("name,time,application,num_replicas,batch_size\nb,20,cifar10,4,512\na,10,ncf,1,256\n")
    jobs = read_workload(path)
    assert [j.name for j in jobs] == ["a", "b"]  # sorted by arrival
    write_workload(jobs, tmp_path / "again.csv")
    assert read_workload(tmp_path / "again.csv") == jobs
    # arrival times to the last bit (":g" had written 1234567.0 as 1.23457e+06), names and categories quoted
    odd = [WorkloadJob("x,1", 123456.7, "cifar10", 1, 128, "small, fast"), WorkloadJob("y", 1234567.0, "ncf", 2, 256)]
    write_workload(odd, tmp_path / "odd.csv")
    assert read_workload(tmp_path / "odd.csv") == odd


@pytest.mark.parametrize(
    "row, field",
    [
        ("c,abc,cifar10,4,512", "time"),
        ("c,-5,cifar10,4,512", "time"),
        ("c,30,cifar10,0,512", "num_replicas"),
        ("c,30,cifar10,4,", "batch_size"),
        ("c,30,,4,512", "application"),
        ("a,30,cifar10,4,512", "name"),  # duplicate
        ("c,30,cifar10", "row"),
    ],
)
def test_workload_reader_rejects_malformed_rows_with_line_number(tmp_path, row, field):
    path = tmp_path / "w.csv"
    path.write_text(f"name,time,application,num_replicas,batch_size\na,10,ncf,1,256\n{row}\n")
    with pytest.raises(DataFormatError) as info:
        read_workload(path)
    assert info.value.line == 3 and info.value.field == field


def test_synthetic_workload_is_reproducible_and_philly_like():
    families = load_catalog()
    stats = catalog_workload_stats()
    a = synthetic_workload(stats, families, num_jobs=200, hours=8, seed=3)
    assert a == synthetic_workload(stats, families, num_jobs=200, hours=8, seed=3)
    assert a != synthetic_workload(stats, families, num_jobs=200, hours=8, seed=4)
    times = [j.time for j in a]
    assert times == sorted(times) and 0 <= times[0] and times[-1] <= 8 * 3600
    single = np.mean([j.num_replicas == 1 for j in a])
    assert single > 0.7  # Philly: most jobs ask for one GPU
    assert {j.application for j in a} <= set(families)
    with pytest.raises(ValidationError):
        WorkloadJob("x", -1, "cifar10", 1, 128)


def test_noise_scale_interpolates_across_batch_size_runs():
    """φ of a job training at batch M: between the runs that bracket M (log φ over log batch), clamped outside."""
    family = ParametricFamily(name="x", init_batch_size=10, max_batch_size=1000, min_local_bsz=1,
                              max_local_bsz={"t4": 50}, work=100.0,
                              noise={10: ((0.0, 100.0), (1.0, 100.0)), 1000: ((0.0, 10_000.0), (1.0, 10_000.0))},
                              params={"t4": ThroughputParams(0.1, 0.01, 0.2, 0.0, 0.1, 0.0, 1.0)})
    assert family.noise_scale(50) == pytest.approx(100.0)  # the reference run
    assert family.noise_scale(50, 100) == pytest.approx(1000.0)  # halfway in log batch
    assert family.noise_scale(50, [5, 5000]).tolist() == pytest.approx([100.0, 10_000.0])
    e = family.efficiency(50, 100)
    assert e == pytest.approx((1000.0 + 10) / (1000.0 + 100))


def test_catalog_holds_every_batch_size_run():
    family = load_catalog()["cifar10"]
    late = family.work * 0.9
    # Pollux's traces: later in training, larger-batch runs show a larger noise scale
    assert family.noise_scale(late, 4096) > 2 * family.noise_scale(late, 128)


def _one_model_tables(root, bad_row: bool = False):
    """One model whose GPU type is written as in a spreadsheet (``RTX 6000``), with a validation trace."""
    model = root / "tiny"
    model.mkdir(parents=True)
    rows = ["placement,local_bsz,step_time,sync_time", "1,16,0.10,0", "1,32,0.18,0", "2,16,0.13,0.03", "22,32,0.30,0.09"]
    if bad_row:
        rows.append("4,16,,")  # an infeasible configuration, written empty
    (model / "placements-RTX 6000.csv").write_text("\n".join(rows) + "\n")
    (model / "validation-16.csv").write_text("progress,iteration,metric,grad_sqr,grad_var\n100,10,0.5,1.0,2.0\n")
    return root


def test_the_simulator_reads_tables_under_the_type_names_the_accuracy_harness_gives(tmp_path):
    from experiments.datasets import read_measurements

    root = _one_model_tables(tmp_path / "measured")
    family = load_measured(root)["tiny"]
    harness = read_measurements(root)
    assert set(family.gpu_types) == {o.gpu_type for o in harness.models["tiny"]} == {"rtx-6000"}
    assert family.step_sync("rtx-6000", 1, 1, 16)[0] == pytest.approx(0.10)
    assert family.step_sync("rtx-6000", 2, 4, 32)[0] == pytest.approx(0.30)


def test_the_simulator_refuses_a_row_the_harness_leaves_out(tmp_path):
    from experiments.datasets import read_measurements

    root = _one_model_tables(tmp_path / "measured", bad_row=True)
    assert len(read_measurements(root).models["tiny"]) == 4  # the harness leaves it out, with a note
    with pytest.raises(DataFormatError, match="step_time"):
        load_measured(root)  # a simulation's ground truth is read strictly: nothing dropped silently


# ---------------------------------------------------------------------------- restart costs per application
def test_restart_costs_are_sias_per_application_in_the_catalog_and_by_default():
    from experiments.simulator.truth import DEFAULT_RESTART_COST_S, RESTART_COST_S, restart_cost_of

    assert RESTART_COST_S == {"cifar10": 50.0, "deepspeech2": 25.0, "bert": 120.0, "yolov3": 80.0,
                              "imagenet": 250.0, "ncf": 15.0}
    assert {name: f.restart_cost_s for name, f in load_catalog().items()} == RESTART_COST_S
    assert restart_cost_of("gpt") == DEFAULT_RESTART_COST_S == 30.0
    params = {"t4": ThroughputParams(0.1, 0.01, 0.2, 0.0, 0.1, 0.0, 1.0)}
    make = dict(init_batch_size=10, max_batch_size=100, min_local_bsz=1, max_local_bsz={"t4": 50}, work=100.0,
                noise=((0.0, 10.0),), params=params)
    assert ParametricFamily(name="imagenet", **make).restart_cost_s == 250.0  # by name
    assert ParametricFamily(name="other", **make).restart_cost_s == 30.0
    assert ParametricFamily(name="imagenet", restart_cost_s=7.0, **make).restart_cost_s == 7.0  # given
    with pytest.raises(ValidationError, match="restart_cost_s"):
        ParametricFamily(name="x", restart_cost_s=-1.0, **make)


def test_measured_restart_costs_come_from_application_json_else_the_name(tmp_path):
    _one_model_tables(tmp_path / "m")
    assert load_measured(tmp_path / "m")["tiny"].restart_cost_s == 30.0  # an unknown name: the default
    (tmp_path / "m" / "tiny" / "application.json").write_text('{"restart_cost_s": 42}')
    assert load_measured(tmp_path / "m")["tiny"].restart_cost_s == 42.0
    assert load_measured(tmp_path / "m", restart_cost_s=5.0)["tiny"].restart_cost_s == 5.0  # one cost for all


@pytest.mark.data
def test_measured_pollux_traces_take_sias_costs_by_application_name(pollux_traces):
    from experiments.simulator.truth import RESTART_COST_S

    families = load_measured(pollux_traces, applications={"imagenet", "ncf"})
    assert {name: f.restart_cost_s for name, f in families.items()} == {"imagenet": 250.0, "ncf": 15.0}
    assert set(families) == {"imagenet", "ncf"} and set(RESTART_COST_S) > set(families)


# ---------------------------------------------------------------------------- only the workload's applications
def _truth_with_a_broken_model(root):
    """``tiny`` (good) beside ``broken``: Sia-like pipeline rows (sync_time > step_time) without application.json."""
    _one_model_tables(root)
    broken = root / "broken"
    broken.mkdir()
    (broken / "placements-a100.csv").write_text("local_bsz,step_time,sync_time,placement\n1,0.099,0.3275,8\n")
    (broken / "validation-12.csv").write_text("progress,iteration,metric,grad_sqr,grad_var\n100,10,0.5,1.0,2.0\n")
    (root / "notes").mkdir()  # not a model folder
    return root


def test_only_the_workloads_applications_are_loaded_and_the_others_skipped_with_a_reason(tmp_path):
    root = _truth_with_a_broken_model(tmp_path / "truth")
    skipped: dict[str, str] = {}
    families = load_measured(root, applications={"tiny"}, skipped=skipped)
    assert set(families) == {"tiny"}
    assert set(skipped) == {"broken", "notes"}
    assert "not used by the workload" in skipped["broken"] and "placements-a100.csv:2" in skipped["broken"]
    assert "sync_time" in skipped["broken"] and "num_stages" in skipped["broken"]
    assert "not a model folder" in skipped["notes"]
    assert set(load_measured(root, applications={"tiny"})) == {"tiny"}  # without `skipped`, the others are not read


def test_a_bad_table_of_a_needed_application_is_a_one_line_error_naming_file_row_and_field(tmp_path):
    root = _truth_with_a_broken_model(tmp_path / "truth")
    with pytest.raises(DataFormatError) as info:
        load_measured(root, applications={"tiny", "broken"})
    error = info.value
    assert (error.path, error.line, error.field) == (str(root / "broken" / "placements-a100.csv"), 2, "sync_time")
    assert str(error).startswith(f"{root / 'broken' / 'placements-a100.csv'}:2: sync_time=0.3275") and "\n" not in str(error)
    with pytest.raises(DataFormatError, match="no such model folder"):
        load_measured(root, applications={"tiny", "nosuch"})
    with pytest.raises(DataFormatError, match="no step-time tables"):
        load_measured(root, applications={"notes"})  # a needed folder must be a complete model
    with pytest.raises(DataFormatError, match="sync_time"):
        load_measured(root)  # every application: the broken one too


def test_goodput_simulate_skips_an_unused_bad_model_with_a_printed_warning(tmp_path, capsys):
    from cli import main

    root = _truth_with_a_broken_model(tmp_path / "truth")
    write_workload([WorkloadJob("a", 0.0, "tiny", 1, 16)], tmp_path / "w.csv")
    args = ["simulate", "--workload", str(tmp_path / "w.csv"), "--truth", str(root), "--cluster", "rtx-6000:1x2",
            "--policy", "sia-oracle", "--processes", "1", "--no-mlflow", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    printed = capsys.readouterr().out
    warning = next(line for line in printed.splitlines() if line.startswith("truth: skipped broken"))
    assert "placements-a100.csv:2: sync_time=0.3275" in warning
    write_workload([WorkloadJob("b", 0.0, "broken", 8, 12)], tmp_path / "bad.csv")
    assert main([*args[:2], str(tmp_path / "bad.csv"), *args[3:]]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "placements-a100.csv:2: sync_time=0.3275" in error
