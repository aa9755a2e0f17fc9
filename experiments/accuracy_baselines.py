"""The estimators our JobModel is compared with in the accuracy harness: linear scaling, Sia's ratio, a Pollux fit.

Each takes the training observations and the test observations of one split
(:mod:`experiments.accuracy_protocols`) and returns :data:`Predictions`: the predicted
step time of every test observation in seconds, and a 90% interval's low and
high ends (NaN: these estimators give no interval). A test row whose GPU type
the estimator cannot speak for (no training data there) is NaN too, and the
harness leaves it out of that method's figures.

* :func:`predict_pollux`: Pollux's model (Qiao et al., OSDI'21, eq. 11–12)
  fitted per type to that type's training rows.
* :func:`predict_linear`: linear scaling from 1-GPU profiles: an n-GPU step
  takes as long as a 1-GPU step at the same local batch (Sia's "linear"
  baseline).
* :func:`predict_sia`: Sia's ratio estimator (Jayaram Subramanya et al.,
  SOSP'23), ``T_B(config) = T_A(config) × T_B(1 GPU) / T_A(1 GPU)`` at the same
  local batch, with A the profiled reference type.

>>> from goodput.observations import Observation
>>> train = [Observation("j", "a", 1, 1, 32, step_time=0.2), Observation("j", "a", 1, 2, 32, step_time=0.3),
...          Observation("j", "b", 1, 1, 32, step_time=0.1)]
>>> test = [Observation("j", "b", 1, 2, 32, step_time=0.16)]
>>> round(float(predict_linear(train, test)[0][0]), 6)  # b's 1-GPU step
0.1
>>> round(float(predict_sia(train, test, reference="a")[0][0]), 6)  # a's 2-GPU step × 0.1 / 0.2
0.15
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from goodput.observations import Observation, by_gpu_type, indices_by_gpu_type
from goodput.throughput import ThroughputParams, fit_throughput, predict_step_time, throughput_arrays

__all__ = ["Predictions", "nan_predictions", "predict_pollux", "predict_linear", "predict_sia"]

Predictions = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Predicted step time (seconds) of each test observation, and its 90% interval's low and high ends."""


def nan_predictions(n: int) -> Predictions:
    """``n`` predictions that say nothing (NaN step time and interval)."""
    return np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)


def _fit(obs: Sequence[Observation]) -> ThroughputParams:
    return fit_throughput(list(obs))


def _step_times(params: ThroughputParams, test: Sequence[Observation]) -> np.ndarray:
    cols = throughput_arrays(test)
    return predict_step_time(params, cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"])


def predict_pollux(train: Sequence[Observation], test: Sequence[Observation]) -> Predictions:
    """Pollux's model fitted to each type's training rows, predicting that type's test rows."""
    pred, low, high = nan_predictions(len(test))
    by_type = by_gpu_type(train)
    for gpu, rows in indices_by_gpu_type(test).items():
        if gpu in by_type:
            pred[rows] = _step_times(_fit(by_type[gpu]), [test[i] for i in rows])
    return pred, low, high


class _OneGPU:
    """1-GPU step times of a type (seconds): measured at a local batch where available, else its Pollux compute fit."""

    def __init__(self, obs: Sequence[Observation]) -> None:
        single = [o for o in obs if o.num_replicas == 1]
        self.ok = bool(single)
        if not self.ok:
            return
        self.theta = _fit(single).as_array()
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
    """Linear scaling: a test row's step takes its type's 1-GPU step at the same local batch (× micro-batches)."""
    pred, low, high = nan_predictions(len(test))
    by_type = by_gpu_type(train)
    for gpu, rows in indices_by_gpu_type(test).items():
        one = _OneGPU(by_type.get(gpu, []))
        if not one.ok:
            continue
        cols = throughput_arrays([test[i] for i in rows])
        pred[rows] = one(cols["local_bsz"]) * (cols["accum_steps"] + 1)
    return pred, low, high


def predict_sia(train: Sequence[Observation], test: Sequence[Observation], reference: str | None) -> Predictions:
    """Sia's ratio estimator with ``reference`` as the profiled type A.

    ``T_A(config)`` is A's measured step (geometric mean of repeats) where A has
    the configuration, else A's Pollux fit; the 1-GPU ratio is taken at the same
    local batch, or at the batch size measured on the target type closest to it (P5).
    """
    pred, low, high = nan_predictions(len(test))
    by_type = by_gpu_type(train)
    if reference is None or reference not in by_type:
        return pred, low, high
    ref_obs = by_type[reference]
    ref_one = _OneGPU(ref_obs)
    if not ref_one.ok:
        return pred, low, high
    ref_params = _fit(ref_obs)
    measured: dict[tuple[int, int, int, int], list[float]] = {}
    for o in ref_obs:
        measured.setdefault((o.num_nodes, o.num_replicas, o.local_bsz, o.accum_steps), []).append(o.step_time)
    for gpu, rows in indices_by_gpu_type(test).items():
        one = _OneGPU(by_type.get(gpu, []))
        if not one.ok or gpu == reference:
            continue
        subset = [test[i] for i in rows]
        cols = throughput_arrays(subset)
        fit_a = _step_times(ref_params, subset)
        t_a = np.array([
            float(np.exp(np.mean(np.log(measured[key])))) if (key := (int(n), int(r), int(b), int(a))) in measured else f
            for n, r, b, a, f in zip(cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"], fit_a)
        ])
        at = one.nearest(cols["local_bsz"])
        pred[rows] = t_a * one(at) / ref_one(at)
    return pred, low, high
