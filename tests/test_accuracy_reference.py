"""The error floors reported next to every accuracy run (experiments.accuracy_reference)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments import accuracy
from experiments.accuracy_reference import (
    REFERENCES,
    capacity_errors,
    reference_by_model,
    reference_errors,
    reference_table,
    repeat_errors,
)
from experiments.datasets import read_measurements
from goodput.observations import Observation
from goodput.throughput import ThroughputParams, predict_step_time

TRUE = ThroughputParams(0.030, 0.0020, 0.30, 0.006, 0.08, 0.004, 1.5)
PLACEMENTS = [(1,), (2,), (4,), (1, 1), (2, 2), (4, 4), (1, 1, 1, 1), (4, 4, 4)]


def _obs(job: str = "j", gpu: str = "t4", noise: float = 0.0, repeats: int = 1, seed: int = 0) -> list[Observation]:
    rng = np.random.default_rng(seed)
    out = []
    for placement in PLACEMENTS:
        for bsz in (16, 32, 64, 128):
            clean = float(predict_step_time(TRUE, len(placement), sum(placement), bsz))
            for _ in range(repeats):
                out.append(Observation(job, gpu, len(placement), sum(placement), bsz,
                                       clean * float(np.exp(rng.normal(0.0, noise))), placement=placement))
    return out


def test_capacity_of_noise_free_pollux_data_is_near_zero():
    errors = capacity_errors(_obs())
    assert len(errors) == len(PLACEMENTS) * 4  # every observation, 1-GPU ones included
    assert set(errors["num_replicas"]) == {1, 2, 4, 8, 12}
    assert errors["ape"].median() < 0.5  # the model's own form: the fit recovers it


def test_capacity_grows_with_noise_and_skips_types_with_too_few_observations():
    noisy = capacity_errors(_obs(noise=0.05))
    assert noisy["ape"].median() > 1.0 and noisy["ape"].median() < 6.0  # ~0.67·5% less the fit's 7 parameters' share
    two = [Observation("j", "k80", 1, 1, 16, 0.1), Observation("j", "k80", 1, 2, 16, 0.2)]
    assert capacity_errors(two).empty and list(capacity_errors(two).columns) == ["gpu_type", "num_nodes", "num_replicas", "ape"]


def test_repeat_errors_against_the_mean_of_the_other_measurements():
    obs = [Observation("j", "t4", 1, 1, 16, 1.0), Observation("j", "t4", 1, 1, 16, 1.1),
           Observation("j", "a100", 1, 1, 16, 5.0),  # another type: not a repeat of the t4 ones
           Observation("j", "t4", 1, 1, 32, 2.0), Observation("j", "t4", 1, 1, 32, 2.0), Observation("j", "t4", 1, 1, 32, 4.0)]
    errors = repeat_errors(obs)
    assert len(errors) == 5
    assert errors[:2] == pytest.approx([10.0, 100 * (1 - 1 / 1.1)])
    # the 4.0 s one against the 2.0 s pair: 50%; each 2.0 s against √(2·4): 41.4%
    assert sorted(errors[2:]) == pytest.approx([100 * (math.sqrt(8) / 2 - 1), 100 * (math.sqrt(8) / 2 - 1), 50.0])
    assert repeat_errors(obs[:1]).size == 0


def test_repeat_floor_of_log_normal_pairs_is_095_sigma():
    per_run = [repeat_errors(_obs(noise=0.05, repeats=2, seed=s)) for s in range(30)]
    assert all(len(errors) == len(PLACEMENTS) * 4 * 2 for errors in per_run)
    many = np.concatenate(per_run)
    # |exp(ε1 − ε2) − 1| with ε ~ N(0, σ²): median ≈ 0.954σ (σ = 5%)
    assert np.median(many) == pytest.approx(0.954 * 5.0, rel=0.08)


def test_reference_table_names_what_the_data_cannot_support():
    single = {"a": [o for o in _obs() if o.num_replicas == 1]}
    table = reference_table(single).set_index("reference")
    assert table.loc["capacity 1-GPU", "n"] == 4 and table.loc["capacity 1-GPU", "median_ape"] < 0.5
    for name in ("capacity multi-GPU", "capacity multi-node", "repeat"):
        assert table.loc[name, "n"] == 0 and math.isnan(table.loc[name, "median_ape"])
    both = reference_table({"a": _obs(noise=0.03, repeats=2), "b": _obs("b", noise=0.03)}).set_index("reference")
    assert both.loc["capacity multi-GPU", "models"] == 2 and both.loc["repeat", "models"] == 1
    assert both.loc["capacity multi-node", "n"] == 2 * 5 * 4 + 5 * 4  # 5 multi-node placements × 4 batches; a: twice


def test_reference_per_model_medians():
    errors = reference_errors({"clean": _obs(), "noisy": _obs("noisy", noise=0.05, repeats=2), "empty": []})
    table = reference_by_model(errors)
    assert list(table.columns) == list(REFERENCES) and set(table.index) == {"clean", "noisy"}
    assert table.loc["clean", "capacity multi-GPU"] < 0.5 < table.loc["noisy", "capacity multi-GPU"]
    assert math.isnan(table.loc["clean", "repeat"]) and table.loc["noisy", "repeat"] > 1.0
    noisy = errors[(errors["model"] == "noisy") & (errors["reference"] == "repeat")]["ape"]
    assert table.loc["noisy", "repeat"] == pytest.approx(np.median(noisy), abs=0.05)
    assert reference_errors({}).empty


def test_accuracy_run_reports_the_reference(tmp_path):
    from tests.test_accuracy import _write_layout

    layout = _write_layout(tmp_path / "measured")
    accuracy.run(layout, tmp_path / "out", models=["resnet", "small"], protocols=["P1"], methods=["linear"], progress=False)
    text = (tmp_path / "out" / "accuracy.md").read_text()
    assert "| capacity multi-GPU |" in text and "| repeat | 0 | n/a |" in text
    assert "of each reference per model" in text and "| resnet |" in text
    import mlflow
    import pandas as pd

    saved = pd.read_csv(tmp_path / "out" / "reference.csv").set_index("reference")
    runs = mlflow.search_runs(experiment_names=["goodput-accuracy"])
    assert runs["metrics.reference.capacity_multi-GPU.median_ape"].iloc[0] == pytest.approx(
        saved.loc["capacity multi-GPU", "median_ape"])
    assert saved.loc["capacity multi-GPU", "median_ape"] < 5  # 3% noise around Pollux's form


@pytest.mark.data
def test_reference_on_pollux_t4_traces(pollux_traces):
    data = read_measurements(pollux_traces)
    table = reference_table({m: data.models[m] for m in ("bert", "ncf")}).set_index("reference")
    # measured on the six models: repeat 3.7%, capacity 6.2%; ncf is the noisiest (repeat 6.2%)
    repeat, capacity = table.loc["repeat", "median_ape"], table.loc["capacity multi-GPU", "median_ape"]
    assert repeat > 1.0 and repeat < capacity and capacity < 12.0
    assert table.loc["repeat", "n"] > 1000
