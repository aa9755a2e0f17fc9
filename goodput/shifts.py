"""Level shifts in time: a job whose every step became slower (or faster) from some moment on.

A job's speed can change while it trains: its first epoch reads cold data, a neighbour starts sharing
its node, a training phase unfreezes layers, the profile ran without the data loader the training loop
has. The GP of :mod:`goodput.posterior` takes its observations as exchangeable, so the steps before the
change would hold its predictions near the old speed (60 steps, then 30 at 1.5×: the model predicted
1.13×). Here the change is a model, not a rule: the steps measured before a time τ may share an offset
δ of their log step time,

    y = f + δ·b_τ + ε,    b_τ = 1[timestamp < τ],    δ ~ N(0, :data:`SHIFT_STD`²),

which adds ``SHIFT_STD² b bᵀ`` to the GP's covariance ``C = L Lᵀ`` (its residual, linear part and
noise). By the matrix determinant lemma and Sherman–Morrison, with ``a = bᵀ C⁻¹ b`` and
``c = bᵀ α`` (``α = C⁻¹ y``), its Bayes factor against no shift is

    log B_τ = −½ log(1 + s² a) + ½ s² c² / (1 + s² a),    s = SHIFT_STD,

and δ's posterior given τ is ``N(s² c / (1 + s² a), s² / (1 + s² a))``. τ is uniform over the
boundaries between the window's distinct timestamps that leave :data:`MIN_REGIME_POINTS` steps on each
side and a configuration measured on both (else a shift and what the configurations differ by cannot be
told apart); a shift is accepted when its posterior odds, :data:`SHIFT_PRIOR_ODDS` times the mean of
``B_τ`` over them, exceed 1 (Bayesian model comparison, Kass & Raftery, *JASA* 90, 1995; the single
change point as in Smith, *Biometrika* 62, 1975), and each step's offset is then δ's posterior mean
averaged over τ's posterior (:meth:`LevelShift.log_offset`). All the ``a`` come from one pass over
``L⁻¹``'s columns in time order (a running sum), so the scan costs O(n²) after a triangular inverse.
:meth:`goodput.posterior.JobPosterior.level_shift` reads the steps with at least Pollux's tails
(ν ≤ 6), so that a few stalled steps are outliers, not a change.

:meth:`goodput.model.JobModel.refit` then rescales the older steps to the current speed and refits, so
the parametric fit, the GP's hyperparameters and its posterior all read one speed, the current one;
the job's stored observations stay as measured, and each refit looks again. Online, three or more steps
surprising together call for that refit (:meth:`goodput.model.JobModel.observe`).

Example::

    model = JobModel("bert", init_batch_size=12, cluster_prior=prior).observe(timestamped_steps)
    model.level_shifts_found      # (LevelShift(at=1795284883.0, factor=0.67, log_odds=34.3),): it became 1.5x slower
"""

from __future__ import annotations

import copy
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.linalg
from scipy.special import logsumexp

from .observations import MAX_STEP_TIME, MIN_STEP_TIME, Observation

__all__ = ["LevelShift", "find_level_shift", "SHIFT_STD", "SHIFT_PRIOR_ODDS", "MIN_REGIME_POINTS", "at_current_speed"]

SHIFT_STD = 0.25  # prior std of a shift's log factor δ: a change of e^±0.25 (×0.78–1.28) is typical
SHIFT_PRIOR_ODDS = 0.05  # prior odds that the GP's window holds a change of speed
MIN_REGIME_POINTS = 3  # steps each side of a change: one stalled step is the noise's to explain, not a change


@dataclass(frozen=True)
class LevelShift:
    """A change of the job's speed: steps measured before ``at`` (a timestamp, seconds: the most probable moment)
    took ``factor`` times the current speed's step time (``factor`` = e^δ, δ's posterior mean); ``log_odds``: the
    posterior log odds of a change against none. Where the steps leave the moment open (steps between two
    candidates that say nothing of the speed: configurations measured once), a step's offset is averaged over
    the moments' posterior, :meth:`log_offset`: ``moments`` (timestamps), their posterior ``probabilities``
    given a change, and δ's posterior mean at each (``log_factors``); by default the one moment ``at``."""

    at: float
    factor: float
    log_odds: float
    moments: tuple[float, ...] = ()
    probabilities: tuple[float, ...] = ()
    log_factors: tuple[float, ...] = ()

    def log_offset(self, timestamp: float) -> float:
        """E[δ · 1(timestamp < τ)] over the moment τ's posterior: what a step measured then adds to log step time."""
        if not self.moments:
            return math.log(self.factor) if timestamp < self.at else 0.0
        return float(sum(p * d for m, p, d in zip(self.moments, self.probabilities, self.log_factors) if timestamp < m))

    def to_dict(self) -> dict[str, float]:
        return {"at": self.at, "factor": round(self.factor, 4), "log_odds": round(self.log_odds, 2)}


def find_level_shift(chol: np.ndarray, alpha: np.ndarray, stamps: np.ndarray, configs: Sequence[Hashable],
                     at: float | None = None) -> LevelShift | None:
    """The most probable change of speed among a GP's training points, or ``None`` (module docstring).

    ``chol``: the lower Cholesky factor of their covariance (noise included), ``alpha`` = C⁻¹ y; ``stamps``:
    each point's timestamp (seconds; any NaN: ``None``); ``configs``: each point's configuration (hashable).
    ``at``: the change at that moment, whatever its odds (the rest of one found before and read only in part).
    """
    stamps = np.asarray(stamps, dtype=float)
    n = stamps.size
    if n < 2 * MIN_REGIME_POINTS or not np.all(np.isfinite(stamps)):
        return None
    order = np.argsort(stamps, kind="stable")
    sorted_stamps = stamps[order]
    # boundary j: the first j points in time order are before the change (valid where the stamps differ there)
    j = np.arange(MIN_REGIME_POINTS, n - MIN_REGIME_POINTS + 1)
    j = j[(sorted_stamps[j - 1] < sorted_stamps[j]) & (True if at is None else sorted_stamps[j] == at)]
    if j.size:
        # a configuration measured on both sides: its first timestamp before the boundary, its last at or after it
        first: dict[Hashable, float] = {}
        last: dict[Hashable, float] = {}
        for stamp, config in zip(stamps.tolist(), configs):
            first[config] = min(first.get(config, math.inf), stamp)
            last[config] = max(last.get(config, -math.inf), stamp)
        spans = np.array([(first[c], last[c]) for c in first])
        bound = sorted_stamps[j][:, None]
        j = j[np.any((spans[None, :, 0] < bound) & (spans[None, :, 1] >= bound), axis=1)]
    if not j.size:
        return None
    inverse_l, info = scipy.linalg.lapack.dtrtri(chol, lower=1)
    if info != 0:
        return None
    running = np.cumsum(inverse_l[:, order], axis=1)  # L⁻¹ b for the first k points in time order (column k − 1)
    a = np.sum(running[:, j - 1] ** 2, axis=0)  # bᵀ C⁻¹ b
    c = np.cumsum(np.asarray(alpha, dtype=float)[order])[j - 1]  # bᵀ α
    s2 = SHIFT_STD**2
    log_bayes = -0.5 * np.log1p(s2 * a) + 0.5 * s2 * c**2 / (1.0 + s2 * a)
    log_odds = math.log(SHIFT_PRIOR_ODDS) + float(logsumexp(log_bayes)) - math.log(j.size)
    if not math.isfinite(log_odds) or (at is None and log_odds <= 0.0):
        return None
    best = int(np.argmax(log_bayes))
    delta = s2 * c / (1.0 + s2 * a)  # δ's posterior mean at each moment
    probabilities = np.exp(log_bayes - logsumexp(log_bayes))
    return LevelShift(float(sorted_stamps[j[best]]), float(math.exp(probabilities @ delta)), log_odds,
                      tuple(sorted_stamps[j].tolist()), tuple(probabilities.tolist()), tuple(delta.tolist()))


def at_current_speed(observations: Mapping[str, Sequence[Observation]], shift: LevelShift) -> dict[str, list[Observation]]:
    """The observations with those measured before the shift rescaled to the speed after it (their step, sync
    and spread divided by e^:meth:`LevelShift.log_offset`; one the rescaling would make invalid, e.g. shorter
    than a step can be, as it is)."""
    def rescaled(o: Observation) -> Observation:
        offset = 0.0 if o.timestamp is None else shift.log_offset(o.timestamp)
        step_time = o.step_time * math.exp(-offset)
        if offset == 0.0 or not MIN_STEP_TIME <= step_time <= MAX_STEP_TIME:
            return o
        # a copy with the times scaled: every other check of the validated original holds for it (sync ≤ step scales
        # with both), and 1000 steps re-validated had cost 170 ms of a refit
        out = copy.copy(o)
        for name in ("step_time", "sync_time", "step_time_std"):
            value = getattr(o, name)
            if value is not None:
                object.__setattr__(out, name, value * math.exp(-offset))
        return out
    return {gpu: [rescaled(o) for o in items] for gpu, items in observations.items()}
