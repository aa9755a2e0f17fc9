"""Accuracy of step-time prediction on measured data: our Bayesian JobModel against Sia's and Pollux's estimators.

Reads a directory of measurements (:func:`experiments.datasets.read_measurements`:
``<model>/placements-<gpu_type>.csv`` per model and GPU type, Pollux's traces,
Gavel's or Zeus's folder, or JSON Lines profiles) and runs, per model, in
this process (or, with ``--ray [ADDRESS]``, every (model, protocol) as a Ray
task, with the same rows, files and MLflow run), the protocols

* **P1 cold**: every 1-GPU observation on every type → every multi-GPU configuration;
* **P2 one type warm**: P1 plus the single-node multi-GPU observations of one
  type → the multi-GPU configurations of the other types (each type warm in turn);
* **P3 multi-node**: a type's single-node observations → its multi-node configurations;
* **P4 online**: a type's observations revealed one at a time in random order
  (``--seeds`` orders); error on the rest after 5, 10, 20, 40 (at most
  ``--p4-max-test`` of the rest, sampled), and of each next observation before it is revealed;
* **P5 batch sweep**: every type's 1-GPU observations except one type's, of
  which only those at its median batch size → its other 1-GPU batch sizes
  (cross-type prediction of batch-size sweeps, e.g. Zeus);

for these methods:

* ``bayes``: :class:`goodput.JobModel` (Pollux mean + GP residual), with a
  cross-job prior from the *other* models of the same directory
  (:class:`goodput.hierarchy.ClusterPrior`, leave-one-model-out: the
  "brand-new job on a known cluster" case);
* ``bayes-noprior``: the same without the cross-job prior (weak defaults only);

  both given each model's trainable parameter count where it is known
  (``--model-sizes FILE``; by default the data directory's ``model-sizes.json``
  or the bundled counts of published models, ``experiments/data/model-sizes/``;
  and ``num_parameters`` in profiles that ``profile_job`` wrote): the cross-job
  prior then regresses the parameters on the log of the size (its size slopes);
* ``pollux``: Pollux's model fitted per type to that type's training data (its defaults elsewhere);
* ``linear``: linear scaling from 1-GPU profiles (an n-GPU step takes as long
  as a 1-GPU step at the same local batch; Sia's "linear" baseline);
* ``sia``: Sia's ratio estimator (Jayaram Subramanya et al., SOSP'23):
  ``T_B(config) = T_A(config) × T_B(1 GPU) / T_A(1 GPU)`` at the same local
  batch (P5: at the batch size measured on B closest to it), with A the warm
  type (P2) or the type with most data (P5); measured T_A where it exists,
  else A's Pollux fit.

Metrics per protocol and method: median APE, MAPE, p90 APE of step time and the
coverage of 90% intervals (``n/a`` for methods without intervals), with 95%
cluster-bootstrap intervals of the median APE and the coverage over the
independent (model, GPU type) cells (:mod:`experiments.accuracy_intervals`).
Each row records its ``split`` (P2's warm type, P3/P5's type, P4's random
order) next to the ``stage`` (P4's checkpoint). Results per
model are written to ``OUT/rows-<model>.csv`` as soon as the model is done
(``--resume`` skips the models that ``OUT/settings.json`` records as finished
under the same settings, and refuses a folder written with other ones), then ``OUT/summary.csv`` and
``OUT/accuracy.md``, and an MLflow run (experiment ``goodput-accuracy``).
With P1 and P2 among the protocols, ``OUT/evidence.csv`` and a table in the
markdown compare them on the same test rows per model (P2 ≤ P1: one type's
multi-GPU observations do not make the others worse; issue 34), with a 95%
interval of P2 − P1 that resamples the model's test types.
Next to them, ``OUT/reference.csv`` and a table in the markdown give what the
data allow (:mod:`experiments.accuracy_reference`): Pollux's model fitted to
all of a type's data (its capacity, in-sample) and the spread of repeated
measurements of one configuration.

The splits are built in :mod:`experiments.accuracy_protocols`, the baselines
(``pollux``, ``linear``, ``sia``) in :mod:`experiments.accuracy_baselines`, and the
figures and markdown in :mod:`experiments.accuracy_report`; this module runs them
(P4 here) and writes the results.

Run: ``goodput accuracy DATA_DIR`` or ``python -m experiments.accuracy DATA_DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import goodput
from experiments.accuracy_baselines import Predictions, nan_predictions, predict_linear, predict_pollux, predict_sia
from experiments.accuracy_protocols import P4_MIN_OBS, SPLITTERS, Split, splits_p1, splits_p2, splits_p3, splits_p5, untested
from experiments.accuracy_reference import reference_by_model, reference_errors, summarize_reference
from experiments.accuracy_report import P4_STEPS, evidence_check, markdown, per_model, summarize
from experiments.datasets import Measurements, read_measurements, resolve_model_sizes
from experiments.accuracy_args import METHODS, P4_SEEDS, PROTOCOLS, checked_subset
from goodput.hierarchy import ClusterPrior
from goodput.errors import ValidationError
from goodput.io import atomic_write_text
from goodput.model import JobModel
from goodput.observations import Observation, by_gpu_type, indices_by_gpu_type
from goodput.threads import single_threaded
from goodput.tracking import TrackingError
from goodput.throughput import throughput_arrays
from goodput.validation import check_int, check_sizes

__all__ = [
    "PROTOCOLS", "METHODS", "ResumeMismatchError", "run", "evaluate_model", "predict_model", "predict_bayes", "main",
    # defined in the harness's other modules, kept importable from here
    "Split", "splits_p1", "splits_p2", "splits_p3", "splits_p5",  # experiments.accuracy_protocols
    "predict_pollux", "predict_linear", "predict_sia",  # experiments.accuracy_baselines
    "summarize", "per_model", "markdown",  # experiments.accuracy_report
]

LEVEL = 0.9  # of the intervals the harness scores

# the rows the harness writes: one per (split, method, test observation); step times in seconds
ROW_COLUMNS = ["model", "protocol", "split", "stage", "method", "gpu_type", "num_nodes", "num_replicas", "local_bsz",
               "accum_steps", "actual", "predicted", "low", "high"]


TEXT_COLUMNS = ROW_COLUMNS[:6]  # model, protocol, split, stage, method, gpu_type


def _read_rows(path: Path) -> Any:
    """A model's rows as written: its names as text (pandas had read a model "0001" back as 1, "NA" as NaN)."""
    return pd.read_csv(path, dtype={c: str for c in TEXT_COLUMNS}, keep_default_na=False,
                       na_values={c: ["", "nan", "NaN"] for c in ROW_COLUMNS[6:]})


# ====================================================================== our model


def predict_model(model: JobModel, test: Sequence[Observation]) -> Predictions:
    """Median and 90% interval of every test observation from a JobModel (NaN for types it has not seen)."""
    pred, low, high = nan_predictions(len(test))
    for gpu, rows in indices_by_gpu_type(test).items():
        if gpu not in model.gpu_types:
            continue
        cols = throughput_arrays([test[i] for i in rows])
        p = model.predict(gpu, cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"])
        lo, hi = p.interval(LEVEL)
        pred[rows], low[rows], high[rows] = p.step_time, lo, hi
    return pred, low, high


def predict_bayes(job: str, train: Sequence[Observation], test: Sequence[Observation], prior: ClusterPrior | None,
                  model_size: float | None = None) -> Predictions:
    """A fresh :class:`goodput.JobModel` (with the cross-job ``prior``, if any, and the job's parameter count
    ``model_size``, if known) given ``train``, predicting ``test``."""
    model = JobModel(job, init_batch_size=min(o.local_bsz for o in train), cluster_prior=prior, model_size=model_size)
    model.observe(train)
    return predict_model(model, test)


# ====================================================================== one model


def _rows(model: str, split: Split, method: str, test: Sequence[Observation], pred: Predictions, stage: str | None = None) -> pd.DataFrame:
    cols = throughput_arrays(test)
    return pd.DataFrame({
        "model": model, "protocol": split.protocol, "split": split.stage, "stage": stage or split.stage, "method": method,
        "gpu_type": [o.gpu_type for o in test], "num_nodes": cols["num_nodes"].astype(int),
        "num_replicas": cols["num_replicas"].astype(int), "local_bsz": cols["local_bsz"].astype(int),
        "accum_steps": cols["accum_steps"].astype(int), "actual": cols["step_time"],
        "predicted": pred[0], "low": pred[1], "high": pred[2],
    })


def _static_split(model: str, split: Split, prior: ClusterPrior | None, methods: Sequence[str],
                  model_size: float | None = None) -> list[pd.DataFrame]:
    out = []
    for method in methods:
        if method == "bayes":
            pred = predict_bayes(model, split.train, split.test, prior, model_size)
        elif method == "bayes-noprior":
            pred = predict_bayes(model, split.train, split.test, None, model_size)
        elif method == "pollux":
            pred = predict_pollux(split.train, split.test)
        elif method == "linear":
            if split.protocol == "P5":
                continue  # 1-GPU to 1-GPU: no scaling to assume
            pred = predict_linear(split.train, split.test)
        elif method == "sia":
            if split.reference is None:
                continue  # needs a profiled reference type with the configurations (P2, P5)
            pred = predict_sia(split.train, split.test, split.reference)
        else:
            raise ValueError(f"unknown method {method!r}")
        out.append(_rows(model, split, method, split.test, pred))
    return out


def _online(model: str, gpu: str, obs: Sequence[Observation], prior: ClusterPrior | None, methods: Sequence[str],
            seed: int, max_test: int, model_size: float | None = None) -> list[pd.DataFrame]:
    """P4 on one type: reveal in random order; predict the rest at the checkpoints and each next observation."""
    rng = np.random.default_rng(seed)
    order = [obs[i] for i in rng.permutation(len(obs))]
    steps = [k for k in P4_STEPS if k < len(order)]
    if not steps:
        return []
    out: list[pd.DataFrame] = []
    variants = [(m, prior if m == "bayes" else None) for m in methods if m in ("bayes", "bayes-noprior")]
    split = Split("P4", f"order={seed}", [], [])  # rows record which random order they came from
    for method, cluster_prior in variants:
        jm = JobModel(model, init_batch_size=min(o.local_bsz for o in order), cluster_prior=cluster_prior, model_size=model_size)
        nexts = []
        for i, o in enumerate(order[: steps[-1]]):
            if i in steps:
                rest = _sample_rest(order[i:], max_test, seed)
                out.append(_rows(model, split, method, rest, predict_model(jm, rest), stage=f"k={i}"))
            if i >= 1:
                nexts.append((o, predict_model(jm, [o])))
            jm.observe(o)
        last = steps[-1]
        if last == len(order[:last]) and last in steps:
            rest = _sample_rest(order[last:], max_test, seed)
            out.append(_rows(model, split, method, rest, predict_model(jm, rest), stage=f"k={last}"))
        if nexts:
            test = [n[0] for n in nexts]
            pred = tuple(np.concatenate([n[1][j] for n in nexts]) for j in range(3))
            out.append(_rows(model, split, method, test, pred, stage="next"))
    if "pollux" in methods:
        for k in steps:
            rest = _sample_rest(order[k:], max_test, seed)
            out.append(_rows(model, split, "pollux", rest, predict_pollux(order[:k], rest), stage=f"k={k}"))
    return out


def _sample_rest(rest: Sequence[Observation], max_test: int, seed: int) -> list[Observation]:
    if len(rest) <= max_test:
        return list(rest)
    idx = np.sort(np.random.default_rng(seed + 1).choice(len(rest), max_test, replace=False))
    return [rest[i] for i in idx]


@single_threaded
def evaluate_model(
    model: str,
    obs: Sequence[Observation],
    prior: ClusterPrior | None,
    *,
    protocols: Sequence[str] = PROTOCOLS,
    methods: Sequence[str] = METHODS,
    seeds: int = P4_SEEDS,
    p4_max_test: int = 400,
    p4_min_obs: int = P4_MIN_OBS,
    on_step: Callable[[str], None] | None = None,
    model_size: float | None = None,
) -> pd.DataFrame:
    """Every protocol on one model's observations; one row per (split, method, test observation).

    ``model_size``: the model's trainable parameter count, when known (``JobModel(model_size=)``).
    """
    frames: list[pd.DataFrame] = []
    for protocol in protocols:
        if on_step:
            on_step(protocol)
        if protocol == "P4":
            for gpu, items in sorted(by_gpu_type(obs).items()):
                if len(items) < p4_min_obs:
                    continue
                for seed in range(seeds):
                    frames += _online(model, gpu, items, prior, methods, seed, p4_max_test, model_size)
            continue
        for split in SPLITTERS[protocol](obs):
            frames += _static_split(model, split, prior, methods, model_size)
    if not frames:
        return pd.DataFrame(columns=ROW_COLUMNS)
    return pd.concat(frames, ignore_index=True)[ROW_COLUMNS]


# ====================================================================== driver


def _prior_without(full_prior: ClusterPrior | None, name: str) -> ClusterPrior | None:
    """The cross-job prior of the directory without ``name`` (leave-one-model-out), or None when nothing is left."""
    prior = full_prior.exclude(name) if full_prior is not None else None
    return prior if prior is not None and len(prior) else None


@dataclass(frozen=True)
class _Unit:
    """One (model, protocol) of the harness: an independent piece of work (a Ray task)."""

    model: str
    protocol: str
    observations: Sequence[Observation]
    prior: ClusterPrior | None
    model_size: float | None
    options: dict[str, Any]


def _evaluate_unit(unit: _Unit) -> pd.DataFrame:
    """:func:`evaluate_model` of one unit's protocol (on a Ray worker)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return evaluate_model(unit.model, unit.observations, unit.prior, protocols=[unit.protocol],
                              model_size=unit.model_size, **unit.options)


def _evaluate_on_ray(units: Sequence[_Unit], address: str | None, finished: Callable[[str, pd.DataFrame], None],
                     describe: Callable[[str], None]) -> None:
    """Every unit as a Ray task; ``finished(model, rows)`` as each model's last protocol comes in, its rows in
    protocol order (the rows :func:`evaluate_model` gives over all of them)."""
    from profilers.rayutil import connected, map_tasks

    if not units:
        return
    parts: dict[str, dict[str, pd.DataFrame]] = {}
    expected = {u.model: [v.protocol for v in units if v.model == u.model] for u in units}

    def arrived(index: int, rows: pd.DataFrame) -> None:
        unit = units[index]
        got = parts.setdefault(unit.model, {})
        got[unit.protocol] = rows
        describe(f"{sum(map(len, parts.values()))}/{len(units)} (model, protocol) units on Ray; {unit.model}: {unit.protocol}")
        if len(got) == len(expected[unit.model]):
            frames = [got[p] for p in expected[unit.model] if len(got[p])]
            finished(unit.model, pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=ROW_COLUMNS))

    describe(f"0/{len(units)} (model, protocol) units on Ray")
    with connected(address, "the accuracy harness's Ray backend"):
        map_tasks(_evaluate_unit, units, on_result=arrived)


class ResumeMismatchError(ValidationError):
    """``--resume`` into a results folder written with other settings (its rows would be mixed in)."""


def _resume_state(out: Path, settings: dict[str, Any], resume: bool) -> set[str]:
    """The models whose rows in ``out`` were computed with ``settings`` (empty unless resuming).

    ``OUT/settings.json`` records the settings and the models finished under them
    (:func:`_record_settings`). Raises :class:`ResumeMismatchError` when resuming into a folder
    whose record names other settings (naming the first that differs), or that holds per-model
    rows with no record to check them against.
    """
    path = out / "settings.json"
    if not resume:
        return set()
    if not path.exists():
        if any(out.glob("rows-*.csv")):
            raise ResumeMismatchError("out", str(out), "holds rows-*.csv but no settings.json to check them against; "
                                      "rerun without --resume or into another --out")
        return set()
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        recorded = saved["settings"]
        if not isinstance(recorded, dict):
            raise TypeError(recorded)
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ResumeMismatchError("out", str(out), "its settings.json is not a record this harness wrote; "
                                  "rerun without --resume or into another --out") from None
    for key in [*settings, *(k for k in recorded if k not in settings)]:  # a key of either record must match
        value = settings.get(key)
        if recorded.get(key) != value:
            raise ResumeMismatchError(key, value, f"{out} holds rows computed with {key}={recorded.get(key)!r}; "
                                      "rerun with those settings, without --resume, or into another --out")
    return {str(m) for m in saved.get("done", []) if (out / f"rows-{m}.csv").exists()}


def _record_settings(out: Path, settings: dict[str, Any], done: set[str]) -> None:
    atomic_write_text(out / "settings.json", json.dumps({"settings": settings, "done": sorted(done)}, indent=2) + "\n")


def run(
    data_dir: str | Path,
    out_dir: str | Path = "accuracy-results",
    *,
    models: Sequence[str] | None = None,
    protocols: Sequence[str] = PROTOCOLS,
    methods: Sequence[str] = METHODS,
    seeds: int = P4_SEEDS,
    p4_max_test: int = 400,
    default_gpu_type: str = "t4",
    resume: bool = False,
    mlflow: bool = True,
    progress: bool = True,
    console: Any = None,
    model_sizes: Mapping[str, float] | str | Path | None = "auto",
    backend: str = "local",
    address: str | None = None,
) -> pd.DataFrame:
    """Evaluate every model of ``data_dir``; write rows, summary and markdown to ``out_dir``; return the summary.

    ``model_sizes``: trainable parameters per model, on top of those the data
    record (profiles written by ``profile_job``): a mapping, a JSON file
    (:func:`experiments.datasets.read_model_sizes`), ``"auto"`` (the data
    directory's ``model-sizes.json``, else the bundled counts of published
    models whose names the data share; :func:`experiments.datasets.resolve_model_sizes`)
    or ``None``/``"none"``. Known sizes place each model on the cluster prior's
    size slopes (:mod:`goodput.hierarchy`).

    ``seeds`` (random orders per type in P4) and ``p4_max_test`` (held-out observations per P4
    checkpoint) must be integers >= 1 (:class:`~goodput.errors.ValidationError` otherwise).

    ``backend``: ``"local"`` (the models one after the other, here) or ``"ray"``: every (model,
    protocol) is a Ray task on the cluster at ``address`` (:func:`profilers.rayutil.connected`),
    a model's rows written when its last protocol is in. Both give the same rows, files and MLflow run.
    """
    started = time.time()
    if backend not in ("local", "ray"):
        raise ValidationError("backend", backend, "expected 'local' or 'ray'")
    seeds = check_int("seeds", seeds, minimum=1)
    p4_max_test = check_int("p4_max_test", p4_max_test, minimum=1)
    protocols, methods = checked_subset("protocols", protocols, PROTOCOLS), checked_subset("methods", methods, METHODS)
    if Path(data_dir).is_file() and Path(data_dir).suffix != ".jsonl":
        raise ValidationError("data_dir", str(data_dir), "is a file, not a directory (expected a folder of "
                              "measurements or a *.jsonl profile)")
    data: Measurements = read_measurements(data_dir, default_gpu_type=default_gpu_type)
    names = sorted(data.models)
    if models:
        unknown = sorted(set(models) - set(names))
        if unknown:
            raise ValidationError("models", ",".join(models), f"unknown model(s) {', '.join(unknown)}; "
                                  f"{data_dir} holds {', '.join(names) or 'none'}")
        names = [n for n in names if n in models]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    given = resolve_model_sizes(model_sizes, data_dir, sorted(data.models))
    sizes = {**data.sizes, **check_sizes("model_sizes", given.sizes)}
    unused = sorted(set(sizes) - set(data.models))
    sizes = {k: v for k, v in sizes.items() if k in data.models}
    settings = {"data_dir": str(Path(data_dir).resolve()), "default_gpu_type": default_gpu_type, "protocols": list(protocols),
                "methods": list(methods), "seeds": int(seeds), "p4_max_test": int(p4_max_test), "goodput": goodput.__version__}
    if sizes:
        settings["model_sizes"] = dict(sorted(sizes.items()))
    done = _resume_state(out, settings, resume)
    _record_settings(out, settings, done)
    full_prior = ClusterPrior.from_observations(data.models, sizes) if len(data.models) > 1 else None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    evaluated: dict[str, pd.DataFrame] = {}
    options = {"methods": methods, "seeds": seeds, "p4_max_test": p4_max_test}
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} models"),
                  TimeElapsedColumn(), console=console, disable=not progress, transient=False) as bar:
        task = bar.add_task("accuracy", total=len(names))

        def finished(name: str, rows: pd.DataFrame) -> None:
            atomic_write_text(out / f"rows-{name}.csv", rows.to_csv(index=False))
            done.add(name)
            _record_settings(out, settings, done)
            evaluated[name] = rows
            bar.advance(task)

        for name in names:
            if name in done:
                evaluated[name] = _read_rows(out / f"rows-{name}.csv")
                bar.advance(task)
        todo = [name for name in names if name not in done]
        if backend == "ray":
            units = [_Unit(name, protocol, data.models[name], _prior_without(full_prior, name), sizes.get(name), options)
                     for name in todo for protocol in protocols]
            _evaluate_on_ray(units, address, finished, lambda text: bar.update(task, description=text))
        else:
            for name in todo:
                def step(protocol: str, name: str = name) -> None:
                    bar.update(task, description=f"{name}: {protocol}")

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    rows = evaluate_model(name, data.models[name], _prior_without(full_prior, name), protocols=protocols,
                                          on_step=step, model_size=sizes.get(name), **options)
                finished(name, rows)
    frames = [evaluated[name] for name in names]
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=ROW_COLUMNS)
    summary = summarize(rows)
    by_model = per_model(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_errors = reference_errors({n: data.models[n] for n in names})
    reference, ref_by_model = summarize_reference(ref_errors), reference_by_model(ref_errors)
    notes = list(data.notes) + [note for note, wanted in (
        (f"bayes: cross-job prior from the other {len(data.models) - 1} model(s) of the directory (leave-one-model-out); "
         "bayes-noprior: without it" if full_prior is not None else "bayes: a single model, no cross-job prior",
         any(m.startswith("bayes") for m in methods)),
        (f"P4: {seeds} random order(s) per type; at most {p4_max_test} of the rest evaluated per checkpoint", "P4" in protocols),
    ) if wanted] + [
        f"model sizes (trainable parameters) known for {len(sizes)} of {len(data.models)} model(s)"
        + (f": {', '.join(sorted(sizes))}" if sizes else "") + (f"; not in the data: {', '.join(unused)}" if unused else "")
        + f" (--model-sizes {given.source}" + (f"; {len(data.sizes)} recorded by the profiles" if data.sizes else "") + ")",
        f"{len(names)} model(s), {sum(len(data.models[n]) for n in names)} observations, {time.time() - started:.0f} s",
        "GPU types (rows): " + ", ".join(f"{gpu} {count}" for gpu, count in sorted(Counter(
            o.gpu_type for n in names for o in data.models[n]).items())),
    ] + untested({n: data.models[n] for n in names}, {
        protocol: set(zip(*(rows.loc[rows["protocol"].str.startswith(protocol), c] for c in ("model", "gpu_type"))))
        for protocol in protocols})
    title = f"goodput accuracy — {Path(data_dir).resolve().name} ({data.kind})"
    evidence = evidence_check(rows)
    text = markdown(summary, title, notes, by_model, reference, ref_by_model, evidence)
    atomic_write_text(out / "summary.csv", summary.to_csv(index=False))
    if not evidence.empty:
        atomic_write_text(out / "evidence.csv", evidence.to_csv(index=False))
    else:  # not an earlier run's, left in the folder
        (out / "evidence.csv").unlink(missing_ok=True)
    atomic_write_text(out / "reference.csv", reference.to_csv(index=False))
    atomic_write_text(out / "accuracy.md", text)
    meta = {"data_dir": str(data_dir), "kind": data.kind, "default_gpu_type": default_gpu_type, "models": names,
            "protocols": list(protocols),
            "methods": list(methods), "seeds": seeds, "p4_max_test": p4_max_test, "model_sizes": dict(sorted(sizes.items())),
            "model_sizes_source": given.source, "seconds": time.time() - started}
    atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n")
    if mlflow:
        _log_mlflow(summary, rows, out, meta, title, reference)
    return summary


def _log_mlflow(summary: pd.DataFrame, rows: pd.DataFrame, out: Path, meta: dict[str, Any], title: str,
                reference: pd.DataFrame) -> None:
    from goodput import tracking

    with tracking.start_run("goodput-accuracy", run_name=Path(meta["data_dir"]).resolve().name):
        import mlflow

        tracking.log_params({k: v for k, v in meta.items() if k != "seconds"})
        metrics = {}
        for row in summary.itertuples(index=False):
            key = f"{row.protocol}.{row.method}".replace(" ", "_").replace("@", "_at_")
            for metric in ("median_ape", "mape", "p90_ape", "coverage90", "median_ape_low", "median_ape_high",
                           "coverage90_low", "coverage90_high"):
                value = getattr(row, metric)
                if math.isfinite(value):
                    metrics[f"{key}.{metric}"] = float(value)
        for row in reference.itertuples(index=False):
            key = "reference." + row.reference.replace(" ", "_")
            for metric in ("median_ape", "mape", "p90_ape"):
                value = getattr(row, metric)
                if math.isfinite(value):
                    metrics[f"{key}.{metric}"] = float(value)
        mlflow.log_metrics(metrics)
        mlflow.log_artifact(str(out / "accuracy.md"))
        mlflow.log_artifact(str(out / "summary.csv"))
        mlflow.log_artifact(str(out / "reference.csv"))
        if (out / "evidence.csv").is_file():
            mlflow.log_artifact(str(out / "evidence.csv"))
        tracking.log_frame_artifact(rows, "rows.csv")


def build_parser() -> argparse.ArgumentParser:
    from experiments.accuracy_args import configure

    return configure(argparse.ArgumentParser(prog="python -m experiments.accuracy", description=__doc__,
                                             formatter_class=argparse.RawDescriptionHelpFormatter))


def run_from_args(args: argparse.Namespace) -> int:
    from experiments.benchutil import console
    from profilers.rayutil import ray_option

    use_ray, address = ray_option(args)
    out = console()
    saved = f"saved {Path(args.out) / 'accuracy.md'} and {Path(args.out) / 'summary.csv'}"
    try:
        summary = run(
            args.data_dir, args.out,
            models=[m.strip() for m in args.models.split(",")] if args.models else None,
            protocols=args.protocols,
            methods=args.methods,
            seeds=args.seeds, p4_max_test=args.p4_max_test, default_gpu_type=args.gpu_type, resume=args.resume,
            mlflow=not args.no_mlflow, progress=not args.no_progress, console=out,
            model_sizes=args.model_sizes, backend="ray" if use_ray else "local", address=address,
        )
    except TrackingError:  # the results are saved before MLflow is asked: show them, then the store's refusal
        print((Path(args.out) / "accuracy.md").read_text(encoding="utf-8"))
        print(saved)
        raise
    print((Path(args.out) / "accuracy.md").read_text(encoding="utf-8"))
    print(f"{saved} ({len(summary)} rows)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from profilers.rayutil import RayConnectionError, RayNotInstalledError

    try:
        return run_from_args(args)
    except (ValidationError, OSError, RayNotInstalledError, RayConnectionError) as exc:  # OSError: a missing folder
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
