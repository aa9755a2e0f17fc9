"""experiments.level_shift: a change of a job's speed while it trains, read by the model and not."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from experiments.level_shift import main, shift_figures
from goodput import Profile
from tests import hierarchy_jobs as hj


def _cluster(num_jobs: int = 4) -> dict:
    return hj.t4_cluster(num_jobs, seed=5)


def test_a_change_is_read_and_none_is_invented():
    args = SimpleNamespace(factors=(1.0, 1.5), stalls=2, train=30, after=10, test=40, seeds=1)
    figures = shift_figures(_cluster(), {}, args)
    assert figures["predictions"] == 4 * 40 and figures["fits"] == 4
    assert figures["x1.5_shifts_found"] == 100.0 and figures["x1.5_plain_found"] == 0.0
    assert figures["x1.5_plain_median_ape"] > 20.0  # the old speed's steps hold the plain model near it
    assert figures["x1.5_shifts_median_ape"] < 0.4 * figures["x1.5_plain_median_ape"]
    for label in ("x1", "stalls"):  # no change: none found, and the model is the plain one
        assert figures[f"{label}_shifts_found"] == 0.0
        assert figures[f"{label}_shifts_median_ape"] == figures[f"{label}_plain_median_ape"]


def test_online_the_model_follows_a_change_within_the_steps_after_it_and_the_plain_one_does_not():
    args = SimpleNamespace(factors=(1.5,), stalls=0, train=30, after=8, test=20, seeds=1, online=True)
    figures = shift_figures(_cluster(2), {}, args)
    assert figures["online_shifts_followed"] == 100.0 and 3 <= figures["online_shifts_median_steps"] <= 8
    assert figures["online_plain_followed"] == 0.0 and figures["online_plain_median_steps"] is None


def test_the_command_checks_its_options_and_writes_its_figures(tmp_path, capsys):
    for bad in (["--factors", "1,x"], ["--factors", "20"], ["--after", "0"], ["--stalls", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            main([str(tmp_path), *bad])
        assert exit_info.value.code == 2
    folder = tmp_path / "profiles"
    folder.mkdir()
    for job, observations in _cluster(3).items():
        Profile(observations=observations, init_batch_size=8).save(folder / f"{job}.jsonl")
    out = tmp_path / "figures.json"
    assert main([str(folder), "--factors", "1.5", "--stalls", "0", "--train", "10", "--after", "4", "--test", "5",
                 "--seeds", "1", "--out", str(out)]) == 0
    line = capsys.readouterr().out
    assert "x1.5: shifts" in line and "stalls" not in line
    saved = json.loads(out.read_text())[str(folder)]
    assert saved["predictions"] == 3 * 5 and saved["fits"] == 3
    assert set(saved) >= {"x1.5_shifts_median_ape", "x1.5_plain_coverage90", "x1.5_shifts_found"}
