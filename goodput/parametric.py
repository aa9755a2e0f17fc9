"""The parametric mean: Pollux's throughput model in unconstrained coordinates, its Jacobian and MAP fit.

Pollux's model (Qiao et al., OSDI'21, §3.2; DESIGN.md) has seven positive
parameters per job and GPU type; this one adds an eighth, the power with which
compute's two terms combine. The Bayesian model works in coordinates ``u``
(:data:`COORDS`) in which every value is allowed and a Gaussian prior is
natural:

    u0 = log c              compute of one micro-batch at the job's reference batch b_ref, s
    u1 = logit f            the share of it that grows with the batch (p = 1: α_c = c(1 − f), β_c = c·f / b_ref)
    u2 = log α_r            intra-node sync at 2 replicas, s
    u3 = log α_n            inter-node sync at 2 replicas, s
    u4 = log(β_r / α_r)     intra-node growth per extra replica, relative
    u5 = log(β_n / α_n)     inter-node growth per extra replica, relative
    u6 = log(γ − 1)         overlap of compute and sync (γ = 1: none)
    u7 = log p              how compute bends between overhead and per-sample work (p = 1: Pollux's sum)

Compute is written as its level at a reference batch (what any observation
pins) and the split between per-sample work and per-step overhead (what only
several batch sizes show, and what a job shares across GPU types): with one
batch size on a type, its split comes from the job's other types, and an
extrapolation to large batches stays within the split's bounds. Pollux sums
the two, ``α_c + β_c·b``; a GPU is latency-bound at small batches and its step
time flattens below that line, so the two are combined by a soft maximum of
power ``p``, the form Pollux itself uses for compute and sync (its γ):

    C(b) = (α_c^p + (β_c·b)^p)^{1/p} = c · ((1 − f) + f·(b / b_ref)^p)^{1/p}

with ``f = (β_c·b_ref)^p / c^p``, Pollux's form at ``p = 1`` (held out one
batch size at a time on the single-GPU curves of the shared data, the fitted
``p`` halved the median error of Pollux's sum on Pollux's traces, Gavel and
Zeus: ``python -m experiments.compute_form``). ``b_ref`` is
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

    >>> u = u_from_theta(np.array([0.02, 0.001, 0.2, 0.01, 0.05, 0.005, 1.5]), ref_bsz=32.0)  # p = 1
    >>> rows = Rows(np.array([1.0]), np.array([4.0]), np.array([64.0]), np.array([0.0]), ref_bsz=32.0)
    >>> round(float(np.exp(log_step_time(u, rows)[0][0])), 4)
    0.1151
    >>> one_gpu = Rows(np.ones(2), np.ones(2), np.array([4.0, 64.0]), np.zeros(2), ref_bsz=32.0)
    >>> theta = np.array([0.02, 0.001, 0.2, 0.01, 0.05, 0.005, 1.5])
    >>> [np.round(np.exp(log_step_time(u_from_theta(theta, 32.0, power=p), one_gpu)[0]), 4).tolist()
    ...  for p in (1.0, 3.0)]  # α_c + β_c·b at 4 and 64 samples; then near max(α_c, β_c·b)
    [[0.024, 0.084], [0.0201, 0.0646]]
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

__all__ = ["COORDS", "K", "LOG_POWER_MAX", "power_from_log", "Rows", "reference_bsz", "theta_from_u", "u_from_theta", "rebase_u", "log_step_time", "log_compute_time", "stacked_log_compute_time",
           "sigma_points",
           "unscented_moments", "unscented_log_step_time", "fit_map", "MapFit"]

COORDS = ("log_compute", "logit_per_sample", "log_alpha_r", "log_alpha_n", "log_growth_r", "log_growth_n", "log_gamma_excess",
          "log_compute_power")
K = len(COORDS)
_FLOOR = 1e-12  # smallest parameter value taken to logarithms, s
_GAMMA_MAX = 50.0  # beyond this the overlap is max(compute, sync) to within 1.4%
LOG_POWER_MAX = 4.0  # |log p| is held within this (p from 0.018 to 55: a sum far flatter than Pollux's to a maximum)


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
    log_ratio: np.ndarray = field(init=False, repr=False, compare=False)  # log(b / b_ref)

    def __post_init__(self) -> None:
        multi = self.replicas > 1
        inter = multi & (self.nodes > 1)
        object.__setattr__(self, "multi", multi.astype(float))
        object.__setattr__(self, "inter", inter.astype(float))
        object.__setattr__(self, "intra", (multi & ~inter).astype(float))
        object.__setattr__(self, "extra", np.maximum(self.replicas - 2.0, 0.0))
        object.__setattr__(self, "log_ratio", np.log(np.maximum(self.bsz, _FLOOR) / self.ref_bsz))

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


def power_from_log(log_power: np.ndarray | float) -> np.ndarray:
    """Compute's power ``p`` from its coordinate ``u7 = log p``, held within ``|log p| ≤`` :data:`LOG_POWER_MAX`."""
    if isinstance(log_power, float):  # one job's u7 (numpy's float64 too), the fits' hot path: np.clip costs 3 µs a call
        return np.exp(min(max(log_power, -LOG_POWER_MAX), LOG_POWER_MAX))
    return np.exp(np.clip(log_power, -LOG_POWER_MAX, LOG_POWER_MAX))


_LOG2 = math.log(2.0)


def _softplus(x: float) -> float:
    """``log(1 + eˣ)`` of one number, bit for bit ``np.logaddexp(0.0, x)`` (numpy's formula, with the C library's
    ``exp`` and ``log1p`` as numpy's uses them), without a ufunc call's overhead."""
    if x == 0.0:
        return _LOG2
    if x > 0.0:
        return x + math.log1p(math.exp(-x))
    if x < 0.0:
        return 0.0 + math.log1p(math.exp(x))
    return x  # nan


def theta_from_u(u: np.ndarray, ref_bsz: float) -> np.ndarray:
    """θ in :data:`goodput.throughput.PARAM_NAMES` order (α_c, β_c, α_n, β_n, α_r, β_r, γ) from ``u`` (..., 8).

    Compute's power ``p`` (``u[..., 7]``) is not one of Pollux's parameters: α_c and β_c are the soft
    maximum's terms, ``C(b) = (α_c^p + (β_c·b)^p)^{1/p}``, Pollux's sum where ``p = 1``.
    """
    u = np.asarray(u, dtype=float)
    c, p = np.exp(u[..., 0]), power_from_log(u[..., 7])
    # (1 - f)^(1/p) and f^(1/p) of the share f = sigmoid(u1), from logs: 1 - f rounds to 0 above u1 ≈ 37,
    # where a large p still leaves α_c a part of the small batches' compute
    a_c = c * np.exp(-np.logaddexp(0.0, u[..., 1]) / p)
    b_c = c * np.exp(-np.logaddexp(0.0, -u[..., 1]) / p) / ref_bsz
    a_r = np.exp(u[..., 2])
    a_n = np.exp(u[..., 3])
    b_r, b_n = a_r * np.exp(u[..., 4]), a_n * np.exp(u[..., 5])
    gamma = np.minimum(1.0 + np.exp(u[..., 6]), _GAMMA_MAX)
    return np.stack([a_c, b_c, a_n, b_n, a_r, b_r, gamma], axis=-1)


def u_from_theta(theta: np.ndarray, ref_bsz: float, power: float | np.ndarray = 1.0) -> np.ndarray:
    """``u`` from θ (PARAM_NAMES order) and compute's power ``p`` (default 1: Pollux's sum); zero parameters
    are floored at 1e-12 s, γ − 1 at 1e-6 (so ``u`` at another reference batch is :func:`rebase_u`'s, not a
    round trip through θ: the floor, raised to a small ``p``, is not small)."""
    a_c, b_c, a_n, b_n, a_r, b_r, gamma = (np.maximum(np.asarray(theta, dtype=float)[..., i], _FLOOR) for i in range(7))
    log_power = np.clip(np.log(np.broadcast_to(np.asarray(power, dtype=float), np.shape(a_c))), -LOG_POWER_MAX, LOG_POWER_MAX)
    p = np.exp(log_power)
    log_work, log_overhead = p * np.log(b_c * ref_bsz), p * np.log(a_c)
    return np.stack([np.logaddexp(log_overhead, log_work) / p, log_work - log_overhead, np.log(a_r), np.log(a_n),
                     np.log(b_r / a_r), np.log(b_n / a_n), np.log(np.maximum(gamma - 1.0, 1e-6)), log_power], axis=-1)


def rebase_u(u: np.ndarray, ref_bsz: float, new_ref_bsz: float) -> np.ndarray:
    """``u`` (..., 8) rewritten for the reference batch ``new_ref_bsz``: the same step times. Compute's level
    becomes its value at the new batch, ``c' = c·g^{1/p}`` with ``g = (1 − f) + f·r^p``, ``r = new / old``, and
    its share ``logit f' = logit f + p·log r``; the other coordinates do not depend on the batch."""
    u = np.array(u, dtype=float)
    log_ratio = math.log(new_ref_bsz / ref_bsz)
    _, _, p, _, log_g = _compute(u[..., 0], u[..., 1], u[..., 7], log_ratio)  # log g = p·log(C(b') / c)
    u[..., 0] += log_g / p
    u[..., 1] += p * log_ratio
    return u


def _compute(u0: np.ndarray, u1: np.ndarray, u7: np.ndarray, log_ratio: np.ndarray) -> tuple[np.ndarray, ...]:
    """Compute time of one micro-batch (s) at ``log(b / b_ref)``, with what its derivatives need: the split
    ``f``, the power ``p``, ``w`` (the per-sample term's share of ``C^p`` at b) and ``log g = p·log(C / c)``."""
    p = power_from_log(u7)
    if isinstance(u1, float):
        log_f, log_rest = -_softplus(-u1), -_softplus(u1)
    else:
        log_f, log_rest = -np.logaddexp(0.0, -u1), -np.logaddexp(0.0, u1)
    log_work = log_f + p * log_ratio
    log_g = np.logaddexp(log_rest, log_work)
    return np.exp(u0 + log_g / p), np.exp(log_f), p, np.exp(log_work - log_g), log_g


def _sync_scalars(u: np.ndarray) -> tuple[float, float, float, float, float]:
    """α_n, β_n, α_r, β_r, γ of one ``u`` (8,) as Python floats (the hot path of the fits)."""
    u2, u3, u4, u5, u6 = (min(v, 700.0) for v in u[2:7].tolist())  # math.exp raises beyond; a trial step may go there
    a_r, a_n = math.exp(u2), math.exp(u3)
    return a_n, a_n * math.exp(u5), a_r, a_r * math.exp(u4), min(1.0 + math.exp(u6), _GAMMA_MAX)


def log_step_time(u: np.ndarray, rows: Rows, jacobian: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """log T_iter of each configuration under ``u`` (8,) and ``∂ log T / ∂u`` (N, 8).

    T_iter = a·C + (C^γ + S^γ)^{1/γ} with C the compute of one micro-batch (module docstring), S the sync time
    of Pollux's form (× the sync shape on several nodes), a the accumulation steps.
    Without the Jacobian, ``u`` may be (M, 8): log T_iter of each row of ``u`` at each configuration (M, N).
    """
    u = np.asarray(u, dtype=float)
    if u.ndim == 2:
        if jacobian:
            raise ValueError("the Jacobian is for one u (8,)")
        # each row's parameters as (M, 1) columns that broadcast against the configurations
        capped = np.minimum(u, 700.0)
        compute = _compute(capped[:, 0:1], capped[:, 1:2], capped[:, 7:8], rows.log_ratio)[0]
        _, _, a_n, b_n, a_r, b_r, g = theta_from_u(capped, rows.ref_bsz).T[:, :, None]
    else:
        u0, u1, u7 = (min(v, 700.0) for v in (u[0], u[1], u[7]))
        compute, f, p, w, log_g = _compute(u0, u1, u7, rows.log_ratio)
        a_n, b_n, a_r, b_r, g = _sync_scalars(u)
    extra, inter = rows.extra, rows.inter
    factor = 1.0 if rows.factor is None else rows.factor
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
        d_c = (rows.accum + (compute / overlap) ** (g - 1.0)) * compute / step  # ∂ log T / ∂ log C
        d_s = np.where(sync > 0, (sync / overlap) ** (g - 1.0), 0.0) / step  # ∂ log T / ∂ log S per unit S
        ylogy = np.where(yg > 0, yg * np.log(y), 0.0)
        d_g = overlap * (-np.log(q) / g**2 + (xg * np.log(x) + ylogy) / (g * q))
        jac = np.empty((step.size, K))
        jac[:, 0] = d_c
        jac[:, 1] = d_c * (w - f) / p  # ∂ log C / ∂ logit f = (w − f) / p
        jac[:, 2] = d_s * (rows.intra * intra_sync)
        jac[:, 3] = d_s * (inter * inter_sync)
        jac[:, 4] = d_s * (rows.intra * b_r * extra)
        jac[:, 5] = d_s * (inter * factor * b_n * extra)
        jac[:, 6] = (d_g * (g - 1.0) / step) * (rows.multi if g < _GAMMA_MAX else 0.0)
        # ∂ log C / ∂ log p = w·log(b / b_ref) − log g / p (0 where p is held at its bounds)
        jac[:, 7] = d_c * (w * rows.log_ratio - log_g / p) if abs(u7) < LOG_POWER_MAX else 0.0
    jac[~np.isfinite(jac)] = 0.0
    return log_step, jac


def log_compute_time(u: np.ndarray, rows: Rows) -> tuple[np.ndarray, np.ndarray]:
    """log C, the compute of one micro-batch (s), at each configuration under ``u`` (8,), and ``∂ log C / ∂u`` (N, 8).

    What ``Observation.compute_time`` measures on several replicas (step minus the sync it waited on, per
    micro-batch): Pollux's compute, the same on one replica or many (Qiao et al., OSDI'21, §3.2, which fits
    it beside the step time).
    """
    u0, u1, u7 = (min(float(v), 700.0) for v in (u[0], u[1], u[7]))
    compute, f, p, w, log_g = _compute(u0, u1, u7, rows.log_ratio)
    jac = np.zeros((compute.size, K))
    jac[:, 0] = 1.0
    jac[:, 1] = (w - f) / p
    if abs(u7) < LOG_POWER_MAX:
        jac[:, 7] = w * rows.log_ratio - log_g / p
    jac[~np.isfinite(jac)] = 0.0
    return np.log(compute), jac


def stacked_log_compute_time(u: np.ndarray, computes: Sequence[tuple[int, Rows, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`log_compute_time` of every type's compute rows (``(type index, rows, log compute times)``) under
    ``u`` (T, K), in their order (n,), and its Jacobian against the job's type-major coordinates (n, T·K)."""
    u = np.asarray(u, dtype=float).reshape(-1, K)
    size = sum(len(y) for _, _, y in computes)
    values, jac = np.empty(size), np.zeros((size, u.size))
    at = 0
    for k, rows, y in computes:
        values[at:at + len(y)], jac[at:at + len(y), K * k:K * (k + 1)] = log_compute_time(u[k], rows)
        at += len(y)
    return values, jac


UNSCENTED_KAPPA = 1.0  # the unscented transform's κ: sigma points at ±√(K + κ) std, the centre weighted κ / (K + κ)


def sigma_points(mean: np.ndarray, cov: np.ndarray, kappa: float = UNSCENTED_KAPPA) -> tuple[np.ndarray, np.ndarray]:
    """The unscented transform's 2K + 1 sigma points of ``N(mean, cov)`` (2K + 1, K) and their weights (2K + 1,):
    ``mean`` and ``mean ± √(K + κ)`` times the columns of a square root of ``cov`` (Julier & Uhlmann,
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
        u: (T, 8) coordinates per type, in the order of the prior's types.
        rms: RMS of the log residuals of step time at ``u`` (0 without observations).
        n: observations used.
        objective: the minimised ``Σ (log T − y)² / σ² + Σ (log C − y_c)² / σ_c² + |L⁻¹(u − m)|²`` at ``u``
            (twice the negative log posterior, up to a constant).
        compute_rms: RMS of the log residuals of the compute times at ``u`` (0 without them).
        compute_n: compute times used.
        residuals: (n,) log residuals of step time at ``u``, observed minus predicted, in the order of the
            steps' rows.
    """

    u: np.ndarray
    rms: float
    n: int
    objective: float = math.nan
    compute_rms: float = 0.0
    compute_n: int = 0
    residuals: np.ndarray = field(default_factory=lambda: np.zeros(0))


def fit_map(
    steps: Sequence[tuple[int, Rows, np.ndarray]],
    prior_mean: np.ndarray,
    prior_chol: np.ndarray,
    noise_std: float | np.ndarray,
    initial: np.ndarray | None = None,
    starts: Sequence[np.ndarray] = (),
    computes: Sequence[tuple[int, Rows, np.ndarray]] = (),
    compute_noise_std: float | np.ndarray | None = None,
) -> MapFit:
    """Maximum a posteriori ``u`` of a job on T types under the Gaussian prior N(prior_mean, L Lᵀ).

    Args:
        steps: per type with observations, ``(type index, rows, log step times)``.
        prior_mean: (T, 8).
        prior_chol: (8T, 8T) lower Cholesky factor L of the prior covariance (type-major order).
        noise_std: std of a log step time around the model (the likelihood's scale), or one per step time (in
            the order of ``steps``' rows: a Student-t noise's scale mixture, :mod:`goodput.posterior`).
        initial: (T, 8) starting point (default: the prior mean).
        starts: further (T, 8) starting points; the optimum with the lowest objective wins. Pollux's soft
            maximum makes the posterior multimodal: one step that includes synchronisation is explained by
            a larger compute or a larger sync, and a local search settles in the basin nearest its start.
        computes: per type, ``(type index, rows, log compute times)`` of steps on several replicas whose sync
            was measured (:func:`log_compute_time`): they split such a step between compute and sync, which
            its step time alone leaves to the prior.
        compute_noise_std: std σ_c of a log compute time around the model, or one per compute time (in the
            order of ``computes``' rows; ``None``: ``noise_std``, its smallest where one per step time).

    Minimises ``Σ (log T − y)² / σ² + Σ (log C − y_c)² / σ_c² + |L⁻¹(u − m)|²`` by Levenberg–Marquardt (MINPACK via
    :func:`scipy.optimize.leastsq`), the prior as pseudo-observations, over the whitened ``z = L⁻¹(u − m)``.
    """
    mean = np.asarray(prior_mean, dtype=float)
    num_types = mean.shape[0]
    dim = num_types * K
    n_steps = sum(len(y) for _, _, y in steps)
    sigma = np.maximum(np.broadcast_to(np.asarray(noise_std, dtype=float), (n_steps,)), 1e-4)
    y_c = np.concatenate([y for _, _, y in computes]) if computes else np.zeros(0)
    n_computes = y_c.size
    sigma_c = np.maximum(np.broadcast_to(max(float(np.min(noise_std, initial=np.inf)), 1e-4) if compute_noise_std is None
                                         else np.asarray(compute_noise_std, dtype=float), (n_computes,)), 1e-4)
    n_rows = n_steps + n_computes

    # The search runs in the prior's whitened coordinates z = L⁻¹(u − m), u = m + L z: the prior's term is |z|², and a
    # ridge that the data leave to a correlated prior (an inter-node constant against its growth, seen at one
    # replica count) is no longer a narrow valley for Levenberg–Marquardt to crawl along (one fit had spent 5000
    # evaluations there, 1.6 s, for 2e-3 of objective: tests/test_model.py)
    center, eye = mean.ravel(), np.eye(dim)

    def to_u(z: np.ndarray) -> np.ndarray:
        return center + prior_chol @ z

    def to_z(u: np.ndarray) -> np.ndarray:
        return scipy.linalg.solve_triangular(prior_chol, np.asarray(u, dtype=float).ravel() - center, lower=True)

    def residuals(z: np.ndarray) -> np.ndarray:
        flat = to_u(z)
        u = flat.reshape(num_types, K)
        parts = [z]
        row = 0
        for k, rows, y in steps:
            parts.append((log_step_time(u[k], rows, jacobian=False)[0] - y) / sigma[row:row + len(y)])
            row += len(y)
        if computes:
            parts.append((stacked_log_compute_time(u, computes)[0] - y_c) / sigma_c)
        return np.concatenate(parts)

    def jacobian(z: np.ndarray) -> np.ndarray:
        u = to_u(z).reshape(num_types, K)
        jac_u = np.zeros((n_rows, dim))
        row = 0
        for k, rows, y in steps:
            jac_u[row:row + len(y), k * K:(k + 1) * K] = log_step_time(u[k], rows)[1] / sigma[row:row + len(y), None]
            row += len(y)
        if computes:
            jac_u[row:] = stacked_log_compute_time(u, computes)[1] / sigma_c[:, None]
        return np.concatenate([eye, jac_u @ prior_chol])

    def evaluated(z: np.ndarray) -> tuple[float, np.ndarray]:
        """The objective at ``z`` (inf where not finite) and its stacked residuals."""
        stacked = residuals(z)
        value = float(np.sum(stacked**2))
        return (value if math.isfinite(value) else math.inf), stacked

    first = to_z(mean if initial is None else initial)
    best, (best_value, best_residuals) = first, evaluated(first)
    found_any = False
    for start in [first, *(to_z(s) for s in starts)] if n_steps else []:
        # MINPACK's lmder with least_squares(method="lm")'s settings, through leastsq: the same iterates without
        # least_squares' wrappers (a third of a small fit's time)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "reached maxfev" and the like: the point is checked below
            found, _ = scipy.optimize.leastsq(residuals, start, Dfun=jacobian, ftol=1e-10, xtol=1e-10, gtol=1e-10,
                                              maxfev=200 * (dim + 1), factor=100.0)
        value, stacked = evaluated(found) if np.all(np.isfinite(found)) else (math.inf, None)
        if math.isfinite(value) and (not found_any or value < best_value):
            best, best_value, best_residuals, found_any = found, value, stacked, True
    best = to_u(best)
    r = best_residuals[dim:dim + n_steps] * sigma  # the log residuals of step time at the optimum
    r_c = best_residuals[dim + n_steps:] * sigma_c  # and of compute time
    return MapFit(best.reshape(num_types, K), float(np.sqrt(np.mean(r**2))) if r.size else 0.0, int(r.size), best_value,
                  float(np.sqrt(np.mean(r_c**2))) if r_c.size else 0.0, int(r_c.size), -r)
