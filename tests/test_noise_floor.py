"""The noise floors of a measurement folder (experiments.noise_floor): repeats and own fits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.noise_floor import MIN_REPEATS, main, noise_floors
from tests import hierarchy_jobs as hj


def _jobs(noise: float, repeats: int) -> dict:
    rng = np.random.default_rng(2)
    out = {}
    for j in range(2):
        truth = hj.draw_job(rng)
        out[f"job{j}"] = [o for _ in range(repeats) for o in hj.observe(f"job{j}", "t4", truth["t4"], hj.SINGLE + hj.SINGLE_NODE, rng, noise=noise)]
    return out


def test_the_floors_follow_the_noise():
    # log-normal noise of std σ: a measurement against the mean of k others is off by |N(0, σ²(1 + 1/k))|, median 0.674·σ·√(1 + 1/k)
    floors = noise_floors(_jobs(0.05, 8))
    assert floors.repeated_configurations == 2 * 3 * 3  # jobs × configurations × batch sizes
    assert floors.repeats_median_ape == pytest.approx(100 * 0.674 * 0.05 * np.sqrt(1 + 1 / 7), rel=0.2)
    assert 0 < floors.own_fit_median_ape < floors.repeats_median_ape * 1.2  # the form fits exact Pollux steps to the noise
    quiet = noise_floors(_jobs(0.005, 8))
    assert quiet.repeats_median_ape < floors.repeats_median_ape / 5 and quiet.own_fit_median_ape < floors.own_fit_median_ape / 5
    few = noise_floors(_jobs(0.05, MIN_REPEATS - 1))
    assert few.repeated_configurations == 0 and np.isnan(few.repeats_median_ape) and few.measurements == 2 * 9 * (MIN_REPEATS - 1)


def test_command_line(tmp_path, capsys):
    folder = tmp_path / "data" / "m"
    folder.mkdir(parents=True)
    (folder / "placements.csv").write_text("placement,local_bsz,step_time,sync_time\n" +
                                           "".join(f"{p},{b},{t * (1 + 0.01 * k)},0.0\n" for k in range(4)
                                                   for p, b, t in (("1", 32, 0.1), ("1", 64, 0.18), ("2", 32, 0.12), ("11", 32, 0.15))))
    assert main([str(tmp_path / "data"), "--out", str(tmp_path / "floors.json")]) == 0
    out = capsys.readouterr().out
    assert "repeats" in out and "4 configurations" in out
    saved = json.loads((tmp_path / "floors.json").read_text())
    assert saved[str(tmp_path / "data")]["measurements"] == 16
    assert main([str(tmp_path / "missing")]) == 2
