"""What a cluster prior of 1, 2, 3 jobs does (experiments.small_clusters)."""

from __future__ import annotations

import json

import pytest

from experiments.small_clusters import main, small_cluster_figures
from goodput.errors import ValidationError
from tests import hierarchy_jobs as hj


def test_a_prior_from_one_job_of_the_same_cluster_beats_the_weak_default():
    # jobs drawn from one hierarchy: another job's multi-node steps teach a new one's inter-node sync, which its
    # single-node steps leave to the prior (P3); the weak default knows nothing of the cluster's network
    models = hj.cluster(3, seed=5)
    calls = []
    figures = small_cluster_figures(models, {}, jobs=(1, 2, 3), subsets=1, protocols=("P3",), progress=calls.append)
    assert calls == [9] + [0] * 9  # 3 models × (the weak default, 1 job, 2 jobs)
    by_jobs = {f.jobs: f for f in figures}
    assert set(by_jobs) == {0, 1, 2}  # 3 other jobs do not exist in a folder of 3
    assert all(f.protocol == "P3" and not f.sized and f.cases == 3 for f in figures)
    assert by_jobs[1].median_ape < 0.5 * by_jobs[0].median_ape
    assert by_jobs[2].median_ape < 0.5 * by_jobs[0].median_ape


def test_sizes_add_a_setting_and_arguments_are_checked():
    models = hj.cluster(2, seed=1)
    figures = small_cluster_figures(models, {"job0": 1e6, "job1": 4e6}, jobs=(1,), subsets=1, protocols=("P1",))
    assert [(f.sized, f.jobs) for f in figures] == [(True, 0), (True, 1), (False, 0), (False, 1)]
    # the weak default ignores sizes: the same figure in both settings
    assert figures[0].median_ape == pytest.approx(figures[2].median_ape)
    with pytest.raises(ValidationError, match="P9"):
        small_cluster_figures(models, {}, protocols=("P9",))
    with pytest.raises(ValidationError, match="subsets"):
        small_cluster_figures(models, {}, subsets=0)


def _folder(tmp_path):
    for name, scale in (("a", 1.0), ("b", 2.0)):
        folder = tmp_path / "data" / name
        folder.mkdir(parents=True)
        rows = [(p, b, scale * (0.02 + 0.001 * b) + scale * sync, scale * sync)
                for p, sync in (("1", 0.0), ("2", 0.01), ("4", 0.015), ("22", 0.03), ("44", 0.04)) for b in (16, 32, 64)]
        (folder / "placements.csv").write_text("placement,local_bsz,step_time,sync_time\n" +
                                               "".join(f"{p},{b},{t},{s}\n" for p, b, t, s in rows))
    return tmp_path / "data"


def test_command_line(tmp_path, capsys):
    data = _folder(tmp_path)
    assert main([str(data), "--jobs", "1", "--subsets", "1", "--out", str(tmp_path / "small.json")]) == 0
    out = capsys.readouterr().out
    assert "P1 no sizes: weak default" in out and "1 job" in out and "P3 no sizes" in out
    saved = json.loads((tmp_path / "small.json").read_text())[str(data)]
    assert {(f["protocol"], f["jobs"]) for f in saved} == {("P1", 0), ("P1", 1), ("P3", 0), ("P3", 1)}
    assert all(f["cases"] == 2 and f["median_ape"] >= 0 for f in saved)
    for bad in (["--jobs", "0"], ["--jobs", "1,x"], ["--subsets", "0"]):
        with pytest.raises(SystemExit) as exc:
            main([str(data), *bad])
        assert exc.value.code == 2
        assert "expected" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2
    one_gpu = tmp_path / "one-gpu" / "m"
    one_gpu.mkdir(parents=True)
    (one_gpu / "placements.csv").write_text("placement,local_bsz,step_time,sync_time\n1,16,0.1,0.0\n1,32,0.18,0.0\n")
    assert main([str(tmp_path / "one-gpu")]) == 0
    assert "no figures: no model has P1's or P3's test rows" in capsys.readouterr().out
