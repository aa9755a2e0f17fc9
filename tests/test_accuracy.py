"""The accuracy harness: the measurement-directory layout, protocols end to end, the CLI, real data."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from experiments import accuracy
from experiments.datasets import KNOWN_SIZES_DIR, read_measurements, read_model_sizes, read_zeus, resolve_model_sizes
from cli import main
from goodput.errors import DataFormatError, ValidationError
from goodput.throughput import ThroughputParams, predict_compute_time, predict_step_time

# Known parameters per GPU type of a synthetic "cluster" (fast a100 on 8-GPU nodes, t4 on 4-GPU
# nodes, rtx profiled on 1 GPU only); jobs differ by a compute and a sync scale.
TYPES = {
    "t4": (ThroughputParams(0.030, 0.0020, 0.30, 0.006, 0.08, 0.004, 1.5), ["1", "2", "4", "11", "22", "44", "1111"]),
    "a100": (ThroughputParams(0.008, 0.0005, 0.20, 0.004, 0.03, 0.002, 1.5), ["1", "2", "4", "8", "88"]),
    "rtx2080ti": (ThroughputParams(0.015, 0.0010, 0.25, 0.005, 0.05, 0.003, 1.5), ["1"]),
}
JOBS = {"resnet": (1.0, 1.0), "bert": (3.0, 4.0), "small": (0.4, 0.3)}


def _write_layout(root: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for job, (compute, sync) in JOBS.items():
        (root / job).mkdir(parents=True)
        for gpu, (p, placements) in TYPES.items():
            if job == "small" and gpu == "a100":
                continue  # a model missing on a type
            params = ThroughputParams(p.alpha_c * compute, p.beta_c * compute, p.alpha_n * sync, p.beta_n * sync,
                                      p.alpha_r * sync, p.beta_r * sync, p.gamma)
            with open(root / job / f"placements-{gpu}.csv", "w", newline="") as f:
                out = csv.writer(f)
                out.writerow(["placement", "local_bsz", "step_time", "sync_time"])
                for placement in placements:
                    gpus = [int(c) for c in placement]
                    for bsz in (16, 32, 64, 128):
                        step = float(predict_step_time(params, len(gpus), sum(gpus), bsz)) * float(np.exp(rng.normal(0, 0.03)))
                        sync = max(step - float(predict_compute_time(params, bsz)), 0.0)
                        out.writerow([placement, bsz, f"{step:.6g}", f"{sync:.6g}"])
        (root / job / "validation-128.csv").write_text("progress,iteration,metric,grad_sqr,grad_var\n1,1,0.5,1.0,2.0\n")
    return root


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    return _write_layout(tmp_path / "measured")


def test_read_measurements_of_the_layout(layout, tmp_path):
    data = read_measurements(layout)
    assert data.kind == "placements" and sorted(data.models) == ["bert", "resnet", "small"]
    assert {o.gpu_type for o in data.models["small"]} == {"t4", "rtx2080ti"}
    nodes = {(o.gpu_type, o.num_nodes, o.num_replicas) for o in data.models["resnet"]}
    assert ("a100", 2, 16) in nodes and ("t4", 4, 4) in nodes
    assert not any("validation" in n for n in data.notes)  # not step times: not read, not an error
    # Pollux's own layout (no type in the name) reads as --gpu-type
    pollux = tmp_path / "pollux" / "cifar10"
    pollux.mkdir(parents=True)
    (pollux / "placements.csv").write_text("placement,local_bsz,step_time,sync_time\n1,32,0.04,0.0\n22,32,0.2,0.1\n")
    data = read_measurements(tmp_path / "pollux", default_gpu_type="t4")
    assert {o.gpu_type for o in data.models["cifar10"]} == {"t4"} and any("read as 't4'" in n for n in data.notes)
    (pollux / "scalability-v100.csv").write_text("num_nodes,num_replicas,local_bsz,step_time,sync_time\n2,x,32,0.2,0.1\n")
    with pytest.raises(DataFormatError, match="scalability-v100.csv:2"):
        read_measurements(tmp_path / "pollux")
    with pytest.raises(FileNotFoundError):
        read_measurements(tmp_path / "nothing-here")


def test_a_folder_of_profiles_is_measurements(layout, tmp_path):
    from goodput import Profile

    models = read_measurements(layout).models
    folder = tmp_path / "profiles"
    folder.mkdir()
    for job in ("resnet", "bert"):
        Profile(models[job], job=job, init_batch_size=16).save(folder / f"{job}.jsonl")
    data = read_measurements(folder)
    assert data.kind == "profiles" and sorted(data.models) == ["bert", "resnet"]
    assert len(data.models["bert"]) == len(models["bert"])
    summary = accuracy.run(folder, tmp_path / "out", protocols=["P1"], methods=["bayes", "linear"], progress=False, mlflow=False)
    assert set(summary["method"]) == {"bayes", "linear"}


def test_known_model_sizes_carry_other_jobs_sync(layout, tmp_path):
    """The layout's sync costs scale with a size (resnet 1, bert 4, small 0.3) that compute times only approximate
    (1, 3, 0.4): told the sizes, the cold protocol predicts multi-GPU steps closer; the run records them."""
    sizes = {"resnet": 1.0e6, "bert": 4.0e6, "small": 0.3e6}
    blind = accuracy.run(layout, tmp_path / "blind", protocols=["P1"], methods=["bayes"], progress=False, mlflow=False)
    told = accuracy.run(layout, tmp_path / "told", protocols=["P1"], methods=["bayes"], progress=False, mlflow=False,
                        model_sizes={**sizes, "absent-model": 5.0e6})
    assert told["median_ape"].iloc[0] < 0.8 * blind["median_ape"].iloc[0]
    meta = json.loads((tmp_path / "told" / "meta.json").read_text())
    assert meta["model_sizes"] == sizes and json.loads((tmp_path / "told" / "settings.json").read_text())["settings"]["model_sizes"] == sizes
    text = (tmp_path / "told" / "accuracy.md").read_text()
    assert "known for 3 of 3 model(s)" in text and "not in the data: absent-model" in text
    with pytest.raises(ValueError, match="model_sizes\\['bert'\\]"):
        accuracy.run(layout, tmp_path / "bad", protocols=["P1"], methods=["bayes"], progress=False, mlflow=False,
                     model_sizes={"bert": -1})
    # the same from a JSON file on the command line, and from profiles that record num_parameters
    path = tmp_path / "sizes.json"
    path.write_text(json.dumps({"resnet": {"num_parameters": 1.0e6, "source": "test"}, "bert": 4.0e6, "small": 0.3e6}))
    assert read_model_sizes(path) == sizes
    assert main(["accuracy", str(layout), "--out", str(tmp_path / "cli"), "--protocols", "P1", "--methods", "bayes",
                 "--model-sizes", str(path), "--no-mlflow", "--no-progress"]) == 0
    assert pd.read_csv(tmp_path / "cli" / "summary.csv")["median_ape"].iloc[0] == pytest.approx(told["median_ape"].iloc[0])
    for bad, field in (('{"bert": 0}', "bert.num_parameters"), ('{"bert": {"source": "x"}}', "bert.num_parameters"),
                       ("[1, 2]", "model sizes"), ("{bert", "model sizes")):
        path.write_text(bad)
        with pytest.raises(DataFormatError, match=field):
            read_model_sizes(path)
    from goodput import Profile

    folder = tmp_path / "profiles"
    folder.mkdir()
    for job, observations in read_measurements(layout).models.items():
        Profile(observations, job=job, init_batch_size=16, metadata={"num_parameters": int(sizes[job])}).save(folder / f"{job}.jsonl")
    assert read_measurements(folder).sizes == sizes
    accuracy.run(folder, tmp_path / "from-profiles", protocols=["P1"], methods=["bayes"], progress=False, mlflow=False)
    notes = (tmp_path / "from-profiles" / "accuracy.md").read_text()
    assert "known for 3 of 3 model(s)" in notes and "3 recorded by the profiles" in notes


def test_model_sizes_auto_reads_the_data_or_the_bundled_counts(layout, tmp_path):
    """``--model-sizes auto``: the data directory's own model-sizes.json, else a bundled file naming 2+ of its models."""
    pollux = read_model_sizes(KNOWN_SIZES_DIR / "pollux.json")
    got = resolve_model_sizes("auto", tmp_path, ["bert", "cifar10", "mine"])
    assert got.sizes == {"bert": pollux["bert"], "cifar10": pollux["cifar10"]} and "pollux.json" in got.source
    assert resolve_model_sizes("auto", tmp_path, ["BERT", "Cifar10"]).sizes == {"BERT": pollux["bert"], "Cifar10": pollux["cifar10"]}
    gavel = resolve_model_sizes("auto", tmp_path, ["lm", "resnet-50", "transformer"])
    assert "gavel.json" in gavel.source and gavel.sizes["resnet-50"] == 25_557_032 and gavel.sizes["lm"] == 13_987_678
    lone = resolve_model_sizes("auto", tmp_path, ["bert", "resnet", "small"])  # one shared name could be another network
    assert lone.sizes == {} and lone.source.startswith("auto: none")
    assert resolve_model_sizes("none", tmp_path, ["bert", "cifar10"]).sizes == {}
    assert resolve_model_sizes(None, tmp_path, ["bert", "cifar10"]).sizes == {}
    (tmp_path / "model-sizes.json").write_text(json.dumps({"bert": 7.0e6, "cifar10": {"num_parameters": 2.0e6}}))
    own = resolve_model_sizes("auto", tmp_path, ["bert", "cifar10"])
    assert own.sizes == {"bert": 7.0e6, "cifar10": 2.0e6} and str(tmp_path / "model-sizes.json") in own.source
    assert resolve_model_sizes(tmp_path / "model-sizes.json", layout, ["bert"]).sizes == own.sizes
    with pytest.raises(FileNotFoundError):
        resolve_model_sizes(tmp_path / "absent.json", layout, ["bert"])
    # the harness: the layout shares only "bert" with the bundled files, so auto adds nothing; its own file is read
    (layout / "model-sizes.json").write_text(json.dumps({"resnet": 1.0e6, "bert": 4.0e6, "small": 0.3e6}))
    accuracy.run(layout, tmp_path / "auto", protocols=["P1"], methods=["bayes"], progress=False, mlflow=False)
    meta = json.loads((tmp_path / "auto" / "meta.json").read_text())
    assert meta["model_sizes"] == {"resnet": 1.0e6, "bert": 4.0e6, "small": 0.3e6}
    assert meta["model_sizes_source"] == f"auto: {layout / 'model-sizes.json'}"
    assert "(--model-sizes auto: " in (tmp_path / "auto" / "accuracy.md").read_text()


def test_bundled_model_sizes_name_their_sources():
    files = sorted(KNOWN_SIZES_DIR.glob("*.json"))
    assert {f.name for f in files} >= {"pollux.json", "gavel.json"}
    for path in files:
        entries = json.loads(path.read_text())
        assert all(isinstance(e, dict) and len(e.get("source", "")) > 20 for e in entries.values()), path.name
        assert all(1e5 < n < 1e9 for n in read_model_sizes(path).values()), path.name


def test_protocol_splits(layout):
    obs = read_measurements(layout).models["resnet"]
    (p1,) = accuracy.splits_p1(obs)
    assert all(o.num_replicas == 1 for o in p1.train) and all(o.num_replicas > 1 for o in p1.test)
    p2 = accuracy.splits_p2(obs)
    assert [s.stage for s in p2] == ["warm=a100", "warm=t4"]  # rtx has no multi-GPU rows: never warm
    assert all(o.gpu_type != "a100" for o in p2[0].test) and any(o.gpu_type == "a100" and o.num_replicas > 1 for o in p2[0].train)
    p3 = accuracy.splits_p3(obs)
    assert [s.stage for s in p3] == ["a100", "t4"] and all(o.num_nodes > 1 for s in p3 for o in s.test)
    p5 = accuracy.splits_p5(obs)
    assert {s.stage for s in p5} == {"a100", "rtx2080ti", "t4"}
    assert all(len({o.local_bsz for o in s.train if o.gpu_type == s.stage}) == 1 for s in p5)


def test_harness_end_to_end_with_mlflow_and_resume(layout, tmp_path):
    out = tmp_path / "results"
    summary = accuracy.run(layout, out, models=["resnet", "small"], seeds=1, p4_max_test=30, progress=False)
    groups = set(summary["protocol"])
    assert {"P1", "P2", "P3", "P4@5", "P4@10", "P4@20", "P5"} <= groups
    bayes = summary[summary["method"] == "bayes"].set_index("protocol")
    assert np.isfinite(bayes["coverage90"]).all() and (bayes["median_ape"] >= 0).all()
    assert summary.loc[summary["method"] == "sia", "coverage90"].isna().all()  # no intervals: n/a
    for name in ("accuracy.md", "summary.csv", "meta.json", "rows-resnet.csv", "rows-small.csv"):
        assert (out / name).exists()
    text = (out / "accuracy.md").read_text()
    assert "| P2 | sia |" in text and "n/a" in text
    # the prior of each evaluated model holds every other model of the directory, evaluated or not
    assert "cross-job prior from the other 2 model(s)" in text
    # From known parameters with 3% noise, a job whose other jobs ran everywhere is predicted closely.
    assert bayes.loc["P1", "median_ape"] < summary.query("protocol == 'P1' and method == 'linear'")["median_ape"].iloc[0]
    assert bayes.loc["P2", "median_ape"] < summary.query("protocol == 'P2' and method == 'sia'")["median_ape"].iloc[0]
    import mlflow

    runs = mlflow.search_runs(experiment_names=["goodput-accuracy"])
    assert len(runs) == 1 and runs["metrics.P2.bayes.median_ape"].iloc[0] == pytest.approx(bayes.loc["P2", "median_ape"])
    # resume: finished models are read back, not recomputed
    rows = pd.read_csv(out / "rows-small.csv")
    rows.loc[rows["method"] == "linear", "predicted"] *= 2
    rows.to_csv(out / "rows-small.csv", index=False)
    (out / "rows-resnet.csv").unlink()  # as if the run had died after the first model
    again = accuracy.run(layout, out, models=["resnet", "small"], seeds=1, p4_max_test=30, progress=False, mlflow=False, resume=True)
    assert again.query("protocol == 'P1' and method == 'linear'")["median_ape"].iloc[0] != pytest.approx(
        summary.query("protocol == 'P1' and method == 'linear'")["median_ape"].iloc[0])
    assert (out / "rows-resnet.csv").exists() and json.loads((out / "meta.json").read_text())["seeds"] == 1
    # resuming with other settings would mix rows computed two ways: refused, naming the setting
    with pytest.raises(accuracy.ResumeMismatchError, match="protocols"):
        accuracy.run(layout, out, models=["resnet", "small"], seeds=1, p4_max_test=30, progress=False, mlflow=False, resume=True,
                     protocols=["P1"])
    # a fresh run over the folder with other settings: the rows it did not rewrite are not reused later
    accuracy.run(layout, out, models=["small"], seeds=1, p4_max_test=30, progress=False, mlflow=False, protocols=["P1"])
    assert json.loads((out / "settings.json").read_text())["done"] == ["small"]
    mixed = accuracy.run(layout, out, models=["resnet", "small"], seeds=1, p4_max_test=30, progress=False, mlflow=False, resume=True,
                         protocols=["P1"])
    assert set(mixed["protocol"]) == {"P1"}  # resnet's all-protocol rows were recomputed, not read back
    (out / "settings.json").write_text("{not json")
    with pytest.raises(accuracy.ResumeMismatchError, match="settings.json"):
        accuracy.run(layout, out, models=["small"], seeds=1, progress=False, mlflow=False, resume=True)
    (out / "settings.json").unlink()
    with pytest.raises(ValueError, match="settings.json"):
        accuracy.run(layout, out, models=["resnet", "small"], seeds=1, p4_max_test=30, progress=False, mlflow=False, resume=True)


def test_resumed_rows_keep_names_that_look_like_numbers_and_repeats_run_once(layout, tmp_path):
    """A resumed model '0001' had come back as 1 (pandas guessed the column's type); '--protocols P1,P1' had
    evaluated and counted everything twice; the P4 and bayes notes had been written for runs without them."""
    import shutil

    shutil.move(layout / "small", layout / "0001")
    out = tmp_path / "numeric"
    kwargs = dict(models=["0001"], seeds=1, progress=False, mlflow=False, methods=["linear", "linear"])
    first = accuracy.run(layout, out, protocols=["P1", "P1"], **kwargs)
    assert first["n"].tolist() == [len(accuracy.splits_p1(read_measurements(layout).models["0001"])[0].test)]
    fresh = (out / "accuracy.md").read_text()
    assert "P4:" not in fresh and "bayes:" not in fresh
    again = accuracy.run(layout, out, protocols=["P1"], resume=True, **kwargs)
    pd.testing.assert_frame_equal(again, first)
    resumed = (out / "accuracy.md").read_text()
    assert "| 0001 | linear |" in resumed and "| 1 | linear |" not in resumed
    with pytest.raises(ValidationError, match="protocols"):  # checked before anything is written
        accuracy.run(layout, tmp_path / "bad", protocols=["p1"], progress=False, mlflow=False)
    assert not (tmp_path / "bad").exists()


def test_cli_accuracy(layout, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["accuracy", str(layout), "--out", str(out), "--protocols", "P1,P2", "--methods", "bayes,sia,linear",
                 "--models", "resnet,small", "--no-mlflow", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "| P1 | bayes |" in printed and "| P2 | sia |" in printed and "accuracy.md" in printed
    with pytest.raises(SystemExit):
        main(["accuracy", str(layout), "--protocols", "P9"])
    assert main(["accuracy", str(tmp_path / "absent"), "--no-mlflow"]) == 2


# ====================================================================== real data (skipped when absent)


def _convert_pollux(traces: Path, root: Path, models: list[str], every: int) -> Path:
    """Pollux's T4 traces in the multi-type layout (placements-t4.csv), every n-th row."""
    for model in models:
        (root / model).mkdir(parents=True)
        lines = (traces / model / "placements.csv").read_text().splitlines()
        keep = [lines[0]] + [line for i, line in enumerate(lines[1:]) if i % every == 0 or line.split(",")[0] == "1"]
        (root / model / "placements-t4.csv").write_text("\n".join(keep) + "\n")
    return root


@pytest.mark.data
def test_protocols_on_pollux_t4_traces(pollux_traces, tmp_path):
    root = _convert_pollux(pollux_traces, tmp_path / "pollux-layout", ["cifar10", "imagenet", "yolov3"], every=8)
    summary = accuracy.run(root, tmp_path / "out", protocols=["P1", "P3"], methods=["bayes", "linear", "pollux"],
                           progress=False, mlflow=False)
    p1 = summary[summary["protocol"] == "P1"].set_index("method")
    assert p1.loc["bayes", "median_ape"] < 0.7 * p1.loc["linear", "median_ape"]  # measured: ~13% vs ~37%
    assert 50 <= p1.loc["bayes", "coverage90"] <= 100
    assert set(summary["protocol"]) == {"P1", "P3"}


@pytest.mark.data
def test_protocols_on_gavel_and_zeus(data_dir, tmp_path):
    gavel = accuracy.run(data_dir / "gavel", tmp_path / "gavel", models=["resnet-50", "transformer"], protocols=["P2"],
                         methods=["bayes", "sia"], progress=False, mlflow=False)
    p2 = gavel.set_index("method")
    assert p2.loc["bayes", "n"] == p2.loc["sia", "n"] > 50 and p2.loc["bayes", "median_ape"] < 50
    meta = json.loads((tmp_path / "gavel" / "meta.json").read_text())
    assert meta["model_sizes_source"] == "auto: bundled gavel.json" and len(meta["model_sizes"]) == 5
    zeus = read_zeus(data_dir / "zeus")
    assert len(zeus.choices) == 6 and {o.gpu_type for o in zeus.observations} == {"a40", "p100", "rtx6000", "v100"}
    assert zeus.choices["cifar100-shufflenetv2"]["optimizer"] == "adadelta"  # measured on all four types
    assert zeus.choices["imagenet-resnet50"]["power_limit"]["a40"] == 300.0  # the largest limit per type
    summary = accuracy.run(data_dir / "zeus", tmp_path / "zeus", models=["imagenet-resnet50"], protocols=["P5"],
                           methods=["bayes", "sia", "pollux"], progress=False, mlflow=False)
    assert set(summary["method"]) == {"bayes", "sia", "pollux"} and (summary["n"] > 10).all()
