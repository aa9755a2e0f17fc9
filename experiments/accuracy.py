"""Accuracy of step-time prediction on measured data: our Bayesian JobModel against Sia's and Pollux's estimators.

Reads a directory of measurements (:func:`experiments.datasets.read_measurements`:
``<model>/placements-<gpu_type>.csv`` per model and GPU type, Pollux's traces,
Gavel's or Zeus's folder, or JSON Lines profiles) and runs, per model and in
one process, the protocols

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
  (:class:`goodput.cluster_prior.ClusterPrior`, leave-one-model-out: the
  "brand-new job on a known cluster" case);
* ``bayes-noprior``: the same without the cross-job prior (weak defaults only);
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
Next to them, ``OUT/reference.csv`` and a table in the markdown give what the
data allow (:mod:`experiments.accuracy_reference`): Pollux's model fitted to
all of a type's data (its capacity, in-sample) and the spread of repeated
measurements of one configuration.

Run: ``goodput accuracy DATA_DIR`` or ``python -m experiments.accuracy DATA_DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import goodput
from experiments.accuracy_intervals import RESAMPLES, cluster_bootstrap
from experiments.accuracy_reference import reference_by_model, reference_errors, summarize_reference
from experiments.datasets import Measurements, read_measurements
from goodput.errors import ValidationError
from goodput.io import atomic_write_text
from goodput.model import JobModel
from goodput.observations import Observation, by_gpu_type, indices_by_gpu_type
from goodput.threads import single_threaded
from goodput.throughput import ThroughputParams, _step_time, fit_throughput, throughput_arrays
from goodput.cluster_prior import ClusterPrior

__all__ = ["PROTOCOLS", "METHODS", "ResumeMismatchError", "run", "evaluate_model", "summarize", "markdown", "main"]

from goodput.cli.accuracy import METHODS, P4_SEEDS, PROTOCOLS  # noqa: E402 - one definition for the CLI and the harness
P4_STEPS = (5, 10, 20, 40)
LEVEL = 0.9

_ROW_COLUMNS = ["model", "protocol", "split", "stage", "method", "gpu_type", "num_nodes", "num_replicas", "local_bsz",
                "accum_steps", "actual", "predicted", "low", "high"]


@dataclass
class Split:
    """One train/test split of a protocol."""

    protocol: str
    stage: str
    train: list[Observation]
    test: list[Observation]
    reference: str | None = None  # Sia's reference type


# ====================================================================== splits


def splits_p1(obs: Sequence[Observation]) -> list[Split]:
    train = [o for o in obs if o.num_replicas == 1]
    types = {o.gpu_type for o in train}
    test = [o for o in obs if o.num_replicas > 1 and o.gpu_type in types]
    return [Split("P1", "all", train, test)] if train and test else []


def splits_p2(obs: Sequence[Observation]) -> list[Split]:
    single = [o for o in obs if o.num_replicas == 1]
    types = {o.gpu_type for o in single}
    out = []
    for warm, items in sorted(by_gpu_type(obs).items()):
        multi = [o for o in items if o.num_replicas > 1 and o.num_nodes == 1]
        if not multi or warm not in types:
            continue
        test = [o for o in obs if o.num_replicas > 1 and o.gpu_type != warm and o.gpu_type in types]
        if test:
            out.append(Split("P2", f"warm={warm}", single + multi, test, reference=warm))
    return out


def splits_p3(obs: Sequence[Observation]) -> list[Split]:
    out = []
    for gpu, items in sorted(by_gpu_type(obs).items()):
        train = [o for o in items if o.num_nodes == 1]
        test = [o for o in items if o.num_nodes > 1]
        if train and test and any(o.num_replicas > 1 for o in train):
            out.append(Split("P3", gpu, train, test))
    return out


def splits_p5(obs: Sequence[Observation]) -> list[Split]:
    single = [o for o in obs if o.num_replicas == 1 and o.accum_steps == 0]
    by_type = by_gpu_type(single)
    out = []
    for gpu, items in sorted(by_type.items()):
        sizes = sorted({o.local_bsz for o in items})
        others = [o for t, rows in by_type.items() if t != gpu for o in rows]
        if len(sizes) < 3 or not others:
            continue
        b0 = sizes[len(sizes) // 2]
        train = others + [o for o in items if o.local_bsz == b0]
        test = [o for o in items if o.local_bsz != b0]
        reference = max((t for t in by_type if t != gpu), key=lambda t: (len(by_type[t]), t))
        out.append(Split("P5", gpu, train, test, reference=reference))
    return out


# ====================================================================== predictors

Predictions = tuple[np.ndarray, np.ndarray, np.ndarray]


def _cols(obs: Sequence[Observation]) -> dict[str, np.ndarray]:
    return throughput_arrays(obs)


def _nan(n: int) -> Predictions:
    return np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)


def _quiet_fit(obs: Sequence[Observation]) -> ThroughputParams:
    return fit_throughput(list(obs))


def predict_model(model: JobModel, test: Sequence[Observation]) -> Predictions:
    """Median and 90% interval of every test observation from a JobModel (NaN for types it has not seen)."""
    pred, low, high = _nan(len(test))
    for gpu, rows in indices_by_gpu_type(test).items():
        if gpu not in model.gpu_types:
            continue
        cols = _cols([test[i] for i in rows])
        p = model.predict(gpu, cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"])
        lo, hi = p.interval(LEVEL)
        pred[rows], low[rows], high[rows] = p.step_time, lo, hi
    return pred, low, high


def predict_bayes(job: str, train: Sequence[Observation], test: Sequence[Observation], prior: ClusterPrior | None) -> Predictions:
    model = JobModel(job, init_batch_size=min(o.local_bsz for o in train), cluster_prior=prior)
    model.observe(train)
    return predict_model(model, test)


def predict_pollux(train: Sequence[Observation], test: Sequence[Observation]) -> Predictions:
    pred = np.full(len(test), np.nan)
    by_type = by_gpu_type(train)
    for gpu, rows in indices_by_gpu_type(test).items():
        if gpu not in by_type:
            continue
        theta = _quiet_fit(by_type[gpu]).as_array()
        cols = _cols([test[i] for i in rows])
        pred[rows] = _step_time(theta, cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"])
    return pred, np.full(len(test), np.nan), np.full(len(test), np.nan)


class _OneGPU:
    """1-GPU step times of a type: measured at a local batch where available, else its Pollux compute fit."""

    def __init__(self, obs: Sequence[Observation]) -> None:
        single = [o for o in obs if o.num_replicas == 1]
        self.ok = bool(single)
        if not self.ok:
            return
        self.theta = _quiet_fit(single).as_array()
        table: dict[int, list[float]] = {}
        for o in single:
            table.setdefault(o.local_bsz, []).append(o.step_time / (o.accum_steps + 1))
        self.measured = {b: float(np.exp(np.mean(np.log(v)))) for b, v in table.items()}

    def __call__(self, bsz: np.ndarray) -> np.ndarray:
        fit = self.theta[0] + self.theta[1] * bsz
        return np.array([self.measured.get(int(b), f) for b, f in zip(bsz, fit)])

    def nearest(self, bsz: np.ndarray) -> np.ndarray:
        """The measured batch size closest (in log) to each of ``bsz``."""
        sizes = np.array(sorted(self.measured), dtype=float)
        idx = np.abs(np.log(sizes)[None, :] - np.log(np.asarray(bsz, float))[:, None]).argmin(axis=1)
        return sizes[idx]


def predict_linear(train: Sequence[Observation], test: Sequence[Observation]) -> Predictions:
    pred = np.full(len(test), np.nan)
    by_type = by_gpu_type(train)
    for gpu, rows in indices_by_gpu_type(test).items():
        one = _OneGPU(by_type.get(gpu, []))
        if not one.ok:
            continue
        cols = _cols([test[i] for i in rows])
        pred[rows] = one(cols["local_bsz"]) * (cols["accum_steps"] + 1)
    return pred, np.full(len(test), np.nan), np.full(len(test), np.nan)


def predict_sia(train: Sequence[Observation], test: Sequence[Observation], reference: str | None) -> Predictions:
    """Sia's ratio estimator with ``reference`` as the profiled type A."""
    pred = np.full(len(test), np.nan)
    by_type = by_gpu_type(train)
    if reference is None or reference not in by_type:
        return pred, pred.copy(), pred.copy()
    ref_obs = by_type[reference]
    ref_one = _OneGPU(ref_obs)
    if not ref_one.ok:
        return pred, pred.copy(), pred.copy()
    ref_theta = _quiet_fit(ref_obs).as_array()
    measured: dict[tuple[int, int, int, int], list[float]] = {}
    for o in ref_obs:
        measured.setdefault((o.num_nodes, o.num_replicas, o.local_bsz, o.accum_steps), []).append(o.step_time)
    for gpu, rows in indices_by_gpu_type(test).items():
        one = _OneGPU(by_type.get(gpu, []))
        if not one.ok or gpu == reference:
            continue
        cols = _cols([test[i] for i in rows])
        fit_a = _step_time(ref_theta, cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"])
        t_a = np.array([
            float(np.exp(np.mean(np.log(measured[key])))) if (key := (int(n), int(r), int(b), int(a))) in measured else f
            for n, r, b, a, f in zip(cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"], fit_a)
        ])
        # the 1-GPU ratio at the same local batch, or at the nearest one measured on the target type (P5)
        at = one.nearest(cols["local_bsz"])
        pred[rows] = t_a * one(at) / ref_one(at)
    return pred, np.full(len(test), np.nan), np.full(len(test), np.nan)


# ====================================================================== one model


def _rows(model: str, split: Split, method: str, test: Sequence[Observation], pred: Predictions, stage: str | None = None) -> pd.DataFrame:
    cols = _cols(test)
    return pd.DataFrame({
        "model": model, "protocol": split.protocol, "split": split.stage, "stage": stage or split.stage, "method": method,
        "gpu_type": [o.gpu_type for o in test], "num_nodes": cols["num_nodes"].astype(int),
        "num_replicas": cols["num_replicas"].astype(int), "local_bsz": cols["local_bsz"].astype(int),
        "accum_steps": cols["accum_steps"].astype(int), "actual": cols["step_time"],
        "predicted": pred[0], "low": pred[1], "high": pred[2],
    })


def _static_split(model: str, split: Split, prior: ClusterPrior | None, methods: Sequence[str]) -> list[pd.DataFrame]:
    out = []
    for method in methods:
        if method == "bayes":
            pred = predict_bayes(model, split.train, split.test, prior)
        elif method == "bayes-noprior":
            pred = predict_bayes(model, split.train, split.test, None)
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
            seed: int, max_test: int) -> list[pd.DataFrame]:
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
        jm = JobModel(model, init_batch_size=min(o.local_bsz for o in order), cluster_prior=cluster_prior)
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
    p4_min_obs: int = 15,
    on_step: Callable[[str], None] | None = None,
) -> pd.DataFrame:
    """Every protocol on one model's observations; one row per (split, method, test observation)."""
    frames: list[pd.DataFrame] = []
    makers = {"P1": splits_p1, "P2": splits_p2, "P3": splits_p3, "P5": splits_p5}
    for protocol in protocols:
        if on_step:
            on_step(protocol)
        if protocol == "P4":
            for gpu, items in sorted(by_gpu_type(obs).items()):
                if len(items) < p4_min_obs:
                    continue
                for seed in range(seeds):
                    frames += _online(model, gpu, items, prior, methods, seed, p4_max_test)
            continue
        for split in makers[protocol](obs):
            frames += _static_split(model, split, prior, methods)
    if not frames:
        return pd.DataFrame(columns=_ROW_COLUMNS)
    return pd.concat(frames, ignore_index=True)[_ROW_COLUMNS]


# ====================================================================== summaries


def _group(protocol: str, stage: str) -> str:
    if protocol == "P4":
        return f"P4 {stage}" if stage == "next" else f"P4@{stage.removeprefix('k=')}"
    return protocol


_SUMMARY_COLUMNS = ["protocol", "method", "n", "median_ape", "mape", "p90_ape", "coverage90", "models", "units",
                    "median_ape_low", "median_ape_high", "coverage90_low", "coverage90_high"]


def _units(frame: pd.DataFrame) -> np.ndarray:
    """Independent unit of each row: the (model, GPU type) cell it measures; see :mod:`experiments.accuracy_intervals`."""
    return (frame["model"].astype(str) + "|" + frame["gpu_type"].astype(str)).to_numpy()


def summarize(rows: pd.DataFrame, *, resamples: int = RESAMPLES) -> pd.DataFrame:
    """Median APE, MAPE, p90 APE (percent) and 90%-interval coverage per protocol and method.

    With 95% cluster-bootstrap intervals of the median APE and the coverage (``*_low``/``*_high``,
    resampling the ``units`` independent (model, GPU type) cells; ``resamples=0`` skips them).
    """
    if rows.empty:
        return pd.DataFrame(columns=_SUMMARY_COLUMNS)
    frame = rows.dropna(subset=["predicted"]).copy()
    frame["group"] = [_group(p, s) for p, s in zip(frame["protocol"], frame["stage"])]
    frame["ape"] = np.abs(frame["predicted"] / frame["actual"] - 1.0) * 100.0
    frame["covered"] = (frame["low"] <= frame["actual"]) & (frame["actual"] <= frame["high"])
    frame["unit"] = _units(frame)
    out = []
    order = {g: i for i, g in enumerate(["P1", "P2", "P3", *[f"P4@{k}" for k in P4_STEPS], "P4 next", "P5"])}
    for (group, method), g in frame.groupby(["group", "method"], sort=False):
        has_interval = g["low"].notna().all()
        row = {
            "protocol": group, "method": method, "n": len(g),
            "median_ape": float(np.median(g["ape"])), "mape": float(np.mean(g["ape"])),
            "p90_ape": float(np.percentile(g["ape"], 90)),
            "coverage90": float(100.0 * g["covered"].mean()) if has_interval else math.nan,
            "models": g["model"].nunique(), "units": g["unit"].nunique(),
            "median_ape_low": math.nan, "median_ape_high": math.nan, "coverage90_low": math.nan, "coverage90_high": math.nan,
        }
        if resamples:
            ci = cluster_bootstrap(g["ape"].to_numpy(), g["covered"].to_numpy() if has_interval else None,
                                   g["unit"].to_numpy(), resamples=resamples)
            row.update(median_ape_low=ci.median_ape_low, median_ape_high=ci.median_ape_high,
                       coverage90_low=ci.coverage_low, coverage90_high=ci.coverage_high)
        out.append(row)
    summary = pd.DataFrame(out, columns=_SUMMARY_COLUMNS)
    summary["_p"] = summary["protocol"].map(lambda p: order.get(p, 99))
    summary["_m"] = summary["method"].map(lambda m: METHODS.index(m) if m in METHODS else 99)
    return summary.sort_values(["_p", "_m"]).drop(columns=["_p", "_m"]).reset_index(drop=True)


def per_model(rows: pd.DataFrame) -> pd.DataFrame:
    """Median APE (percent) per model × protocol for each method (a pivot)."""
    frame = rows.dropna(subset=["predicted"]).copy()
    if frame.empty:
        return frame
    frame["group"] = [_group(p, s) for p, s in zip(frame["protocol"], frame["stage"])]
    frame["ape"] = np.abs(frame["predicted"] / frame["actual"] - 1.0) * 100.0
    return frame.pivot_table(index=["model", "method"], columns="group", values="ape", aggfunc="median").round(1)


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def _fmt_interval(low: float, high: float) -> str:
    return "n/a" if not (math.isfinite(low) and math.isfinite(high)) else f"{low:.1f}–{high:.1f}"


def markdown(summary: pd.DataFrame, title: str, notes: Sequence[str] = (), by_model: pd.DataFrame | None = None,
             reference: pd.DataFrame | None = None, reference_by_model: pd.DataFrame | None = None) -> str:
    lines = [f"# {title}", "", "Step-time prediction error (APE, %) and coverage of 90% intervals (%, n/a: no interval). "
             "The 95% intervals resample the independent units (model × GPU type; `experiments/accuracy_intervals.py`): "
             "a target is met with confidence only when the whole interval lies on its side.", ""]
    lines += ["| protocol | method | n | units | median APE | 95% CI | MAPE | p90 APE | coverage 90% | 95% CI |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in summary.itertuples(index=False):
        lines.append(f"| {row.protocol} | {row.method} | {row.n} | {row.units} | {_fmt(row.median_ape)} | "
                     f"{_fmt_interval(row.median_ape_low, row.median_ape_high)} | {_fmt(row.mape)} | {_fmt(row.p90_ape)} | "
                     f"{_fmt(row.coverage90)} | {_fmt_interval(row.coverage90_low, row.coverage90_high)} |")
    if by_model is not None and not by_model.empty:
        cols = list(by_model.columns)
        lines += ["", "Median APE (%) per model:", "", "| model | method | " + " | ".join(cols) + " |",
                  "|---|---|" + "---:|" * len(cols)]
        for (model, method), values in by_model.iterrows():
            lines.append(f"| {model} | {method} | " + " | ".join(_fmt(v) for v in values) + " |")
    if reference is not None and not reference.empty:
        lines += ["", "What the data allow (not predictions; `experiments/accuracy_reference.py`): *capacity* is Pollux's "
                  "model fitted to all of a type's observations, in-sample; *repeat* is each repeated measurement against "
                  "the mean of its configuration's other measurements (a predictor's median APE cannot fall far below "
                  "repeat / √2).", "", "| reference | n | median APE | MAPE | p90 APE |", "|---|---:|---:|---:|---:|"]
        for row in reference.itertuples(index=False):
            lines.append(f"| {row.reference} | {row.n} | {_fmt(row.median_ape)} | {_fmt(row.mape)} | {_fmt(row.p90_ape)} |")
    if reference_by_model is not None and not reference_by_model.empty:
        cols = list(reference_by_model.columns)
        lines += ["", "Median APE (%) of each reference per model:", "", "| model | " + " | ".join(cols) + " |",
                  "|---|" + "---:|" * len(cols)]
        for model, values in reference_by_model.iterrows():
            lines.append(f"| {model} | " + " | ".join(_fmt(v) for v in values) + " |")
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


# ====================================================================== driver


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
    for key, value in settings.items():
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
) -> pd.DataFrame:
    """Evaluate every model of ``data_dir``; write rows, summary and markdown to ``out_dir``; return the summary."""
    started = time.time()
    data: Measurements = read_measurements(data_dir, default_gpu_type=default_gpu_type)
    names = sorted(data.models)
    if models:
        unknown = sorted(set(models) - set(names))
        if unknown:
            raise ValueError(f"unknown model(s) {unknown}; {data_dir} holds {names}")
        names = [n for n in names if n in models]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"data_dir": str(Path(data_dir).resolve()), "default_gpu_type": default_gpu_type, "protocols": list(protocols),
                "methods": list(methods), "seeds": int(seeds), "p4_max_test": int(p4_max_test), "goodput": goodput.__version__}
    done = _resume_state(out, settings, resume)
    _record_settings(out, settings, done)
    full_prior = ClusterPrior.from_observations(data.models) if len(data.models) > 1 else None
    frames = []
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} models"),
                  TimeElapsedColumn(), console=console, disable=not progress, transient=False) as bar:
        task = bar.add_task("accuracy", total=len(names))
        for name in names:
            path = out / f"rows-{name}.csv"
            if name in done:
                frames.append(pd.read_csv(path))
                bar.advance(task)
                continue
            prior = full_prior.exclude(name) if full_prior is not None else None
            if prior is not None and not len(prior):
                prior = None

            def step(protocol: str, name: str = name) -> None:
                bar.update(task, description=f"{name}: {protocol}")

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows = evaluate_model(name, data.models[name], prior, protocols=protocols, methods=methods, seeds=seeds,
                                      p4_max_test=p4_max_test, on_step=step)
            atomic_write_text(path, rows.to_csv(index=False))
            done.add(name)
            _record_settings(out, settings, done)
            frames.append(rows)
            bar.advance(task)
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=_ROW_COLUMNS)
    summary = summarize(rows)
    by_model = per_model(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_errors = reference_errors({n: data.models[n] for n in names})
    reference, ref_by_model = summarize_reference(ref_errors), reference_by_model(ref_errors)
    notes = list(data.notes) + [
        f"bayes: cross-job prior from the other {len(data.models) - 1} model(s) of the directory (leave-one-model-out); "
        "bayes-noprior: without it" if full_prior is not None else "bayes: a single model, no cross-job prior",
        f"P4: {seeds} random order(s) per type; at most {p4_max_test} of the rest evaluated per checkpoint",
        f"{len(names)} model(s), {sum(len(data.models[n]) for n in names)} observations, {time.time() - started:.0f} s",
    ]
    title = f"goodput accuracy — {Path(data_dir).resolve().name} ({data.kind})"
    text = markdown(summary, title, notes, by_model, reference, ref_by_model)
    atomic_write_text(out / "summary.csv", summary.to_csv(index=False))
    atomic_write_text(out / "reference.csv", reference.to_csv(index=False))
    atomic_write_text(out / "accuracy.md", text)
    meta = {"data_dir": str(data_dir), "kind": data.kind, "models": names, "protocols": list(protocols),
            "methods": list(methods), "seeds": seeds, "p4_max_test": p4_max_test, "seconds": time.time() - started}
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
        tracking.log_frame_artifact(rows, "rows.csv")


def build_parser() -> argparse.ArgumentParser:
    from goodput.cli.accuracy import configure

    return configure(argparse.ArgumentParser(prog="python -m experiments.accuracy", description=__doc__,
                                             formatter_class=argparse.RawDescriptionHelpFormatter))


def _subset(text: str, allowed: Sequence[str], what: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise SystemExit(f"unknown {what} {bad}; choose from {', '.join(allowed)}")
    return values


def run_from_args(args: argparse.Namespace) -> int:
    from goodput.cli._common import console

    out = console()
    summary = run(
        args.data_dir, args.out,
        models=[m.strip() for m in args.models.split(",")] if args.models else None,
        protocols=_subset(args.protocols, PROTOCOLS, "protocols"),
        methods=_subset(args.methods, METHODS, "methods"),
        seeds=args.seeds, p4_max_test=args.p4_max_test, default_gpu_type=args.gpu_type, resume=args.resume,
        mlflow=not args.no_mlflow, progress=not args.no_progress, console=out,
    )
    text = (Path(args.out) / "accuracy.md").read_text(encoding="utf-8")
    print(text)
    print(f"saved {Path(args.out) / 'accuracy.md'} and {Path(args.out) / 'summary.csv'} ({len(summary)} rows)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
