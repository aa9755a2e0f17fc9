"""The accuracy harness's report: per-protocol figures with cluster-bootstrap intervals, per-model medians, markdown.

:func:`summarize` turns the harness's rows (one per split, method and test
observation: ``actual`` and ``predicted`` step times in seconds, the 90%
interval's ``low`` and ``high``) into the median APE, MAPE and p90 APE (percent)
and the coverage of the 90% intervals (percent) per protocol and method, with
95% intervals that resample the independent (model, GPU type) cells
(:mod:`experiments.accuracy_intervals`). :func:`per_model` pivots the median APE
per model; :func:`markdown` renders both with the data's reference errors
(:mod:`experiments.accuracy_reference`).

>>> import pandas as pd
>>> rows = pd.DataFrame({"model": "m", "protocol": "P1", "stage": "all", "method": "bayes", "gpu_type": ["t4", "v100"],
...                      "actual": [1.0, 2.0], "predicted": [1.1, 1.8], "low": [0.9, 1.9], "high": [1.2, 2.1]})
>>> summary = summarize(rows, resamples=0)
>>> summary[["protocol", "method", "n", "median_ape", "coverage90"]].round(1).to_dict("records")
[{'protocol': 'P1', 'method': 'bayes', 'n': 2, 'median_ape': 10.0, 'coverage90': 100.0}]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from experiments.accuracy_intervals import RESAMPLES, cluster_bootstrap, paired_median_difference
from experiments.accuracy_args import METHODS

__all__ = ["P4_STEPS", "SUMMARY_COLUMNS", "summarize", "per_model", "evidence_check", "markdown"]

P4_STEPS = (5, 10, 20, 40)  # observations revealed before P4's checkpoints


def _group(protocol: str, stage: str) -> str:
    if protocol == "P4":
        return f"P4 {stage}" if stage == "next" else f"P4@{stage.removeprefix('k=')}"
    return protocol


SUMMARY_COLUMNS = ["protocol", "method", "n", "median_ape", "mape", "p90_ape", "coverage90", "models", "units",
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
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
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
    summary = pd.DataFrame(out, columns=SUMMARY_COLUMNS)
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


EVIDENCE_KEY = ["model", "method", "gpu_type", "num_nodes", "num_replicas", "local_bsz", "accum_steps", "actual"]


def evidence_check(rows: pd.DataFrame, *, resamples: int = RESAMPLES, seed: int = 0) -> pd.DataFrame:
    """P2 against P1 on the same test rows, per model and method (issue 34: one type's multi-GPU
    observations should not make the other types' predictions worse).

    Each P2 row (a type other than its split's warm one) is matched to the P1 row of the same model,
    method, type, configuration and measurement; ``P1`` and ``P2`` are the median APE (percent) over
    the matched rows, ``rows`` their count and ``holds`` whether ``P2 <= P1``. ``low`` and ``high``
    bound ``P2 - P1`` (percentage points) at 95%, resampling the model's test types (its independent
    units; :func:`experiments.accuracy_intervals.paired_median_difference`; NaN with fewer than 3
    types or ``resamples=0``); ``worse`` is ``low > 0``: P2 worse beyond the interval. Empty without P2 rows.
    """
    columns = ["model", "method", "rows", "P1", "P2", "holds", "low", "high", "worse"]
    frame = rows.dropna(subset=["predicted"])
    p1, p2 = frame[frame["protocol"] == "P1"], frame[frame["protocol"] == "P2"]
    if p1.empty or p2.empty:
        return pd.DataFrame(columns=columns)
    p1 = p1.assign(ape_p1=np.abs(p1["predicted"] / p1["actual"] - 1.0) * 100.0)[EVIDENCE_KEY + ["ape_p1"]]
    p1 = p1.drop_duplicates(subset=EVIDENCE_KEY)
    matched = p2.assign(ape_p2=np.abs(p2["predicted"] / p2["actual"] - 1.0) * 100.0).merge(p1, on=EVIDENCE_KEY)
    out = []
    for (model, method), group in matched.groupby(["model", "method"]):
        low = high = math.nan
        if resamples > 0:
            low, high = paired_median_difference(group["ape_p1"].to_numpy(), group["ape_p2"].to_numpy(),
                                                 group["gpu_type"].to_numpy(), resamples=resamples, seed=seed)
        first, second = float(group["ape_p1"].median()), float(group["ape_p2"].median())
        out.append({"model": model, "method": method, "rows": len(group), "P1": first, "P2": second,
                    "holds": second <= first, "low": low, "high": high, "worse": bool(low > 0.0)})
    return pd.DataFrame(out, columns=columns)


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def _fmt_interval(low: float, high: float) -> str:
    return "n/a" if not (math.isfinite(low) and math.isfinite(high)) else f"{low:.1f}–{high:.1f}"


def _fmt_difference(low: float, high: float) -> str:
    return "n/a" if not (math.isfinite(low) and math.isfinite(high)) else f"{low:+.1f} to {high:+.1f}"


def markdown(summary: pd.DataFrame, title: str, notes: Sequence[str] = (), by_model: pd.DataFrame | None = None,
             reference: pd.DataFrame | None = None, reference_by_model: pd.DataFrame | None = None,
             evidence: pd.DataFrame | None = None) -> str:
    """The harness's markdown report: ``summary`` (from :func:`summarize`) as a table with its intervals.

    Then, where given, the per-model medians (``by_model``, from :func:`per_model`), P2 against P1 on
    the same rows (``evidence``, from :func:`evidence_check`), the data's reference errors and their
    per-model medians (:mod:`experiments.accuracy_reference`), and ``notes``.
    """
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
    if evidence is not None and not evidence.empty:
        methods = sorted(set(evidence["method"]), key=lambda m: (m != "bayes", m))  # bayes first, one count each
        counts = "; ".join(f"{int(g['holds'].sum())} of {len(g)} model(s) of {m}, worse beyond the interval for "
                           f"{int(g['worse'].sum())}" for m in methods for g in [evidence[evidence["method"] == m]])
        lines += ["", "P2 against P1 on the same test rows (median APE, %): one type's multi-GPU observations should not "
                  f"make the other types' predictions worse. Holds for {counts} (the 95% interval of P2 − P1 resamples "
                  "the model's test types).", "",
                  "| model | method | rows | P1 | P2 | P2 − P1, 95% CI | P2 ≤ P1 |", "|---|---|---:|---:|---:|---:|---|"]
        for row in evidence.itertuples(index=False):
            verdict = "yes" if row.holds else ("no, beyond the interval" if row.worse else "no")
            lines.append(f"| {row.model} | {row.method} | {row.rows} | {_fmt(row.P1)} | {_fmt(row.P2)} | "
                         f"{_fmt_difference(row.low, row.high)} | {verdict} |")
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
