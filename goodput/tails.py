"""Heavy-tailed measurement noise: its Student-t degrees of freedom, and the intervals it gives.

Step times measured on a shared cluster have outliers (a straggler, a
co-located job, a checkpoint): the residuals of Pollux's traces around each
(job, GPU type)'s fit follow a Student-t with ν ≈ 6 degrees of freedom
(5.3–7.4 leaving one job out), Zeus's ν ≈ 7 (5.7–15.1; its cells are a few
dozen steps, whose scales the estimate allows for), while Gavel's averaged
throughputs are Gaussian (ν → ∞). A job's fit weighs each step by the tails
(:mod:`goodput.posterior`: a scale mixture of normals, so its updates stay
Gaussian and fast), and the tails enter the intervals of a new measurement
(Pollux's P4 coverage 85.2 → 87.8 at 20 observations) and the test of a
surprising one. Its log is

    μ + g + σ·t_ν,     g ~ N(0, s²) (the parameters' and the GP's uncertainty),  t_ν a standard Student-t

with σ the GP's noise std (the core of the noise distribution: measured, the
Gaussian model's central intervals are right and only its tails are short).

:func:`fit_noise_dof` learns ν by maximum likelihood from groups of residuals,
each with its own scale (profiled out by the EM of Lange, Little & Taylor,
*JASA* 84, 1989); :func:`gaussian_t_quantile` gives the quantiles of
``g + σ·t_ν`` (tabulated over the two parts' ratio once per ν and level).

Example::

    >>> rng = np.random.default_rng(0)
    >>> groups = [0.03 * rng.standard_t(3.0, 2000), 0.1 * rng.standard_t(3.0, 2000)]
    >>> round(fit_noise_dof(groups), 1)  # drawn with 3
    2.9
    >>> fit_noise_dof([0.05 * rng.standard_normal(2000)])  # Gaussian
    inf
    >>> round(float(gaussian_t_quantile(0.0, 1.0, 4.0, 0.95)), 3), round(float(gaussian_t_quantile(1.0, 0.0, 4.0, 0.95)), 3)
    (2.132, 1.645)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from scipy.optimize import brentq, minimize_scalar
from scipy.special import gammaln, ndtr, ndtri, roots_hermitenorm, roots_legendre, stdtr, stdtrit

from .validation import check_float, check_quantile

__all__ = ["fit_noise_dof", "gaussian_t_quantile", "gaussian_t_cdf", "split_std", "DOF_RANGE", "MIN_GROUP_SIZE", "DEFAULT_NOISE_DOF"]

DOF_RANGE = (2.5, 100.0)  # ν searched; at the upper end the noise is Gaussian (inf): 100 dof are within 1% of it
MIN_GROUP_SIZE = 8  # residuals a group needs for its scale to be estimated alongside ν
MIN_RESIDUALS = 50  # fewer in all cannot tell tails from noise: fit_noise_dof's default
# A job's tails where nothing has measured them (no cluster, or one with too few residuals): Pollux's traces' (6.2,
# the one cluster in the shared data that measured each configuration many times), so one stalled step does not
# move a job's model before its cluster has said how heavy its tails are
DEFAULT_NOISE_DOF = 6.0
_SCALE_ITERATIONS = 50
_HERMITE_NODES = 64
_LEGENDRE_NODES = 200


def _profile_loglik(r2: np.ndarray, mask: np.ndarray, dof: float) -> float:
    """Log-likelihood of Student-t residuals with ``dof`` degrees of freedom, each group's scale at its maximum,
    adjusted for the scales' estimation: minus half the log of each group's information about its log scale,
    ``Σ 2(ν + 1) u / (1 + u)²`` with ``u = r² / (ν s²)`` (Cox & Reid's modified profile likelihood, *JRSS B* 49,
    1987). The plain profile read groups of 10–20 residuals as lighter-tailed than they are, each scale fitted to
    its own few (drawn with ν = 6: groups of 20 read 9.7, of 10 Gaussian; adjusted 6.5 and 10).

    ``r2``: squared residuals, one group per row, padded; ``mask``: which entries are residuals."""
    counts = mask.sum(axis=1)
    s2 = np.maximum((r2 * mask).sum(axis=1) / counts, 1e-12)
    for _ in range(_SCALE_ITERATIONS):  # EM for the scales: the weights are E[precision | r]
        s2 = np.maximum(((dof + 1) / (dof + r2 / s2[:, None]) * r2 * mask).sum(axis=1) / counts, 1e-12)
    const = gammaln((dof + 1) / 2) - gammaln(dof / 2) - 0.5 * math.log(dof * math.pi)
    u = r2 / (dof * s2[:, None])
    info = np.maximum((2.0 * (dof + 1) * u / (1.0 + u) ** 2 * mask).sum(axis=1), 1e-300)
    return float(np.sum(counts * (const - 0.5 * np.log(s2))) - 0.5 * (dof + 1) * np.sum(np.log1p(u) * mask)
                 - 0.5 * np.sum(np.log(info)))


def fit_noise_dof(residuals: Sequence[Any], *, default: float = math.inf) -> float:
    """Maximum-likelihood degrees of freedom of Student-t noise shared by groups of residuals (e.g. of
    log step time around each (job, GPU type)'s fit), each group with its own scale.

    Groups of fewer than :data:`MIN_GROUP_SIZE` residuals are left out. Returns ``math.inf`` (Gaussian)
    when the likelihood peaks at the top of :data:`DOF_RANGE`, and ``default`` when fewer than
    :data:`MIN_RESIDUALS` residuals remain (too few to tell tails from noise).
    """
    groups = []
    for index, r in enumerate(residuals):
        r = np.asarray(r, dtype=float).ravel()
        if not np.all(np.isfinite(r)):
            raise ValueError(f"residuals[{index}]: expected finite values")
        if r.size >= MIN_GROUP_SIZE and np.any(r != 0):
            groups.append(r - r.mean())
    if sum(r.size for r in groups) < MIN_RESIDUALS:
        return default
    width = max(r.size for r in groups)
    r2, mask = np.zeros((len(groups), width)), np.zeros((len(groups), width), dtype=bool)
    for row, r in enumerate(groups):
        r2[row, :r.size], mask[row, :r.size] = r * r, True
    lo, hi = math.log(DOF_RANGE[0]), math.log(DOF_RANGE[1])
    best = minimize_scalar(lambda log_dof: -_profile_loglik(r2, mask, math.exp(log_dof)), bounds=(lo, hi),
                           method="bounded", options={"xatol": 1e-3})
    dof = math.exp(float(best.x))
    return math.inf if dof > 0.95 * DOF_RANGE[1] else dof


@lru_cache(maxsize=16)
def _nodes(dof: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Gauss–Hermite nodes and weights of N(0, 1), and Gauss–Legendre ones in probability mapped to t_dof quantiles."""
    hermite_x, hermite_w = roots_hermitenorm(_HERMITE_NODES)
    legendre_x, legendre_w = roots_legendre(_LEGENDRE_NODES)
    return hermite_x, hermite_w / math.sqrt(2 * math.pi), stdtrit(dof, (legendre_x + 1) / 2), legendre_w / 2


def _standard_cdf(x: np.ndarray, rho: np.ndarray, dof: float) -> np.ndarray:
    """Distribution function of ``ρZ + (1 − ρ)T_dof`` at ``x`` (arrays of one shape, ρ in [0, 1]).

    Integrated over the part that varies more slowly: the normal's (Gauss–Hermite, with the t's
    distribution function) where the t weighs more (ρ ≤ ½), the t's quantiles (Gauss–Legendre in
    probability) where the normal does."""
    hermite_x, hermite_w, tau, legendre_w = _nodes(dof)
    x, rho = np.asarray(x, dtype=float)[..., None], np.asarray(rho, dtype=float)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        over_normal = (hermite_w * stdtr(dof, (x - rho * hermite_x) / (1 - rho))).sum(axis=-1)
        over_t = (legendre_w * ndtr((x - (1 - rho) * tau) / rho)).sum(axis=-1)
    return np.where(rho[..., 0] <= 0.5, over_normal, over_t)


@lru_cache(maxsize=128)
def _ratio_quantiles(dof: float, q: float) -> np.ndarray:
    """The ``q``-quantile of ``ρZ + (1 − ρ)T_dof`` at Chebyshev points ρ ∈ [0, 1] (q > 0.5), each by Brent's method."""
    out = np.empty(_RATIO_POINTS)
    for k, rho in enumerate(_RATIO_GRID):
        if rho <= 0.0:
            out[k] = stdtrit(dof, q)
        elif rho >= 1.0:
            out[k] = ndtri(q)
        else:
            # ρZ + (1 − ρ)T ≤ max(Z, T), and P(max(Z, T) > a) ≤ 1 − q at a = both (1 + q)/2-quantiles' larger
            tail = (1.0 + q) / 2.0
            high = max(float(stdtrit(dof, tail)), float(ndtri(tail)))
            out[k] = brentq(lambda x, r=rho: float(_standard_cdf(x, r, dof)) - q, 0.0, high, xtol=1e-12)
    return out


def split_std(total_std: Any, noise_scale: Any) -> tuple[np.ndarray, np.ndarray]:
    """A predictive std of log step time (noise counted by its scale) as ``(gaussian_std, t_scale)``:
    the noise's scale, at most the total, and the normal part ``√(total² − scale²)``."""
    total = np.asarray(total_std, dtype=float)
    noise = np.minimum(np.asarray(noise_scale, dtype=float), total)
    return np.sqrt(np.maximum(total * total - noise * noise, 0.0)), noise


def gaussian_t_cdf(x: Any, gaussian_std: Any, t_scale: Any, dof: float) -> Any:
    """The distribution function at ``x`` of ``g + t_scale·t_dof``, ``g ~ N(0, gaussian_std²)`` (arrays broadcast;
    ``dof = inf``: the normal of ``√(gaussian_std² + t_scale²)``)."""
    x, g, s = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (x, gaussian_std, t_scale)))
    if np.any(g < 0) or np.any(s < 0):
        raise ValueError(f"gaussian_std, t_scale: expected non-negative, got {g.min()}, {s.min()}")
    total = g + s
    with np.errstate(divide="ignore", invalid="ignore"):
        if math.isinf(dof):
            out = ndtr(x / np.sqrt(g * g + s * s))
        else:
            dof = check_float("dof", dof, positive=True)
            out = _standard_cdf(np.where(total > 0, x / total, 0.0), np.divide(g, total, out=np.ones_like(total), where=total > 0), dof)
            # P(X ≤ −a) ≥ P(g ≤ 0)·P(t_scale·t ≤ −a), and likewise with the two parts swapped: where the quadrature's
            # nodes end (about 1e-5 into either tail) this bound, within a factor 2-4 of the tail, stands in for it
            bound = 0.5 * np.maximum(stdtr(dof, -np.abs(x) / s), ndtr(-np.abs(x) / g))
            out = np.where(x < 0, np.maximum(out, bound), np.minimum(out, 1.0 - bound))
    out = np.where(total > 0, out, np.where(x >= 0, 1.0, 0.0))
    return float(out) if out.ndim == 0 else out


def gaussian_t_quantile(gaussian_std: Any, t_scale: Any, dof: float, q: float) -> Any:
    """The ``q``-quantile of ``g + t_scale·t_dof`` with ``g ~ N(0, gaussian_std²)`` (arrays broadcast).

    ``dof = inf`` is the normal quantile of ``√(gaussian_std² + t_scale²)``. Quantiles scale with the
    sum of the two scales, so the quantile of ``ρZ + (1 − ρ)T`` is tabulated once per (dof, q) over ρ and
    interpolated (Chebyshev, within 1e-4 of the quantile for dof ≥ 2.5 and q ≤ 0.995).
    """
    q = check_quantile("q", q)
    g = np.asarray(gaussian_std, dtype=float)
    s = np.asarray(t_scale, dtype=float)
    g, s = np.broadcast_arrays(g, s)
    if np.any(g < 0) or np.any(s < 0):
        raise ValueError(f"gaussian_std, t_scale: expected non-negative, got {g.min()}, {s.min()}")
    if math.isinf(dof):
        out = ndtri(q) * np.sqrt(g * g + s * s)
    else:
        dof = check_float("dof", dof, positive=True)
        total = g + s
        rho = np.divide(g, total, out=np.ones_like(total), where=total > 0)
        table = _ratio_quantiles(float(dof), max(q, 1 - q)) if q != 0.5 else np.zeros(_RATIO_POINTS)
        out = (1.0 if q > 0.5 else -1.0) * total * _CHEBYSHEV.interpolate(table, rho)
    return float(out) if out.ndim == 0 else out


@dataclass(frozen=True)
class _Chebyshev:
    """Barycentric interpolation at Chebyshev–Lobatto points of [0, 1] (Berrut & Trefethen, *SIAM Review* 46, 2004)."""

    points: np.ndarray
    weights: np.ndarray

    @classmethod
    def of(cls, n: int) -> _Chebyshev:
        points = (1 - np.cos(np.pi * np.arange(n) / (n - 1))) / 2
        weights = (-1.0) ** np.arange(n)
        weights[[0, -1]] *= 0.5
        return cls(points, weights)

    def interpolate(self, values: np.ndarray, x: np.ndarray) -> np.ndarray:
        diff = x[..., None] - self.points
        exact = diff == 0
        diff[exact] = 1.0
        ratio = self.weights / diff
        out = (ratio @ values) / ratio.sum(axis=-1)
        hit = exact.any(axis=-1)
        return np.where(hit, values[np.argmax(exact, axis=-1)], out)


_RATIO_POINTS = 33
_CHEBYSHEV = _Chebyshev.of(_RATIO_POINTS)
_RATIO_GRID = _CHEBYSHEV.points
