"""The compute form's held-out check (experiments.compute_form): Pollux's α + β·b against a soft maximum."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from experiments.compute_form import MIN_SIZES, compute_curves, held_out_errors, main, soft_max_step_time
from goodput import Observation

PROFILES = str(Path(__file__).resolve().parent.parent / "experiments" / "data" / "profiles")
SIZES = np.array([2, 4, 8, 16, 32, 64, 128, 256], dtype=float)


def _models(power: float, noise: float, seed: int = 0, growth: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for j in range(3):
        params = np.array([np.log(0.05 * (j + 1)), np.log(0.004), np.log(power), np.log(growth)])
        truth = soft_max_step_time(params, SIZES) * np.exp(noise * rng.standard_normal(SIZES.size))
        out[f"job{j}"] = [Observation(f"job{j}", "v100", 1, 1, int(b), float(t)) for b, t in zip(SIZES, truth)]
    return out


def test_the_soft_maximum_is_pollux_s_sum_at_p_1_and_the_larger_part_as_p_grows():
    alpha, beta = 0.05, 0.004
    pollux = soft_max_step_time(np.log([alpha, beta]), SIZES)
    assert pollux == pytest.approx(alpha + beta * SIZES)
    assert soft_max_step_time(np.log([alpha, beta, 1.0]), SIZES) == pytest.approx(pollux)
    assert soft_max_step_time(np.log([alpha, beta, 1.0, 1.0]), SIZES) == pytest.approx(pollux)
    assert soft_max_step_time(np.log([alpha, beta, 1.0, 1.5]), SIZES) == pytest.approx(alpha + beta * SIZES**1.5)
    assert soft_max_step_time(np.log([alpha, beta, 200.0]), SIZES) == pytest.approx(np.maximum(alpha, beta * SIZES), rel=0.01)


def test_each_form_wins_on_steps_drawn_from_it():
    flat = held_out_errors(_models(power=3.0, noise=0.01))  # latency-bound small batches: the soft maximum's shape
    assert flat["pollux"].points == flat["soft_max"].points == 3 * SIZES.size and flat["pollux"].cells == 3
    assert flat["soft_max"].median_ape < flat["pollux"].median_ape / 2
    summed = held_out_errors(_models(power=1.0, noise=0.01))  # Pollux's own form: the extra freedom costs little
    assert summed["soft_max"].median_ape < summed["pollux"].median_ape + 0.5 and summed["pollux"].median_ape < 2.0
    assert summed["soft_max_growth"].median_ape < summed["pollux"].median_ape + 0.5
    steeper = held_out_errors(_models(power=2.0, noise=0.01, growth=1.3))  # slower than linear at large batches
    assert steeper["soft_max_growth"].median_ape < steeper["soft_max"].median_ape / 2


def test_a_cell_with_few_sizes_or_other_configurations_is_left_out():
    models = _models(power=2.0, noise=0.0)
    models["job0"] = models["job0"][:MIN_SIZES - 1] + [Observation("job0", "v100", 1, 2, 8, 0.2),
                                                       Observation("job0", "v100", 1, 1, 8, 0.3, accum_steps=2)]
    assert [(job, gpu) for job, gpu, _, _ in compute_curves(models)] == [("job1", "v100"), ("job2", "v100")]


def test_command_line(tmp_path, capsys):
    assert main([PROFILES, "--out", str(tmp_path / "form.json")]) == 0
    assert "held-out sizes" in capsys.readouterr().out
    saved = json.loads((tmp_path / "form.json").read_text())[PROFILES]
    assert saved["pollux"]["points"] == saved["soft_max"]["points"] == saved["soft_max_growth"]["points"] > 0
    assert np.isfinite(saved["soft_max"]["median_ape"]) and np.isfinite(saved["soft_max_growth"]["median_ape"])
    assert main([str(tmp_path / "missing")]) == 2
