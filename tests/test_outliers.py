"""experiments.outliers: stalled steps among a job's observations, the model's Student-t noise against Gaussian."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from experiments.outliers import main, stall_figures
from tests import hierarchy_jobs as hj


def _heavy_cluster(num_jobs: int = 4) -> dict:
    return hj.t4_cluster(num_jobs, seed=12, noise_dof=3.0)


def test_stalled_steps_cost_the_gaussian_model_more_than_the_heavy_tailed_one():
    args = SimpleNamespace(train=30, test=40, fraction=0.1, factor=8.0, seeds=1)
    figures = stall_figures(_heavy_cluster(), {}, args)
    assert figures["predictions"] == 4 * 40
    assert all(2 < dof < 10 for dof in figures["noise_dof"].values())  # the cluster learned heavy tails
    # clean: about the same; stalled: the Gaussian model pulled toward the stalls, the heavy-tailed one not
    assert figures["default_clean_median_ape"] == pytest.approx(figures["gaussian_clean_median_ape"], rel=0.25)
    assert figures["default_stalled_median_ape"] < 1.5 * figures["default_clean_median_ape"]
    assert figures["gaussian_stalled_median_ape"] > 1.5 * figures["default_stalled_median_ape"]


def test_the_command_checks_its_options_and_writes_its_figures(tmp_path, capsys):
    for bad in (["--fraction", "1.5"], ["--train", "2"], ["--factor", "x"]):
        with pytest.raises(SystemExit) as exit_info:
            main([str(tmp_path), *bad])
        assert exit_info.value.code == 2
    assert main([str(tmp_path / "nowhere")]) == 2
    folder = tmp_path / "profiles"
    folder.mkdir()
    from goodput import Profile

    for job, observations in list(_heavy_cluster(3).items()):
        Profile(observations=observations, init_batch_size=8).save(folder / f"{job}.jsonl")
    out = tmp_path / "figures.json"
    assert main([str(folder), "--train", "10", "--test", "5", "--seeds", "1", "--out", str(out)]) == 0
    line = capsys.readouterr().out
    assert "default: clean" in line and "gaussian: clean" in line
    saved = json.loads(out.read_text())[str(folder)]
    assert saved["predictions"] == 3 * 5 and set(saved["noise_dof"]) == {"job0", "job1", "job2"}
