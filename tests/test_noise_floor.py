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


def test_every_folder_and_the_out_path_are_checked_before_the_work_and_the_json_is_strict(tmp_path, capsys):
    folder = tmp_path / "data" / "m"
    folder.mkdir(parents=True)
    (folder / "placements.csv").write_text("placement,local_bsz,step_time,sync_time\n1,32,0.1,0.0\n2,32,0.12,0.0\n")
    (tmp_path / "afile").write_text("")
    for argv in ([str(tmp_path / "data"), "--out", str(tmp_path / "afile" / "x.json")],  # under a file
                 [str(tmp_path / "data"), "--out", str(tmp_path)],  # a folder
                 [str(tmp_path / "data"), str(tmp_path / "missing"), "--out", str(tmp_path / "f.json")]):
        assert main(argv) == 2
        err = capsys.readouterr()
        assert "error" in err.err and "data:" not in err.out  # refused before the first folder's figures
    assert main([str(tmp_path / "data"), "--out", str(tmp_path / "f.json")]) == 0
    text = (tmp_path / "f.json").read_text()
    assert "NaN" not in text and json.loads(text)[str(tmp_path / "data")]["repeats_median_ape"] is None  # no repeats


def test_a_stray_quote_and_data_without_a_row_are_one_line_errors(tmp_path, capsys):
    from experiments.datasets import read_measurements
    from goodput.errors import DataFormatError

    folder = tmp_path / "quote" / "m"
    folder.mkdir(parents=True)
    (folder / "placements-t4.csv").write_text("placement,local_bsz,step_time,sync_time\n\"1,4,0.5,0.01\n" + "2,4,0.5,0.01\n" * 20000)
    with pytest.raises(DataFormatError, match="placements-t4.csv"):
        read_measurements(tmp_path / "quote")
    (tmp_path / "gavel").mkdir()
    (tmp_path / "gavel" / "simulation_throughputs.json").write_text("{}")
    (tmp_path / "prof").mkdir()
    (tmp_path / "prof" / "a.jsonl").write_text("")
    for empty in ("gavel", "prof"):
        with pytest.raises(FileNotFoundError, match="no measurements"):
            read_measurements(tmp_path / empty)
