"""Goodput at a quantile: the log-normal helpers, ``GoodputTable.at_quantile`` and ``allocate(goodput_quantile=)``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from goodput import Cluster, GoodputTable, JobModel, ValidationError, allocate, save_tables
from cli import main
from goodput.lognormal import lognormal_log_std, lognormal_quantile, lognormal_std
from goodput.model import Prediction
from tests.test_model import observations


@given(st.floats(1e-6, 1e6), st.floats(0.0, 3.0))
@example(1.0, 6.3128374120199926e-09)  # found by hypothesis: the inverse's difference had cancelled to 0
def test_log_std_inverts_std(median, log_std):
    std = lognormal_std(median, log_std)
    assert float(lognormal_log_std(median, std)) == pytest.approx(log_std, rel=1e-9, abs=1e-9)


def test_quantile_matches_samples_and_is_monotone():
    rng = np.random.default_rng(0)
    median, log_std = 50.0, 0.4
    samples = median * np.exp(log_std * rng.standard_normal(200_000))
    assert float(np.std(samples)) == pytest.approx(float(lognormal_std(median, log_std)), rel=0.01)
    qs = [0.05, 0.25, 0.5, 0.75, 0.95]
    values = [float(lognormal_quantile(median, log_std, q)) for q in qs]
    assert values == sorted(values) and values[2] == pytest.approx(median)
    for q, v in zip(qs, values):
        assert float(np.mean(samples <= v)) == pytest.approx(q, abs=0.005)
    with pytest.raises(ValidationError, match="q"):
        lognormal_quantile(median, log_std, 1.0)


def _rows():
    return [
        {"gpu_type": "t4", "num_nodes": 1, "num_gpus": 1, "goodput": 100.0, "throughput": 125.0, "step_time": 0.512,
         "efficiency": 0.8, "std": 30.0},
        {"gpu_type": "t4", "num_nodes": 1, "num_gpus": 2, "goodput": 180.0, "throughput": 225.0, "step_time": 0.569,
         "efficiency": 0.8, "std": 0.0},
        {"gpu_type": "t4", "num_nodes": 2, "num_gpus": 2, "goodput": 0.0, "throughput": 0.0, "step_time": 0.0,
         "efficiency": 0.0, "std": 0.0},
    ]


def test_at_quantile_moves_goodput_and_throughput_together_and_leaves_sure_rows():
    table = GoodputTable("j", _rows())
    log_std = float(lognormal_log_std(100.0, 30.0))
    low, high = table.at_quantile(0.1), table.at_quantile(0.9)
    for moved, q in ((low, 0.1), (high, 0.9)):
        row = moved.lookup("t4", 1, 1)
        assert row["goodput"] == pytest.approx(float(lognormal_quantile(100.0, log_std, q)))
        assert row["throughput"] * row["efficiency"] == pytest.approx(row["goodput"])
        assert row["step_time"] * row["throughput"] == pytest.approx(0.512 * 125.0)
        assert row["std"] == 30.0
        assert moved.lookup("t4", 1, 2)["goodput"] == 180.0  # std 0: a measured row
        assert moved.lookup("t4", 2, 2)["goodput"] == 0.0  # infeasible stays infeasible
    assert low.lookup("t4", 1, 1)["goodput"] < 100.0 < high.lookup("t4", 1, 1)["goodput"]
    assert table.at_quantile(0.5).frame.equals(table.frame)
    bare = GoodputTable("j", [{k: r[k] for k in ("gpu_type", "num_nodes", "num_gpus", "goodput")} for r in _rows()])
    assert bare.at_quantile(0.05).frame.equals(bare.frame)  # no std column: nothing to move
    for bad in (0.0, 1.0, float("nan"), "0.3"):
        with pytest.raises(ValidationError, match="q"):
            table.at_quantile(bad)


def test_a_model_table_at_a_quantile_is_its_step_time_interval():
    # The table's 5% goodput is the batch over the upper end of the 90% step-time interval of a log-normal of the
    # prediction's log-std (the table's std; the noise's Student-t tails, which Prediction.interval adds, it keeps not).
    model = JobModel("j", init_batch_size=64).observe(observations())
    cautious = model.table(Cluster.parse("t4:2x4,a100:1x8")).at_quantile(0.05)
    checked = 0
    for row in cautious.frame.to_dict("records"):
        if row["goodput"] <= 0:
            continue
        prediction = model.predict(row["gpu_type"], row["num_nodes"], row["num_gpus"], row["local_bsz"], row["accum_steps"])
        _, high = Prediction(prediction.step_time, prediction.std, prediction.throughput, prediction.log_std).interval(0.9)
        assert prediction.log_std > 0
        assert row["goodput"] == pytest.approx(row["batch_size"] * row["efficiency"] / high, rel=1e-6)
        checked += 1
    assert checked == len(cautious)


def _uncertain_choice() -> tuple[dict[str, GoodputTable], Cluster]:
    # a100's median is higher but unsure; t4's is lower and sure.
    rows = [
        {"gpu_type": "t4", "num_nodes": 1, "num_gpus": 1, "goodput": 100.0, "std": 1.0},
        {"gpu_type": "a100", "num_nodes": 1, "num_gpus": 1, "goodput": 120.0, "std": 90.0},
    ]
    return {"j": GoodputTable("j", rows)}, Cluster.parse("t4:1x1,a100:1x1")


@pytest.mark.parametrize("policy", ["sia", "gavel-throughput"])
def test_allocate_is_cautious_below_the_median_and_optimistic_above(policy):
    tables, cluster = _uncertain_choice()
    assert allocate(tables, cluster, policy=policy)["j"].gpu_type == "a100"
    assert allocate(tables, cluster, policy=policy, goodput_quantile=0.9)["j"].gpu_type == "a100"
    assert allocate(tables, cluster, policy=policy, goodput_quantile=0.1)["j"].gpu_type == "t4"
    for bad in (0.0, 1.0, -0.2):
        with pytest.raises(ValidationError, match="goodput_quantile"):
            allocate(tables, cluster, policy=policy, goodput_quantile=bad)


def test_cli_allocate_reads_tables_at_a_quantile(tmp_path, capsys):
    tables, _ = _uncertain_choice()
    path = tmp_path / "tables.json"
    save_tables(tables, path)
    chosen = {}
    for q in ("0.5", "0.1"):
        assert main(["allocate", str(path), "--cluster", "t4:1x1,a100:1x1", "--goodput-quantile", q, "--json"]) == 0
        chosen[q] = json.loads(capsys.readouterr().out)["allocations"]["j"]["gpu_type"]
    assert chosen == {"0.5": "a100", "0.1": "t4"}


def test_a_table_knows_its_quantile_keeps_it_on_disk_and_is_not_moved_twice(tmp_path):
    from goodput import load_tables
    from goodput.errors import DataFormatError

    table = GoodputTable("j", _rows())
    assert table.quantile == 0.5 and "quantile" not in table.to_dict()
    cautious = table.at_quantile(0.1)
    assert cautious.quantile == 0.1 and "quantile=0.1" in repr(cautious)
    with pytest.raises(ValidationError, match="quantile already"):
        cautious.at_quantile(0.5)
    tables, cluster = _uncertain_choice()
    moved = {job: t.at_quantile(0.1) for job, t in tables.items()}
    with pytest.raises(ValidationError, match="quantile already"):
        allocate(moved, cluster, goodput_quantile=0.1)  # reading a cautious table cautiously again would compound
    assert allocate(moved, cluster)["j"].gpu_type == "t4"  # read as it is: already cautious
    for path in (tmp_path / "t.json", tmp_path / "t.csv"):
        (cautious.to_json if path.suffix == ".json" else cautious.to_csv)(path)
        back = (GoodputTable.from_json if path.suffix == ".json" else GoodputTable.from_csv)(path)
        assert back.quantile == 0.1 and back.frame.equals(cautious.frame)
    save_tables({"j": cautious, "k": GoodputTable("k", _rows())}, tmp_path / "all.json")
    loaded = load_tables(tmp_path / "all.json")
    assert loaded["j"].quantile == 0.1 and loaded["k"].quantile == 0.5
    table.to_csv(tmp_path / "median.csv")
    assert "quantile" not in (tmp_path / "median.csv").read_text().splitlines()[0]
    bad = (tmp_path / "t.csv").read_text().replace(",0.1\n", ",2.0\n", 1)  # the quantile column, the last
    (tmp_path / "bad.csv").write_text(bad)
    with pytest.raises(DataFormatError, match="quantile"):
        GoodputTable.from_csv(tmp_path / "bad.csv")
    with pytest.raises(ValidationError, match="quantile"):
        GoodputTable("j", _rows(), quantile=1.0)
