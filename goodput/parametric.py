"""The parametric mean: Pollux's throughput model in unconstrained coordinates, its Jacobian and MAP fit.

Pollux's model (Qiao et al., OSDI'21, §3.2; DESIGN.md) has seven positive
parameters per job and GPU type. The Bayesian model works in coordinates
``u`` (:data:`COORDS`) in which every value is allowed and a Gaussian prior is
natural:

    u0 = log c              compute of one micro-batch at the job's reference batch b_ref, s
    u1 = logit f            the share of it that grows with the batch: α_c = c(1 − f), β_c = c·f / b_ref
    u2 = log α_r            intra-node sync at 2 replicas, s
    u3 = log α_n            inter-node sync at 2 replicas, s
    u4 = log(β_r / α_r)     intra-node growth per extra replica, relative
    u5 = log(β_n / α_n)     inter-node growth per extra replica, relative
    u6 = log(γ − 1)         overlap of compute and sync (γ = 1: none)

Compute is written as its level at a reference batch (what any observation
pins) and the split between per-sample work and per-step overhead (what only
several batch sizes show, and what a job shares across GPU types): with one
batch size on a type, its split comes from the job's other types, and an
extrapolation to large batches stays within the split's bounds. ``b_ref`` is
the job's, the same on every type (:func:`reference_bsz`). The growth terms
are written relative to their constants: the constants carry
a job's gradient bytes over each interconnect, the ratios are properties of
the collective algorithm (:mod:`goodput.hierarchy` learns how much each varies
and how the constants move together).

:func:`log_step_time` gives log T_iter and its Jacobian ``∂ log T / ∂u``
(analytic) for a batch of configurations; :func:`fit_map` finds the maximum a posteriori ``u`` of one job on several
GPU types under a Gaussian prior, by Levenberg–Marquardt on the stacked
residuals (Gauss–Newton with the prior as pseudo-observations: Bishop,
*Pattern Recognition and Machine Learning*, 2006, §4.4 for the Laplace
approximation it supports).

Example::

    >>> u = u_from_theta(np.array([0.02, 0.001, 0.2, 0.01, 0.05, 0.005, 1.5]), ref_bsz=32.0)
    >>> rows = Rows(np.array([1.0]), np.array([4.0]), np.array([64.0]), np.array([0.0]), ref_bsz=32.0)
    >>> round(float(np.exp(log_step_time(u, rows)[0][0])), 4)
    0.1151
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import scipy.linalg
import scipy.optimize

from .observations import Observation
from .throughput import SoftMax

__all__ = ["COORDS", "K", "Rows", "reference_bsz", "theta_from_u", "u_from_theta", "log_step_time", "sigma_points",
           "unscented_moments", "unscented_log_step_time", "fit_map", "MapFit"]

COORDS = ("log_compute", "logit_per_sample", "log_alpha_r", "log_alpha_n", "log_growth_r", "log_growth_n", "log_gamma_excess")
K = len(COORDS)
_FLOOR = 1e-12  # smallest parameter value taken to logarithms, s
_GAMMA_MAX = 50.0  # beyond this the overlap is max(compute, sync) to within 1.4%


@dataclass(frozen=True)
class Rows:
    """Configurations as float arrays (N,): nodes, replicas, local batch, accumulation; ``factor`` the
    cluster's sync shape on inter-node sync (:mod:`goodput.sync_shape`; 1 elsewhere)."""

    nodes: np.ndarray
    replicas: np.ndarray
    bsz: np.ndarray
    accum: np.ndarray
    ref_bsz: float
    factor: np.ndarray | None = None
    # derived once (a fit evaluates the same rows many times): regimes as 0/1 floats, extra replicas
    multi: np.ndarray = field(init=False, repr=False, compare=False)
    inter: np.ndarray = field(init=False, repr=False, compare=False)
    intra: np.ndarray = field(init=False, repr=False, compare=False)
    extra: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        multi = self.replicas > 1
        inter = multi & (self.nodes > 1)
        object.__setattr__(self, "multi", multi.astype(float))
        object.__setattr__(self, "inter", inter.astype(float))
        object.__setattr__(self, "intra", (multi & ~inter).astype(float))
        object.__setattr__(self, "extra", np.maximum(self.replicas - 2.0, 0.0))

    @classmethod
    def of(cls, observations: Sequence[Observation], ref_bsz: float, shape: object | None = None) -> Rows:
        nodes = np.array([o.num_nodes for o in observations], dtype=float)
        replicas = np.array([o.num_replicas for o in observations], dtype=float)
        factor = None if shape is None else np.asarray(shape(nodes, replicas), dtype=float)  # type: ignore[operator]
        return cls(nodes, replicas, np.array([o.local_bsz for o in observations], dtype=float),
                   np.array([o.accum_steps for o in observations], dtype=float), float(ref_bsz), factor)


def reference_bsz(observations: Sequence[Observation]) -> float:
    """A job's reference micro-batch: the geometric mean of its observed local batches (all types), samples."""
    return float(np.exp(np.mean(np.log([o.local_bsz for o in observations]))))


def _split(u1: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(u1, dtype=float)))


def theta_from_u(u: np.ndarray, ref_bsz: float) -> np.ndarray:
    """θ in :data:`goodput.throughput.PARAM_NAMES` order (α_c, β_c, α_n, β_n, α_r, β_r, γ) from ``u`` (..., 7)."""
    u = np.asarray(u, dtype=float)
    c, f = np.exp(u[..., 0]), _split(u[..., 1])
    a_c, b_c, a_r = c * (1.0 - f), c * f / ref_bsz, np.exp(u[..., 2])
    a_n = np.exp(u[..., 3])
    b_r, b_n = a_r * np.exp(u[..., 4]), a_n * np.exp(u[..., 5])
    gamma = np.minimum(1.0 + np.exp(u[..., 6]), _GAMMA_MAX)
    return np.stack([a_c, b_c, a_n, b_n, a_r, b_r, gamma], axis=-1)


def u_from_theta(theta: np.ndarray, ref_bsz: float) -> np.ndarray:
    """``u`` from θ (PARAM_NAMES order); zero parameters are floored at 1e-12 s, γ − 1 at 1e-6."""
    a_c, b_c, a_n, b_n, a_r, b_r, gamma = (np.maximum(np.asarray(theta, dtype=float)[..., i], _FLOOR) for i in range(7))
    per_sample = b_c * ref_bsz
    return np.stack([np.log(a_c + per_sample), np.log(per_sample / a_c), np.log(a_r), np.log(a_n), np.log(b_r / a_r),
                     np.log(b_n / a_n), np.log(np.maximum(gamma - 1.0, 1e-6))], axis=-1)


def _theta_scalars(u: np.ndarray, ref_bsz: float) -> tuple[float, float, float, float, float, float, float, float]:
    """:func:`theta_from_u` of one ``u`` (7,) as Python floats, and the split ``f`` (the hot path of the fits)."""
    u0, u1, u2, u3, u4, u5, u6 = (min(v, 700.0) for v in u.tolist())  # math.exp raises beyond; a trial step may go there
    c = math.exp(u0)
    f = 1.0 / (1.0 + math.exp(-u1)) if u1 > -700.0 else 0.0
    a_r, a_n = math.exp(u2), math.exp(u3)
    gamma = min(1.0 + math.exp(u6), _GAMMA_MAX)
    return c * (1.0 - f), c * f / ref_bsz, a_n, a_n * math.exp(u5), a_r, a_r * math.exp(u4), gamma, f


def log_step_time(u: np.ndarray, rows: Rows, jacobian: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """log T_iter of each configuration under ``u`` (7,) and ``∂ log T / ∂u`` (N, 7).

    T_iter = a·C + (C^γ + S^γ)^{1/γ} with C = α_c + β_c·b, S the sync time of
    Pollux's form (× the sync shape on several nodes), a the accumulation steps.
    Without the Jacobian, ``u`` may be (M, 7): log T_iter of each row of ``u`` at each configuration (M, N).
    """
    u = np.asarray(u, dtype=float)
    if u.ndim == 2:
        if jacobian:
            raise ValueError("the Jacobian is for one u (7,)")
        # θ of each row as (M, 1) columns that broadcast against the configurations (no split f: no Jacobian)
        a_c, b_c, a_n, b_n, a_r, b_r, g = theta_from_u(np.minimum(u, 700.0), rows.ref_bsz).T[:, :, None]
    else:
        a_c, b_c, a_n, b_n, a_r, b_r, g, f = _theta_scalars(u, rows.ref_bsz)
    extra, inter = rows.extra, rows.inter
    factor = 1.0 if rows.factor is None else rows.factor
    compute = a_c + b_c * rows.bsz
    inter_sync = factor * (a_n + b_n * extra)
    intra_sync = a_r + b_r * extra
    sync = np.where(inter > 0, inter_sync, np.where(rows.intra > 0, intra_sync, 0.0))  # 0 on one replica
    soft = SoftMax.of(compute, sync, g)
    overlap, x, y, xg, yg, q = soft.overlap, soft.x, soft.y, soft.xg, soft.yg, soft.q
    step = rows.accum * compute + overlap
    log_step = np.log(step)
    if not jacobian:
        return log_step, None
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d_c = rows.accum + (compute / overlap) ** (g - 1.0)
        d_s = np.where(sync > 0, (sync / overlap) ** (g - 1.0), 0.0) / step  # ∂ log T / ∂ log S per unit S
        ylogy = np.where(yg > 0, yg * np.log(y), 0.0)
        d_g = overlap * (-np.log(q) / g**2 + (xg * np.log(x) + ylogy) / (g * q))
        jac = np.empty((step.size, K))
        jac[:, 0] = d_c * compute / step
        jac[:, 1] = (d_c * ((a_c + b_c * rows.ref_bsz) * f * (1.0 - f)) / step) * (rows.bsz / rows.ref_bsz - 1.0)
        jac[:, 2] = d_s * (rows.intra * intra_sync)
        jac[:, 3] = d_s * (inter * inter_sync)
        jac[:, 4] = d_s * (rows.intra * b_r * extra)
        jac[:, 5] = d_s * (inter * factor * b_n * extra)
        jac[:, 6] = (d_g * (g - 1.0) / step) * (rows.multi if g < _GAMMA_MAX else 0.0)
    jac[~np.isfinite(jac)] = 0.0
    return log_step, jac


UNSCENTED_KAPPA = 1.0  # the unscented transform's κ: sigma points at ±√(7 + κ) std, the centre weighted κ / (7 + κ)


def sigma_points(mean: np.ndarray, cov: np.ndarray, kappa: float = UNSCENTED_KAPPA) -> tuple[np.ndarray, np.ndarray]:
    """The unscented transform's 2·7 + 1 sigma points of ``N(mean, cov)`` (15, 7) and their weights (15,):
    ``mean`` and ``mean ± √(7 + κ)`` times the columns of a square root of ``cov`` (Julier & Uhlmann,
    "Unscented filtering and nonlinear estimation", *Proc. IEEE* 92(3), 2004)."""
    values, vectors = np.linalg.eigh(0.5 * (cov + cov.T))
    root = vectors * np.sqrt(np.maximum(values, 0.0)) * math.sqrt(K + kappa)
    points = np.concatenate([mean[None, :], mean + root.T, mean - root.T])
    weights = np.full(2 * K + 1, 0.5 / (K + kappa))
    weights[0] = kappa / (K + kappa)
    return points, weights


def unscented_moments(points: np.ndarray, weights: np.ndarray, rows: Rows) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of log T_iter at each configuration (N,) over :func:`sigma_points`."""
    with np.errstate(all="ignore"):
        logs = log_step_time(points, rows, jacobian=False)[0]
        centre = weights @ logs
        return centre, weights @ (logs - centre) ** 2


def unscented_log_step_time(mean: np.ndarray, cov: np.ndarray, rows: Rows, kappa: float = UNSCENTED_KAPPA) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of log T_iter over ``u ~ N(mean, cov)`` by the unscented transform (N,) each.

    Where Pollux's form bends within the posterior's spread (a per-sample share near 0 or 1, a
    soft maximum switching between compute and sync), the linearisation's ``J cov Jᵀ`` misses
    the spread: a saturated share has no slope, so its uncertainty gave the small batches none.
    """
    return unscented_moments(*sigma_points(mean, cov, kappa), rows)


@dataclass(frozen=True)
class MapFit:
    """The maximum a posteriori coordinates of one job on its GPU types.

    Attributes:
        u: (T, 7) coordinates per type, in the order of the prior's types.
        rms: RMS of the log residuals of step time at ``u`` (0 without observations).
        n: observations used.
        objective: the minimised ``Σ (log T − y)² / σ² + |L⁻¹(u − m)|²`` at ``u`` (twice the negative
            log posterior, up to a constant).
    """

    u: np.ndarray
    rms: float
    n: int
    objective: float = math.nan


def fit_map(
    steps: Sequence[tuple[int, Rows, np.ndarray]],
    prior_mean: np.ndarray,
    prior_chol: np.ndarray,
    noise_std: float,
    initial: np.ndarray | None = None,
    starts: Sequence[np.ndarray] = (),
) -> MapFit:
    """Maximum a posteriori ``u`` of a job on T types under the Gaussian prior N(prior_mean, L Lᵀ).

    Args:
        steps: per type with observations, ``(type index, rows, log step times)``.
        prior_mean: (T, 7).
        prior_chol: (7T, 7T) lower Cholesky factor L of the prior covariance (type-major order).
        noise_std: std of a log step time around the model (the likelihood's scale).
        initial: (T, 7) starting point (default: the prior mean).
        starts: further (T, 7) starting points; the optimum with the lowest objective wins. Pollux's soft
            maximum makes the posterior multimodal: one step that includes synchronisation is explained by
            a larger compute or a larger sync, and a local search settles in the basin nearest its start.

    Minimises ``Σ (log T − y)² / σ² + |L⁻¹(u − m)|²`` by Levenberg–Marquardt (MINPACK via
    :func:`scipy.optimize.leastsq`), the prior as pseudo-observations.
    """
    mean = np.asarray(prior_mean, dtype=float)
    num_types = mean.shape[0]
    dim = num_types * K
    whiten = scipy.linalg.solve_triangular(prior_chol, np.eye(dim), lower=True)  # L⁻¹
    sigma = max(float(noise_std), 1e-4)
    n_rows = sum(len(y) for _, _, y in steps)

    def residuals(flat: np.ndarray) -> np.ndarray:
        u = flat.reshape(num_types, K)
        parts = [whiten @ (flat - mean.ravel())]
        for k, rows, y in steps:
            parts.append((log_step_time(u[k], rows, jacobian=False)[0] - y) / sigma)
        return np.concatenate(parts)

    def jacobian(flat: np.ndarray) -> np.ndarray:
        u = flat.reshape(num_types, K)
        jac = np.zeros((dim + n_rows, dim))
        jac[:dim] = whiten
        row = dim
        for k, rows, y in steps:
            jac[row:row + len(y), k * K:(k + 1) * K] = log_step_time(u[k], rows)[1] / sigma
            row += len(y)
        return jac

    def evaluated(flat: np.ndarray) -> tuple[float, np.ndarray]:
        """The objective at ``flat`` (inf where not finite) and its stacked residuals."""
        stacked = residuals(flat)
        value = float(np.sum(stacked**2))
        return (value if math.isfinite(value) else math.inf), stacked

    first = (mean if initial is None else np.asarray(initial, dtype=float)).ravel()
    best, (best_value, best_residuals) = first, evaluated(first)
    found_any = False
    for start in [first, *(np.asarray(s, dtype=float).ravel() for s in starts)] if n_rows else []:
        # MINPACK's lmder with least_squares(method="lm")'s settings, through leastsq: the same iterates without
        # least_squares' wrappers (a third of a small fit's time)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "reached maxfev" and the like: the point is checked below
            found, _ = scipy.optimize.leastsq(residuals, start, Dfun=jacobian, ftol=1e-8, xtol=1e-8, gtol=1e-8,
                                              maxfev=200 * (dim + 1), factor=100.0)
        value, stacked = evaluated(found) if np.all(np.isfinite(found)) else (math.inf, None)
        if math.isfinite(value) and (not found_any or value < best_value):
            best, best_value, best_residuals, found_any = found, value, stacked, True
    r = best_residuals[dim:] * sigma  # the log residuals of step time at the optimum
    return MapFit(best.reshape(num_types, K), float(np.sqrt(np.mean(r**2))) if r.size else 0.0, int(r.size), best_value)
