"""What a directory of measurements allows: the error floors the protocols' figures sit above.

Two references, computed on the same observations the harness reads
(:func:`experiments.datasets.read_measurements`), reported next to every
``goodput accuracy`` run so its figures can be read against them:

* **capacity**: Pollux's throughput model (Qiao et al., OSDI'21, Eq. 8–9)
  fitted per model and GPU type to *all* of that type's observations, and its
  in-sample error on the 1-GPU, the multi-GPU and the multi-node
  configurations. This is what the parametric form can express, not a prediction:
  the issue that asks for the harness quotes 5% on its held-out data. A model
  with a residual GP can go below it once it has seen enough of a type.
* **repeat**: configurations measured more than once (the same GPU type,
  nodes, replicas, local batch and accumulation steps). Each measurement is
  compared with the geometric mean of the *other* measurements of its
  configuration: the error of a perfect lookup of everything else measured.
  With independent log-normal noise of std σ and pairs of repeats, its median
  APE is about 0.95σ, √2 times that against the true mean (0.67σ), so no
  predictor's median APE on such data can fall far below ``repeat / √2``.

The numeric core (:func:`capacity_errors`, :func:`repeat_errors`,
:func:`reference_errors`) returns APEs in percent; :func:`summarize_reference`
pools them per reference and :func:`reference_by_model` gives each model's
median (:func:`reference_table` does both steps for the pooled table).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from goodput.observations import Observation, by_gpu_type
from goodput.throughput import _step_time, fit_throughput, throughput_arrays

__all__ = ["capacity_errors", "repeat_errors", "reference_errors", "summarize_reference", "reference_by_model",
           "reference_table", "REFERENCES", "REFERENCE_COLUMNS"]

REFERENCE_COLUMNS = ["reference", "n", "median_ape", "mape", "p90_ape", "models"]
REFERENCES = ("capacity 1-GPU", "capacity multi-GPU", "capacity multi-node", "repeat")
MIN_CAPACITY_OBS = 3  # a (model, type) with fewer observations is not fitted


def capacity_errors(obs: Sequence[Observation]) -> pd.DataFrame:
    """In-sample APE (%) of Pollux's model fitted to all of each type's observations of one model.

    Returns one row per observation (``gpu_type``, ``num_nodes``,
    ``num_replicas``, ``ape``); types with fewer than :data:`MIN_CAPACITY_OBS`
    observations contribute nothing.
    """
    frames = []
    for gpu, items in sorted(by_gpu_type(obs).items()):
        if len(items) < MIN_CAPACITY_OBS:
            continue
        cols = throughput_arrays(items)
        theta = fit_throughput(items).as_array()
        pred = _step_time(theta, cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"])
        ape = np.abs(pred / cols["step_time"] - 1.0) * 100.0
        frames.append(pd.DataFrame({"gpu_type": gpu, "num_nodes": cols["num_nodes"].astype(int),
                                    "num_replicas": cols["num_replicas"].astype(int), "ape": ape}))
    if not frames:
        return pd.DataFrame(columns=["gpu_type", "num_nodes", "num_replicas", "ape"])
    return pd.concat(frames, ignore_index=True)


def repeat_errors(obs: Sequence[Observation]) -> np.ndarray:
    """APE (%) of every repeated measurement against the geometric mean of its configuration's other measurements."""
    groups: dict[tuple[str, int, int, int, int], list[float]] = defaultdict(list)
    for o in obs:
        groups[(o.gpu_type, o.num_nodes, o.num_replicas, o.local_bsz, o.accum_steps)].append(o.step_time)
    out = []
    for times in groups.values():
        if len(times) < 2:
            continue
        logs = np.log(np.asarray(times, dtype=float))
        others = (logs.sum() - logs) / (len(logs) - 1)  # leave-one-out mean of the logs
        out.append(np.abs(np.exp(others - logs) - 1.0) * 100.0)
    return np.concatenate(out) if out else np.empty(0)


def _summary(name: str, ape: np.ndarray, models: int) -> dict[str, float | int | str]:
    if len(ape) == 0:
        return {"reference": name, "n": 0, "median_ape": math.nan, "mape": math.nan, "p90_ape": math.nan, "models": 0}
    return {"reference": name, "n": int(len(ape)), "median_ape": float(np.median(ape)), "mape": float(np.mean(ape)),
            "p90_ape": float(np.percentile(ape, 90)), "models": models}


def reference_errors(models: Mapping[str, Sequence[Observation]]) -> pd.DataFrame:
    """Every reference's APEs (%), one row each: ``model``, ``reference`` (see :func:`reference_table`), ``ape``."""
    frames = []
    for name, obs in models.items():
        cap = capacity_errors(obs)
        for reference, mask in (("capacity 1-GPU", cap["num_replicas"] == 1), ("capacity multi-GPU", cap["num_replicas"] > 1),
                                ("capacity multi-node", cap["num_nodes"] > 1)):
            frames.append(pd.DataFrame({"model": name, "reference": reference, "ape": cap.loc[mask, "ape"].to_numpy(float)}))
        frames.append(pd.DataFrame({"model": name, "reference": "repeat", "ape": repeat_errors(obs)}))
    if not frames:
        return pd.DataFrame({"model": pd.Series(dtype=str), "reference": pd.Series(dtype=str), "ape": pd.Series(dtype=float)})
    return pd.concat(frames, ignore_index=True)


def summarize_reference(errors: pd.DataFrame) -> pd.DataFrame:
    """Median APE, MAPE and p90 APE (%) of each reference in ``errors`` (:func:`reference_errors`), pooled over models."""
    rows = []
    for name in REFERENCES:
        ape = errors.loc[errors["reference"] == name, ["model", "ape"]]
        rows.append(_summary(name, ape["ape"].to_numpy(float), ape["model"].nunique()))
    return pd.DataFrame(rows, columns=REFERENCE_COLUMNS)


def reference_by_model(errors: pd.DataFrame) -> pd.DataFrame:
    """Median APE (%) per model (rows) and reference (columns) of ``errors``; NaN where the data cannot support one."""
    table = errors.pivot_table(index="model", columns="reference", values="ape", aggfunc="median")
    return table.reindex(columns=list(REFERENCES)).round(1)


def reference_table(models: Mapping[str, Sequence[Observation]]) -> pd.DataFrame:
    """Median APE, MAPE and p90 APE (%) of each reference, pooled over ``models`` (name → observations).

    Rows: ``capacity 1-GPU``, ``capacity multi-GPU``, ``capacity multi-node`` and ``repeat`` (see the
    module docstring); a reference the data cannot support has ``n = 0`` and NaN figures.
    """
    return summarize_reference(reference_errors(models))
