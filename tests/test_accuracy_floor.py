"""The P4 floor experiment: the oracles replace the online estimates with full-data ones, and only inside their block."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments import accuracy_floor
from experiments.accuracy_floor import VARIANTS, floor_rows, full_data_hyperparameters, oracle, summarise
from experiments.datasets import read_measurements
from goodput import bayes
from goodput.gp import GPHyperparameters
from goodput.model import JobModel
from goodput.throughput import fit_throughput
from tests.test_accuracy import _write_layout


@pytest.fixture
def measured(tmp_path):
    return read_measurements(_write_layout(tmp_path / "measured"))


def _t4(measured, job="resnet"):
    return [o for o in measured.models[job] if o.gpu_type == "t4"]


def test_mean_oracle_answers_every_refit_with_the_full_data_fit(measured):
    rows = _t4(measured)
    full = fit_throughput(rows).as_array()
    with oracle("mean", measured.models["resnet"]):
        model = JobModel("resnet", init_batch_size=16).observe(rows[:6])
        np.testing.assert_allclose(model.own_fit("t4").as_array(), full, rtol=1e-12)
        model.observe(rows[6:9])  # a refit after new observations: still the full fit
        np.testing.assert_allclose(model.own_fit("t4").as_array(), full, rtol=1e-12)
    plain = JobModel("resnet", init_batch_size=16).observe(rows[:6])
    assert not np.allclose(plain.own_fit("t4").as_array(), full, rtol=1e-3)  # 6 rows do not pin the full fit
    assert JobModel._own_fit is not None and "oracle" not in JobModel._own_fit.__qualname__  # restored


def test_gp_oracle_fixes_the_hyperparameters_and_is_undone_on_error(measured):
    rows = _t4(measured)
    hyper = GPHyperparameters(lengthscale=(0.7, 1.3, 2.0, 0.9, 1.1, 3.0), task_factor=(0.05,), task_var=(0.002,), noise=4e-4)
    fit_before = bayes.fit_hyperparameters
    with pytest.raises(RuntimeError, match="inside"):
        with oracle("gp", measured.models["resnet"], hyper):
            model = JobModel("resnet", init_batch_size=16).observe(rows[:12]).refit()
            assert model.gp_hyperparameters.lengthscale == hyper.lengthscale
            assert model.gp_hyperparameters.noise == hyper.noise
            assert model.gp_hyperparameters.task_factor == hyper.task_factor
            raise RuntimeError("inside the block")
    assert bayes.fit_hyperparameters is fit_before
    free = JobModel("resnet", init_batch_size=16).observe(rows[:12]).refit()
    assert free.gp_hyperparameters.lengthscale != hyper.lengthscale  # fitted again outside the block


def test_oracle_refuses_unknown_variants_and_missing_hyperparameters(measured):
    with pytest.raises(ValueError, match="variant"):
        with oracle("perfect", measured.models["resnet"]):
            pass
    with pytest.raises(ValueError, match="hyper"):
        with oracle("both", measured.models["resnet"]):
            pass


def test_floor_rows_end_to_end_and_the_json_they_save(measured, tmp_path):
    models = {job: measured.models[job] for job in ("resnet", "bert")}
    hyper = full_data_hyperparameters("resnet", models["resnet"], None)
    assert len(hyper.lengthscale) == 6 and hyper.noise > 0
    rows = floor_rows(models, {}, variants=["as is", "both"], orders=1, progress=False)
    assert set(rows.variant) == {"as is", "both"} and set(rows.model) == {"resnet", "bert"}
    assert {"k=5", "k=10", "k=20", "next"} <= set(rows.stage)
    summary = {line["what"]: line for line in summarise(rows)}
    for line in summary.values():
        assert 0 < line["median APE k=5"] < 100 and 0 <= line["coverage k=20"] <= 100 and line["rows k=20"] > 0
    # the oracle's mean has seen the held-out rows: with 5 observations it predicts them better
    assert summary["both"]["median APE k=5"] < summary["as is"]["median APE k=5"]

    root = tmp_path / "measured"
    assert accuracy_floor.main([str(root), "--variants", "as is,mean", "--orders", "1", "--out-dir", str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "accuracy_floor.json").read_text())
    assert [r["what"] for r in saved["rows"]] == ["as is", "mean"] and saved["orders"] == 1
    with pytest.raises(SystemExit):
        accuracy_floor.main([str(root), "--variants", "as is,oracle"])
    assert set(VARIANTS) == {"as is", "mean", "gp", "both"}
