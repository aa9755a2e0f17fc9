"""The derived multi-type folder: the scaling of step and sync times, the layout the harness reads, refusals."""

from __future__ import annotations

import pytest

from pathlib import Path

import experiments.derive_types
from experiments.datasets import read_measurements
from experiments.derive_types import DERIVED_TYPES, SPLIT_SYNC_TYPES, UNEVEN_COVERAGE, Coverage, derive, main
from goodput.errors import DataFormatError, ValidationError


INSIDE = Path(experiments.derive_types.__file__).parent / "derived"  # a folder in the repository


def _traces(root):
    for model, step in (("cifar10", 0.04), ("ncf", 0.008)):
        folder = root / model
        folder.mkdir(parents=True)
        (folder / "placements.csv").write_text(
            f"placement,local_bsz,step_time,sync_time\n1,32,{step},0.0001\n22,64,{3 * step},{step}\n"
        )
    (root / "cifar10" / "scalability.csv").write_text("num_nodes,num_replicas,local_bsz,step_time,sync_time\n8,32,64,0.3,0.2\n")
    return root


def test_derived_folder_scales_compute_and_sync_and_reads_as_five_types(tmp_path):
    traces = _traces(tmp_path / "traces")
    written = derive(traces, tmp_path / "out")
    assert len(written) == 2 * len(DERIVED_TYPES) + len(DERIVED_TYPES)  # placements per model, scalability for cifar10
    measured = read_measurements(tmp_path / "out")
    assert sorted(measured.models) == ["cifar10", "ncf"]
    assert {o.gpu_type for o in measured.models["cifar10"]} == set(DERIVED_TYPES)
    c, s = DERIVED_TYPES["a100"]
    (two_nodes,) = [o for o in measured.models["cifar10"] if o.gpu_type == "a100" and o.num_nodes == 2]
    assert two_nodes.step_time == pytest.approx((0.12 - 0.04) * c + 0.04 * s)
    assert two_nodes.sync_time == pytest.approx(0.04 * s)
    (big,) = [o for o in measured.models["cifar10"] if o.gpu_type == "2080ti" and o.num_replicas == 32]
    c, s = DERIVED_TYPES["2080ti"]
    assert big.step_time == pytest.approx(0.1 * c + 0.2 * s)
    t4 = sorted(o.step_time for o in measured.models["ncf"] if o.gpu_type == "t4")
    assert t4 == pytest.approx([0.008, 0.024])  # the reference type is unchanged


def test_refusals_name_the_field(tmp_path):
    traces = _traces(tmp_path / "traces")
    with pytest.raises(ValidationError, match="outside the repository"):
        derive(traces, INSIDE)
    with pytest.raises(ValidationError, match="types"):
        derive(traces, tmp_path / "out", {"fast": (0.5, 0.0)})
    with pytest.raises(ValidationError, match="no <model>/placements.csv"):
        derive(tmp_path, tmp_path / "out")
    (traces / "ncf" / "placements.csv").write_text("placement,local_bsz,step_time,sync_time\n1,32,0.01,0.02\n")
    with pytest.raises(DataFormatError):  # the sources are validated row by row
        derive(traces, tmp_path / "bad")


def test_command_line(tmp_path, capsys):
    _traces(tmp_path / "data" / "pollux" / "traces")
    assert main([str(tmp_path / "out"), "--data", str(tmp_path / "data")]) == 0
    assert "2 models × 5 types" in capsys.readouterr().out
    assert main([str(INSIDE), "--data", str(tmp_path / "data")]) == 2
    assert not INSIDE.exists()


def test_command_line_types(tmp_path, capsys):
    _traces(tmp_path / "data" / "pollux" / "traces")
    assert main([str(tmp_path / "out"), "--data", str(tmp_path / "data"), "--type", "t4=1,1", "--type", "half=0.5,0.5"]) == 0
    assert "2 models × 2 types (t4, half)" in capsys.readouterr().out
    measured = read_measurements(tmp_path / "out")
    steps = {t: sorted(o.step_time for o in measured.models["cifar10"] if o.gpu_type == t) for t in ("t4", "half")}
    assert steps["half"] == pytest.approx([0.5 * s for s in steps["t4"]])
    for bad in ("v100", "v100=0.5", "=0.5,0.7", "v100=a,b"):
        assert main([str(tmp_path / "bad"), "--data", str(tmp_path / "data"), "--type", bad]) == 2
        assert "NAME=COMPUTE,SYNC" in capsys.readouterr().err
    assert main([str(tmp_path / "bad"), "--data", str(tmp_path / "data"), "--type", "v100=0.5,0.7,0.9,1"]) == 2
    assert main([str(tmp_path / "bad"), "--data", str(tmp_path / "data"), "--type", "v100=0,0.7"]) == 2  # derive() refuses factors <= 0
    assert main([str(tmp_path / "bad"), "--data", str(tmp_path / "data"), "--type", "t4=1,1", "--type", "t4=2,2"]) == 2
    assert "more than once" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_a_third_factor_sets_the_sync_over_several_nodes_apart(tmp_path, capsys):
    traces = _traces(tmp_path / "data" / "pollux" / "traces")
    derive(traces, tmp_path / "out", {"t4": (1.0, 1.0), "nv": (0.5, 0.25, 0.8)})
    measured = read_measurements(tmp_path / "out")
    nv = {(o.num_nodes, o.num_replicas): o for o in measured.models["cifar10"] if o.gpu_type == "nv"}
    assert nv[(1, 1)].step_time == pytest.approx((0.04 - 0.0001) * 0.5 + 0.0001 * 0.25)  # one node: the intra-node factor
    assert nv[(2, 4)].step_time == pytest.approx((0.12 - 0.04) * 0.5 + 0.04 * 0.8)  # placement "22": two nodes
    assert nv[(8, 32)].sync_time == pytest.approx(0.2 * 0.8)  # scalability rows: num_nodes
    with pytest.raises(ValidationError, match="inter-node"):
        derive(traces, tmp_path / "bad", {"nv": (0.5, 0.25, 0.0)})
    assert main([str(tmp_path / "split"), "--data", str(tmp_path / "data"), "--split-sync"]) == 0
    assert f"2 models × {len(SPLIT_SYNC_TYPES)} types" in capsys.readouterr().out
    assert main([str(tmp_path / "both"), "--data", str(tmp_path / "data"), "--split-sync", "--type", "t4=1,1"]) == 2


def test_interactions_give_each_model_its_own_factors_on_each_type_but_the_first(tmp_path, capsys):
    traces = _traces(tmp_path / "data" / "pollux" / "traces")
    types = {"t4": (1.0, 1.0), "nv": (0.5, 0.25, 0.8)}
    derive(traces, tmp_path / "plain", types)
    derive(traces, tmp_path / "mixed", types, interactions=(0.1, 0.25, 0.2), seed=3)
    derive(traces, tmp_path / "again", types, interactions=(0.1, 0.25, 0.2), seed=3)
    plain, mixed, again = (read_measurements(tmp_path / name).models for name in ("plain", "mixed", "again"))

    def steps(models, model, gpu):
        return [o.step_time for o in sorted(models[model], key=lambda o: (o.num_nodes, o.num_replicas, o.local_bsz)) if o.gpu_type == gpu]

    assert steps(mixed, "cifar10", "t4") == steps(plain, "cifar10", "t4")  # the reference type: as measured
    assert steps(mixed, "cifar10", "nv") != pytest.approx(steps(plain, "cifar10", "nv"), rel=1e-3)
    # each model draws its own factors: the two models' ratios to the plain set differ
    ratio = {m: steps(mixed, m, "nv")[0] / steps(plain, m, "nv")[0] for m in ("cifar10", "ncf")}
    assert ratio["cifar10"] != pytest.approx(ratio["ncf"], rel=1e-3)
    assert steps(again, "ncf", "nv") == steps(mixed, "ncf", "nv")  # the seed reproduces the draws
    for bad in ((0.1, -0.2, 0.1), (0.1, float("inf"), 0.1), (0.1, 0.2)):
        with pytest.raises(ValidationError, match="interactions"):
            derive(traces, tmp_path / "bad", types, interactions=bad)
    assert main([str(tmp_path / "cli"), "--data", str(tmp_path / "data"), "--split-sync", "--interactions", "0.1,0.25,0.2"]) == 0
    assert main([str(tmp_path / "bad"), "--data", str(tmp_path / "data"), "--interactions", "a,b,c"]) == 2
    assert "--interactions" in capsys.readouterr().err


def test_a_rerun_into_the_same_folder_holds_its_own_types_alone(tmp_path):
    traces = _traces(tmp_path / "traces")
    derive(traces, tmp_path / "out")
    derive(traces, tmp_path / "out", {"t4": (1.0, 1.0), "half": (0.5, 0.5)})
    assert {o.gpu_type for o in read_measurements(tmp_path / "out").models["cifar10"]} == {"t4", "half"}
    (traces / "ncf" / "placements.csv").write_text("placement,local_bsz,step_time,sync_time\n2x,32,0.01,0.001\n")
    with pytest.raises(DataFormatError, match="placement"):  # checked, not copied into the output
        derive(traces, tmp_path / "out", SPLIT_SYNC_TYPES)
    assert {o.gpu_type for o in read_measurements(tmp_path / "out").models["cifar10"]} == {"t4", "half"}  # untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # nothing half-written left
    with pytest.raises(ValidationError, match="finite"):
        derive(traces, tmp_path / "inf", {"t4": (1.0, 1.0), "x": (float("inf"), 1.0)})
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValidationError, match="out_dir"):
        derive(_traces(tmp_path / "traces2"), tmp_path / "afile")


def test_uneven_coverage_leaves_out_large_batches_other_nodes_and_scalability_runs_per_type(tmp_path, capsys):
    traces = _traces(tmp_path / "data" / "pollux" / "traces")  # local batches 32 and 64, one and two nodes
    types = {"t4": (1.0, 1.0), "small": (0.8, 1.4), "one": (0.7, 1.2), "noscale": (0.45, 0.7)}
    coverage = {"small": Coverage(max_bsz_fraction=0.5), "one": Coverage(max_nodes=1), "noscale": Coverage(scalability=False)}
    derive(traces, tmp_path / "even", types)
    derive(traces, tmp_path / "uneven", types, coverage=coverage)
    even, uneven = (read_measurements(tmp_path / name).models["cifar10"] for name in ("even", "uneven"))

    def configs(models, gpu):
        return sorted((o.num_nodes, o.num_replicas, o.local_bsz) for o in models if o.gpu_type == gpu)

    assert configs(uneven, "t4") == configs(even, "t4") == [(1, 1, 32), (2, 4, 64), (8, 32, 64)]
    assert configs(uneven, "small") == [(1, 1, 32)]  # 64 > half of the model's largest batch
    assert configs(uneven, "one") == [(1, 1, 32)]  # one node only, the scalability run's 8 nodes too
    assert configs(uneven, "noscale") == [(1, 1, 32), (2, 4, 64)]
    assert not (tmp_path / "uneven" / "cifar10" / "scalability-noscale.csv").exists()
    kept = {o.local_bsz: o.step_time for o in uneven if o.gpu_type == "small"}
    assert kept[32] == pytest.approx({o.local_bsz: o.step_time for o in even if o.gpu_type == "small"}[32])  # scaled as before
    with pytest.raises(ValidationError, match="max_bsz_fraction"):
        Coverage(max_bsz_fraction=0.0)
    with pytest.raises(ValidationError, match="max_nodes"):
        Coverage(max_nodes=0)
    with pytest.raises(ValidationError, match="max_nodes"):
        Coverage(max_nodes=True)
    with pytest.raises(ValidationError, match="coverage"):
        derive(traces, tmp_path / "bad", types, coverage={"small": 0.5})
    assert set(UNEVEN_COVERAGE) <= set(DERIVED_TYPES)  # the flag names the default types
    assert main([str(tmp_path / "cli"), "--data", str(tmp_path / "data"), "--uneven"]) == 0
    written = read_measurements(tmp_path / "cli").models["cifar10"]
    assert max(o.num_nodes for o in written if o.gpu_type == "rtx6000") == 1
    assert {o.gpu_type for o in written} == set(DERIVED_TYPES)


def test_batch_sizes_keep_a_few_local_batches_per_model_and_type(tmp_path, capsys):
    traces = _traces(tmp_path / "data" / "pollux" / "traces")  # local batches 32 and 64
    types = {"t4": (1.0, 1.0), "nv": (0.5, 0.25, 0.8), "small": (0.8, 1.4)}
    derive(traces, tmp_path / "all", types, interactions=(0.1, 0.25, 0.2), seed=5)
    derive(traces, tmp_path / "few", types, interactions=(0.1, 0.25, 0.2), seed=5, batch_sizes=1,
           coverage={"small": Coverage(max_bsz_fraction=0.5)})
    derive(traces, tmp_path / "again", types, interactions=(0.1, 0.25, 0.2), seed=5, batch_sizes=1,
           coverage={"small": Coverage(max_bsz_fraction=0.5)})
    every, few, again = (read_measurements(tmp_path / name).models for name in ("all", "few", "again"))
    for model in ("cifar10", "ncf"):
        for gpu in types:
            kept = {o.local_bsz for o in few[model] if o.gpu_type == gpu}
            assert len(kept) == 1  # one of the two local batches, every row of it
            rows = sorted((o.num_nodes, o.num_replicas, o.local_bsz, o.step_time) for o in few[model] if o.gpu_type == gpu)
            assert rows == sorted((o.num_nodes, o.num_replicas, o.local_bsz, o.step_time) for o in every[model]
                                  if o.gpu_type == gpu and o.local_bsz in kept)  # the same factors as without the flag
        assert {o.local_bsz for o in few[model] if o.gpu_type == "small"} == {32}  # drawn among the batches coverage keeps
    assert sorted(map(repr, few["cifar10"])) == sorted(map(repr, again["cifar10"]))  # the seed reproduces the draws
    draws = set()
    for seed in range(8):
        derive(traces, tmp_path / f"s{seed}", types, seed=seed, batch_sizes=1)
        draws.add(frozenset((o.gpu_type, o.local_bsz) for o in read_measurements(tmp_path / f"s{seed}").models["ncf"]))
    assert len(draws) > 1  # drawn, not the first batches
    derive(traces, tmp_path / "more", types, batch_sizes=5)  # more than a model has: every batch
    assert len(read_measurements(tmp_path / "more").models["cifar10"]) == len(every["cifar10"])
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValidationError, match="batch_sizes"):
            derive(traces, tmp_path / "bad", types, batch_sizes=bad)
    for bad in (-1, 1.0, None):
        with pytest.raises(ValidationError, match="seed"):
            derive(traces, tmp_path / "bad", types, seed=bad)
    assert main([str(tmp_path / "bad"), "--data", str(tmp_path / "data"), "--seed", "-1"]) == 2  # a message, not numpy's traceback
    assert "seed" in capsys.readouterr().err
    assert main([str(tmp_path / "cli"), "--data", str(tmp_path / "data"), "--batch-sizes", "1"]) == 0
    assert {len({o.local_bsz for o in read_measurements(tmp_path / "cli").models["cifar10"] if o.gpu_type == g})
            for g in DERIVED_TYPES} == {1}
