"""Statistical efficiency from the gradient noise scale.

Pollux (Qiao et al., OSDI'21, §3.1) measures how much progress one sample makes
at batch size M relative to the job's reference batch M0::

    φ    = M0 · grad_var / grad_sqr           gradient noise scale, samples
    E(M) = (φ + M0) / (φ + M)                 in (0, 1] for M >= M0

with ``grad_sqr`` = |g|², the squared norm of the true gradient, and
``grad_var`` = tr(Σ)/M0, the gradient variance at the reference batch
(McCandlish et al., "An Empirical Model of Large-Batch Training", 2018, call
B_simple = tr(Σ)/|g|² = φ).

Neither quantity is observable directly; :class:`GradientNoiseTracker` turns
squared norms of gradients at two batch sizes into unbiased estimates. With
|G_b|² the squared norm of a gradient averaged over b samples,
E|G_b|² = |g|² + tr(Σ)/b, so two batch sizes b < B give (McCandlish et al.,
Appendix A.1)::

    |g|²  ≈ (B·|G_B|² − b·|G_b|²) / (B − b)
    tr(Σ) ≈ (|G_b|² − |G_B|²) / (1/b − 1/B)

Pollux's per-replica form is the special case in which the n micro-batch
gradients of one step (replicas × accumulation steps, b samples each) give the
small batch (their mean squared norm) and their average gives the large one
(B = n·b). Single estimates are noisy, so both are smoothed with an
exponential moving average whose bias towards its zero start is corrected, as
in Adam (Kingma & Ba, 2015).

Example::

    >>> round(efficiency(grad_sqr=1.0, grad_var=3.0, init_batch_size=128, batch_size=512), 4)
    0.5714
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import ValidationError
from .validation import check_float, check_int

__all__ = ["efficiency", "noise_scale", "describe_noise_scale", "noise_scale_resolved", "two_batch_estimates", "GradientNoiseTracker", "GRAD_SQR_FLOOR",
           "check_batch_sizes"]

GRAD_SQR_FLOOR = 1e-30  # |g|² estimates at or below 0 are stored as this: the gradient's mean is not resolved
_FLOAT_TINY = float(np.finfo(float).tiny)  # smallest normal float: a quotient below it has lost precision


def noise_scale(grad_sqr: float, grad_var: float, init_batch_size: float) -> float:
    """φ = M0 · grad_var / grad_sqr, the gradient noise scale in samples."""
    grad_sqr = check_float("grad_sqr", grad_sqr, positive=True)
    grad_var = check_float("grad_var", grad_var, nonnegative=True)
    init_batch_size = check_float("init_batch_size", init_batch_size, positive=True)
    return init_batch_size * grad_var / grad_sqr


def noise_scale_resolved(grad_sqr: float) -> bool:
    """Whether a (smoothed, floored) |g|² estimate tells the gradient's mean from its noise: above :data:`GRAD_SQR_FLOOR`."""
    return grad_sqr > GRAD_SQR_FLOOR


def describe_noise_scale(grad_sqr: float, grad_var: float, init_batch_size: float) -> str:
    """φ for people: its value in samples, or ``"unresolved (|g|² ≤ 0)"`` where |g|² sits at :data:`GRAD_SQR_FLOOR`.

    A smoothed |g|² estimate at or below 0 means the samples so far could not
    tell the gradient's mean from its noise: φ is then larger than any figure
    the floor would print (``1e+31``...), and :func:`efficiency` is 1 at every
    batch size until later estimates resolve it.

    >>> describe_noise_scale(0.5, 2.0, 64)
    '256'
    >>> describe_noise_scale(GRAD_SQR_FLOOR, 2.0, 64)
    'unresolved (|g|² ≤ 0)'
    """
    if not noise_scale_resolved(grad_sqr):
        return "unresolved (|g|² ≤ 0)"
    return f"{noise_scale(grad_sqr, grad_var, init_batch_size):.3g}"


def efficiency(grad_sqr: float, grad_var: float, init_batch_size: float, batch_size: Any) -> Any:
    """Statistical efficiency E(M) = (φ + M0)/(φ + M) of batch size M (Pollux, OSDI'21 eq. 4).

    Args:
        grad_sqr: |g|², > 0.
        grad_var: tr(Σ)/M0, >= 0.
        init_batch_size: the reference batch size M0, samples.
        batch_size: M, samples (>= M0); a scalar or an array.

    Returns:
        A float in (0, 1] for a scalar ``batch_size``, else an array of them (0 only where the
        true value lies below the smallest float, which takes M/M0 beyond 1e308).

    Computed as ``(v + s) / (v + (M/M0)·s)`` with ``v, s = grad_var, grad_sqr`` divided by
    the larger of them: Pollux's ratio without forming φ, which overflows for extreme
    ``grad_var / grad_sqr`` (``efficiency(1e-30, 1e290, 128, 512)`` is 1, not NaN).
    """
    grad_sqr = check_float("grad_sqr", grad_sqr, positive=True)
    grad_var = check_float("grad_var", grad_var, nonnegative=True)
    m0 = check_float("init_batch_size", init_batch_size, positive=True)
    m = check_batch_sizes(batch_size, m0)
    scale = max(grad_sqr, grad_var)
    var, sqr = grad_var / scale, grad_sqr / scale  # in [0, 1], the larger one exactly 1
    result = (var + sqr) / (var + _batch_term(m, m0, grad_sqr, scale))
    return float(result) if result.ndim == 0 else result


def check_batch_sizes(batch_size: Any, init_batch_size: float) -> np.ndarray:
    """``batch_size`` (a number or an array of them, samples) as a float array, each finite and at least
    ``init_batch_size``; else :class:`ValidationError` naming ``batch_size``."""
    if np.asarray(batch_size).dtype.kind not in "iuf":  # not bools, strings or objects
        raise ValidationError("batch_size", batch_size, "expected a number or an array of numbers")
    m = np.asarray(batch_size, dtype=float)
    if not np.all(np.isfinite(m)):
        raise ValidationError("batch_size", batch_size, "must be finite")
    if np.any(m < init_batch_size):
        raise ValidationError("batch_size", batch_size, f"must be >= init_batch_size ({init_batch_size:g})")
    return m


def _batch_term(m: np.ndarray, m0: float, grad_sqr: float, scale: float) -> np.ndarray:
    """(M/M0) · grad_sqr/scale, from logs where a factor under- or overflows (inf only beyond float range)."""
    with np.errstate(all="ignore"):
        ratio = m / m0
        term = ratio * (grad_sqr / scale)
        inexact = ~np.isfinite(ratio) | (grad_sqr / scale < _FLOAT_TINY)
        if np.any(inexact):
            logged = np.exp(np.log(m) - math.log(m0) + math.log(grad_sqr) - math.log(scale))
            term = np.where(inexact, logged, term)
    return term


def two_batch_estimates(sqr_small: Any, batch_small: Any, sqr_large: Any, batch_large: Any) -> tuple[Any, Any]:
    """Unbiased (|g|², tr(Σ)) from squared gradient norms at two batch sizes.

    McCandlish et al. (2018), Appendix A.1. Broadcasts over numpy arrays.
    The estimates are unbiased, so a single one may be negative; smooth them
    (see :class:`GradientNoiseTracker`) before use.
    """
    b = np.asarray(batch_small, dtype=float)
    big = np.asarray(batch_large, dtype=float)
    for name, value, array in (("batch_small", batch_small, b), ("batch_large", batch_large, big)):
        if not np.all(np.isfinite(array)):
            raise ValidationError(name, value, "must be finite")
    if np.any(b <= 0):
        raise ValidationError("batch_small", batch_small, "must be > 0")
    if np.any(big <= b):
        raise ValidationError("batch_large", batch_large, f"must exceed batch_small ({batch_small})")
    s_small = np.asarray(sqr_small, dtype=float)
    s_large = np.asarray(sqr_large, dtype=float)
    if not (np.all(np.isfinite(s_small)) and np.all(np.isfinite(s_large))):
        raise ValidationError("sqr_small/sqr_large", (sqr_small, sqr_large), "must be finite")
    grad_sqr = (big * s_large - b * s_small) / (big - b)
    trace_cov = (s_small - s_large) / (1.0 / b - 1.0 / big)
    return grad_sqr, trace_cov


class GradientNoiseTracker:
    """Bias-corrected exponential averages of |g|² and tr(Σ)/M0.

    Args:
        init_batch_size: the job's reference batch size M0, samples.
        smoothing: per-update decay of the moving averages at the reference
            batch; an update at total batch M decays by ``smoothing ** (M/M0)``
            (Pollux's choice: larger batches carry more information).

    Example::

        tracker = GradientNoiseTracker(init_batch_size=128)
        # after each optimizer step with n micro-batches of b samples:
        tracker.update_micro_batches(micro_sqr_norms, total_sqr_norm, micro_bsz=b)
        tracker.grad_sqr, tracker.grad_var, tracker.efficiency(1024)
    """

    def __init__(self, init_batch_size: int, smoothing: float = 0.99) -> None:
        self.init_batch_size = check_int("init_batch_size", init_batch_size, minimum=1)
        smoothing = check_float("smoothing", smoothing)
        if not 0.0 <= smoothing < 1.0:
            raise ValidationError("smoothing", smoothing, "must be in [0, 1)")
        self.smoothing = smoothing
        self._sqr_biased = 0.0
        self._var_biased = 0.0
        self._weight = 0.0
        self.updates = 0

    # ------------------------------------------------------------------ updates
    def update(self, grad_sqr: float, trace_cov: float, batch_size: float) -> None:
        """Fold in one raw (possibly negative) estimate of |g|² and tr(Σ) from a step of ``batch_size``."""
        grad_sqr = check_float("grad_sqr", grad_sqr)
        trace_cov = check_float("trace_cov", trace_cov)
        batch_size = check_float("batch_size", batch_size, positive=True)
        theta = self.smoothing ** (batch_size / self.init_batch_size)
        self._sqr_biased = theta * self._sqr_biased + (1.0 - theta) * grad_sqr
        self._var_biased = theta * self._var_biased + (1.0 - theta) * trace_cov / self.init_batch_size
        self._weight = theta * self._weight + (1.0 - theta)
        self.updates += 1

    def update_two_batches(self, sqr_small: float, batch_small: float, sqr_large: float, batch_large: float) -> None:
        """Fold in squared gradient norms measured at two batch sizes."""
        grad_sqr, trace_cov = two_batch_estimates(sqr_small, batch_small, sqr_large, batch_large)
        self.update(float(grad_sqr), float(trace_cov), batch_large)

    def update_micro_batches(self, micro_sqr_norms: Any, total_sqr_norm: float, micro_bsz: int) -> None:
        """Pollux's per-replica/accumulation estimator for one optimizer step.

        Args:
            micro_sqr_norms: |G_b|² of each of the n >= 2 micro-batch gradients
                (one per replica and accumulation step), each over ``micro_bsz`` samples.
            total_sqr_norm: |G_B|² of their average, B = n · micro_bsz.
            micro_bsz: samples per micro-batch.
        """
        norms = np.asarray(micro_sqr_norms, dtype=float).ravel()
        if norms.size < 2:
            raise ValidationError("micro_sqr_norms", micro_sqr_norms, "need at least 2 micro-batch gradients")
        micro_bsz = check_int("micro_bsz", micro_bsz, minimum=1)
        self.update_two_batches(float(np.mean(norms)), micro_bsz, total_sqr_norm, micro_bsz * norms.size)

    # ------------------------------------------------------------------ estimates
    def _estimate(self, biased: float) -> float:
        if self._weight == 0.0:
            raise ValidationError("updates", 0, "no gradient statistics yet: call update() first")
        return biased / self._weight

    @property
    def grad_sqr(self) -> float:
        """Smoothed |g|², floored at a tiny positive value (the raw estimate can dip below 0)."""
        return max(self._estimate(self._sqr_biased), GRAD_SQR_FLOOR)

    @property
    def grad_var(self) -> float:
        """Smoothed tr(Σ)/M0, floored at 0."""
        return max(self._estimate(self._var_biased), 0.0)

    @property
    def noise_scale(self) -> float:
        """φ in samples."""
        return noise_scale(self.grad_sqr, self.grad_var, self.init_batch_size)

    def efficiency(self, batch_size: Any) -> Any:
        """E(batch_size) from the current estimates."""
        return efficiency(self.grad_sqr, self.grad_var, self.init_batch_size, batch_size)

    def state_dict(self) -> dict[str, float]:
        return {
            "sqr_biased": self._sqr_biased,
            "var_biased": self._var_biased,
            "weight": self._weight,
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        for key in ("sqr_biased", "var_biased", "weight"):
            value = state.get(key)
            if value is None or not math.isfinite(float(value)):
                raise ValidationError(key, value, "missing or non-finite in tracker state")
        self._sqr_biased = float(state["sqr_biased"])
        self._var_biased = float(state["var_biased"])
        self._weight = float(state["weight"])
        self.updates = int(state.get("updates", 0))
