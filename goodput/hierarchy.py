"""The prior over a job's Pollux parameters on every GPU type, and what other jobs on the cluster teach it.

In the coordinates ``u`` of :mod:`goodput.parametric` (log compute and sync
costs, the network's premium, the growth ratios, the overlap), job *j* on GPU
type *t* has

    u[j, t] = m[t] + a[j] + e[j, t],     a[j] ~ N(0, A),   e[j, t] ~ N(0, diag(E))

a two-way random-effects model (Gelman & Hill, *Data Analysis Using Regression
and Multilevel/Hierarchical Models*, 2007, ch. 13): ``m[t]`` is the typical
job on type *t*; ``a[j]`` is the job's own effect, shared by all its types (a
larger model computes more and synchronises more bytes everywhere; ``A`` is
block-diagonal over the compute pair and the sync (its constants, the
inter-node growth and the overlap, which move together across jobs),
:data:`BLOCKS`, and zero on the intra-node growth, which the node's
topology sets: :data:`NO_JOB_EFFECT`); and ``e[j, t]`` is
what is particular to the job on that type. Every source of
evidence enters through this one prior and the job's own likelihood
(:mod:`goodput.posterior`): its observations on a type inform ``m + a + e``
there, and through ``a`` its other types; other jobs inform ``m``, ``A`` and
``E``. Nothing is borrowed by a rule, so more evidence can only move the
posterior toward it.

:class:`ClusterPrior` learns ``m``, ``A`` and ``E`` from the cluster's other
jobs by empirical Bayes: each (job, type) is summarised by the maximum a
posteriori coordinates under a weak prior and the information of its data
(:class:`~goodput.cells.CellSummary`, a Laplace approximation of its likelihood, so a job that
never ran multi-GPU on a type says nothing about its sync there), and EM
(Dempster, Laird & Rubin, *JRSS B* 39, 1977) maximises the marginal
likelihood, with ``A`` and ``E`` shrunk toward the weak defaults by
:data:`PRIOR_WEIGHT` pseudo-jobs (conjugate inverse-Wishart / inverse-gamma),
the jobs' effects Student-t (:data:`EFFECT_DOF`; A's M-step in the parameter-expanded form of Liu, Rubin & Wu,
*Biometrika* 85, 1998, so the weights tell jobs apart without rescaling A),
and each type's mean toward the mean over types (what a type the cluster has
not run multi-GPU on takes), itself integrated out under the weak default's
spread (:data:`TYPE_LEVEL_STD`). How far the types' means spread around it is
learned per coordinate too (one-way random effects, :data:`TYPE_MEAN_WEIGHT`
pseudo-types at :data:`TYPE_MEAN_STD`): a cluster of a CPU and a GPU whose
steps are launch-bound differs in its share of per-sample work by far more
than GPU types do, and a fixed spread made the jobs' own types absorb it.
A job's prior on its types ``t1 … tT`` is then
``N(m[t], A + δ(t, t')·(diag(E) + V[t]))`` with ``V[t]`` the uncertainty of
``m[t]``. Without a cluster, weak defaults (:data:`DEFAULT_SHARED_STD`,
:data:`DEFAULT_TYPE_STD`) around means read off the job's own compute.

A job's size (its trainable parameters) moves ``m[t]`` by slopes learned
from the cluster (:data:`SIZE_SLOPE_PRIOR`: sync ∝ gradient bytes); a job that
does not report one gets one read off its 1-GPU compute
(:func:`one_gpu_log_proxy`), with that guess's error in its prior.

Where the cluster's jobs share a shape of inter-node sync over placements,
the prior also learns it per type (:mod:`goodput.sync_shape`).

Example::

    prior = ClusterPrior.from_observations(other_jobs_observations)   # {job: [Observation]}
    prior.save("cluster-prior.json")                                   # atomic JSON
    model = JobModel("new-job", init_batch_size=128, cluster_prior=ClusterPrior.load("cluster-prior.json"))
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .cells import (DEFAULT_SHARED_STD, DEFAULT_TYPE_STD, CellSummary, compute_rows, default_means, default_means_by_type,
                    default_prior, default_shared_cov, one_gpu_log_proxy, shared_plus_own, step_rows, summarize_cell,
                    summarize_with_residuals)
from .errors import DataFormatError, ValidationError
from .io import atomic_write_text, read_json
from .gp import HyperPrior, config_features
from .gp_fit import fit_shared_hyperparameters
from .observations import Observation, by_gpu_type
from .parametric import COORDS, K, reference_bsz
from .sync_shape import SyncShape, learn_sync_shape
from .tails import DEFAULT_NOISE_DOF, fit_noise_dof
from .threads import single_threaded
from .validation import check_sizes, is_collection, normalize_gpu_type

__all__ = ["CellSummary", "ClusterPrior", "default_means", "default_means_by_type", "default_prior", "summarize_cell", "step_rows", "compute_rows", "DEFAULT_SHARED_STD",
           "DEFAULT_TYPE_STD", "EFFECT_DOF", "BLOCKS", "NO_JOB_EFFECT", "SCALE_BLOCKS", "SCALE_BLOCK_NAMES"]

# The weak defaults of A and E (a job's prior without a cluster, the pull on the EM's estimates) are in
# goodput.cells, beside the cell fits made under them. The figures behind each choice below are in
# experiments/results/accuracy.md (history and probes).
CORRELATION_WEIGHT = 10.0
# Which coordinates a job's shared effect couples (A is block-diagonal over these): compute, and the sync
# (the constants, the inter-node growth ratio, the overlap). A job's compute says little about its sync
# beyond what its size says (an architecture's FLOPs per byte vary by orders of magnitude: Pollux's ncf is
# host-bound). Within the sync, a job's coordinates move together: a latency-bound job (few bytes) has small
# constants that grow fast per replica, a bandwidth-bound one overlaps more of its larger sync with compute;
# single-node steps pin combinations of them, not each one. Their correlations are learned, shrunk toward
# independence (CORRELATION_WEIGHT pseudo-jobs), the constants' toward SYNC_CORRELATION.
BLOCKS = ((0, 1, 7), (2, 3, 5, 6))
# Coordinates without a job effect (A's variance held at DEFAULT_SHARED_STD², i.e. none): how a job's
# intra-node sync grows per extra GPU is set by the node's topology (PCIe switches, NVLink rings) as much as
# by the job, so it is learned per type (m[t], E[t]); the network between nodes is the cluster's, so the
# inter-node growth keeps its job effect. Single-node steps trade the intra-node growth against the sync
# constant and the overlap, so with a job effect one type's single-node steps moved the job's other types
# along that ridge.
NO_JOB_EFFECT = tuple(c for c in range(K) if not any(c in block for block in BLOCKS))
_BLOCK_MASK = np.zeros((K, K), dtype=bool)
for _block in BLOCKS:
    _BLOCK_MASK[np.ix_(_block, _block)] = True
_SYNC = np.array(next(block for block in BLOCKS if 2 in block))  # the sync's block of A
# Model size: a job's sync constants grow with its gradient bytes (slope 1 in log), its compute with its
# FLOPs (about half that, across architectures); the slopes are learned from the cluster around these, within
# SIZE_SLOPE_STD. The inter-node constant α_n is an all-reduce of the gradient over the network, bandwidth-bound,
# so its slope is held within 0.2 of 1: a cluster's few jobs reach its sizes' ends with jobs that are not
# typical (Pollux's host-bound ncf at the small end), and a new job at an end takes the slope's error times its
# distance. α_r's stays within 0.5: a single node shows little of its sync (it overlaps the backward), so its
# constant is read together with the overlap, not off the bytes alone.
SIZE_SLOPE_PRIOR = np.array([0.5, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
SIZE_SLOPE_STD = np.array([0.5, 0.5, 0.5, 0.2, 0.5, 0.5, 0.5, 0.5])
# A job that does not report its size gets one read off its 1-GPU compute (one_gpu_log_proxy): the optimizer
# step and the backward's per-parameter work do not grow with the batch, so the per-step compute α_c tracks the
# parameters, and the compute c at the smallest batch the FLOPs; the proxy is their geometric mean √(α_c·c), α_c
# at least SIZE_PROXY_FLOOR of c. It moves the sync constants alone, and where no job's size is known both
# constants by one slope (held together within SIZE_SLOPE_TIE: the same gradient bytes cross both
# interconnects). log size − log proxy spreads 0.35 over Pollux's six bundled models (T4) and 0.75 over
# Gavel's five (K80): SIZE_PROXY_STD is the error an imputed size carries, one pseudo-job's worth beside the
# spread the cluster's sized jobs show.
SIZE_PROXY_STD = 0.5
SIZE_SLOPE_TIE = 0.01

TYPE_MEAN_STD = 1.5  # weak default spread of a coordinate's type means around their mean over types (m[t] shrinkage)
# ... learned per coordinate by the EM, the default counting for this many types (with one type it stays):
# a CPU and a GPU whose steps are launch-bound differ in their share of per-sample work (logit f) by ±4–5,
# which a fixed 1.5 pushed into the job × type effects.
TYPE_MEAN_WEIGHT = 1.0
# The mean over types itself is not known before the cluster is seen: its prior is the weak default's
# spread of one job's coordinate on a type (√(DEFAULT_SHARED_STD² + DEFAULT_TYPE_STD²)) around the cells'
# mean, integrated out with the type means (Gelman et al., *Bayesian Data Analysis*, 3rd ed., §5.4: the
# hierarchical normal model's population mean). Plugged in at the cells' mean, the level used the data twice
# (one job's effects sat at zero by construction and A shrank); a flat level left a coordinate that no cell
# informs (a cluster that ran 1 GPU only: its sync) at e^±10.
TYPE_LEVEL_STD = np.sqrt(DEFAULT_SHARED_STD**2 + DEFAULT_TYPE_STD**2)
PRIOR_WEIGHT = 0.1  # pseudo-jobs (and pseudo-cells) the weak defaults of A and E count for in the EM
EM_ITERATIONS = 60
# Degrees of freedom of the jobs' effects (multivariate Student-t, as a scale mixture of normals): a job
# far from the others (Pollux's host-bound ncf) is down-weighted in the cluster's estimates and widens only
# its own prior, so the typical job's is not stretched to cover it.
EFFECT_DOF = 4.0
# The groups of coordinates that share one Student-t scale, read off BLOCKS: A's blocks (the intra-node growth,
# which has no job effect, joins the sync). Under A a job's compute and sync are independent, so a job odd in one
# (Pollux's host-bound ncf, in compute) is down-weighted in that one only and its sync still informs the cluster's.
SCALE_BLOCKS = tuple(tuple(sorted(block + (NO_JOB_EFFECT if 2 in block else ()))) for block in BLOCKS)  # ((0, 1, 7), (2, 3, 4, 5, 6))
SCALE_BLOCK_NAMES = ("compute", "sync")
# Pseudo-cells of the pooled E in each type's E: half a cell, a weak default like PRIOR_WEIGHT's. How far a
# job strays on one type from its others is the type's (its topology, its interconnect): on Gavel the spread
# of α_n is 0.33 in log on P100 and 0.94 on K80.
TYPE_SHRINKAGE = 0.5


@dataclass
class _Fitted:
    """The EM's estimates: type means and size slopes (jointly normal), A, E."""

    types: list[str]
    beta: np.ndarray  # (KT [+ K],) posterior mean of the type means m[t] (type-major) and, with sizes, the size slopes
    beta_cov: np.ndarray  # its covariance
    shared: np.ndarray  # (K, K) A
    particular: np.ndarray  # (T, K) E per type
    size_center: float | None  # mean log size of the jobs (imputed ones too; None: no size slopes)
    size_var: float  # variance of their log sizes
    job_weights: dict[str, tuple[float, ...]] = field(default_factory=dict)  # each job's scale weight per SCALE_BLOCKS
    type_mean_var: np.ndarray = field(default_factory=lambda: np.full(K, TYPE_MEAN_STD**2))  # (K,) learned spread² of m[t]
    imputation: _SizeImputation | None = None  # how a job that reports no size gets one (None: no cells)
    sized: bool = True  # some job's size is known (else every size is imputed, and moves the sync constants alone)
    level_mean: np.ndarray = field(default_factory=lambda: np.zeros(K))  # (K,) the type means' level's prior mean (the cells' mean)

    def particular_of(self, gpu: str) -> np.ndarray:
        """E of a type (a type not in the cluster: the mean over its types)."""
        return self.particular[self.types.index(gpu)] if gpu in self.types else self.particular.mean(axis=0)

    def unseen_type(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """How a type the cluster has not run is placed, per coordinate (K,) each: m* = level + δ* with the level given
        the type means m[t], N(w·m̄ + (1 − w)·μ, v), ``v = 1 / (T/τ² + 1/L²)``, ``w = v·T/τ²`` (L: TYPE_LEVEL_STD, μ
        the level's prior mean), and δ* ~ N(0, τ²): returns ``w``, ``(1 − w)·μ`` and ``v`` (which every unseen
        type shares, as it shares the level)."""
        level_var = 1.0 / (len(self.types) / self.type_mean_var + 1.0 / TYPE_LEVEL_STD**2)
        shrink = level_var * len(self.types) / self.type_mean_var
        return shrink, (1.0 - shrink) * self.level_mean, level_var

    def design(self, gpu: str, log_size: float | None, imputed: bool = False) -> np.ndarray:
        """(K, β's size): the prior mean of a job's ``u`` on ``gpu`` is this times β, m[t] + B·(log size − center)
        (a type not in the cluster: the shrunk mean over its types, :meth:`unseen_type`, whose offset the caller
        adds; an imputed size moves the sync constants alone, :data:`SIZE_PROXY_FLOOR`'s comment)."""
        rows = np.zeros((K, self.beta.size))
        if gpu in self.types:
            k = self.types.index(gpu)
            rows[:, K * k:K * (k + 1)] = np.eye(K)
        else:
            shrink = np.diag(self.unseen_type()[0]) / len(self.types)
            for k in range(len(self.types)):
                rows[:, K * k:K * (k + 1)] = shrink
        if self.size_center is not None and log_size is not None:
            rows[:, K * len(self.types):] = (log_size - self.size_center) * _size_covariate(imputed)
        return rows

    def size_cov(self, log_size: float | None, imputed: bool) -> np.ndarray:
        """(K, K) what an unknown (or imputed) size adds to the covariance of a job's ``u`` on any two of its types:
        B·ε with ε its log size's error, var(ε)·(b bᵀ + cov B) (the same job's size on every type)."""
        if self.size_center is None or (log_size is not None and not imputed):
            return np.zeros((K, K))
        slopes = slice(K * len(self.types), K * (len(self.types) + 1))
        b = self.beta[slopes]
        spread = np.outer(b, b) + self.beta_cov[slopes, slopes]
        masked = spread * np.outer(_PROXY_COVARIATE, _PROXY_COVARIATE)
        if log_size is None:
            return self.size_var * (spread if self.sized else masked)
        assert self.imputation is not None
        return self.imputation.var * masked


_PROXY_COVARIATE = np.array([1.0 if c in (2, 3) else 0.0 for c in range(K)])  # an imputed size moves the sync constants alone


def _size_covariate(imputed: bool) -> np.ndarray:
    """(K, K) which coordinates a job's log size moves (times their slopes): all of them, or, imputed, the sync constants."""
    return np.diag(_PROXY_COVARIATE if imputed else np.ones(K))


def _cell_proxies(cells: Sequence[CellSummary]) -> dict[str, float]:
    """One job's :attr:`CellSummary.log_proxy` per type, where it has one."""
    return {c.gpu_type: c.log_proxy for c in cells if c.log_proxy is not None}



def log_size_proxies(observations: Mapping[str, Sequence[Observation]]) -> dict[str, float]:
    """:func:`one_gpu_log_proxy` of a job on each of its types that has one, for :meth:`ClusterPrior.prior`'s ``proxies``."""
    proxies = {gpu: one_gpu_log_proxy(list(obs)) for gpu, obs in observations.items()}
    return {gpu: value for gpu, value in proxies.items() if value is not None}


@dataclass(frozen=True)
class _SizeImputation:
    """A job's log size from its :func:`one_gpu_log_proxy` on each type: ``offset`` + the mean over its types of
    the proxy less the cluster's mean there (``levels``), a slope of one (log size − log proxy: ``offset`` the
    sized jobs' mean, 0 when none is sized and the proxy stands for the size); ``var``: the error's variance,
    the sized jobs' spread around it with one pseudo-job at :data:`SIZE_PROXY_STD`."""

    levels: dict[str, float]
    offset: float
    var: float

    @classmethod
    def of(cls, jobs: Mapping[str, Sequence[CellSummary]]) -> _SizeImputation:
        proxies = {job: _cell_proxies(cells) for job, cells in jobs.items()}
        per_type: dict[str, list[float]] = {}
        for values in proxies.values():
            for gpu, value in values.items():
                per_type.setdefault(gpu, []).append(value)
        levels = {gpu: float(np.mean(values)) for gpu, values in per_type.items()}
        relative = {job: float(np.mean([v - levels[g] for g, v in values.items()])) for job, values in proxies.items() if values}
        known = np.array([math.log(cells[0].size) - relative[job] for job, cells in jobs.items() if cells[0].size and job in relative])
        offset = float(np.mean(known)) if known.size else 0.0
        # the sized jobs' spread around the proxy, with one pseudo-job at SIZE_PROXY_STD (none sized: that alone)
        return cls(levels, offset, (SIZE_PROXY_STD**2 + float(np.sum((known - offset) ** 2))) / max(known.size, 1))

    def log_size(self, proxies: Mapping[str, float] | None) -> float | None:
        """The imputed log size of a job with these :func:`one_gpu_log_proxy` per type (``None``: none on a type here)."""
        shared = [v - self.levels[g] for g, v in (proxies or {}).items() if g in self.levels and math.isfinite(v)]
        return self.offset + float(np.mean(shared)) if shared else None


@dataclass
class _JobGroup:
    """The EM's fixed inputs of the jobs with the same number of cells, stacked (B jobs, n cells each): in the
    z-space of a job's effects (a, e_1 … e_n), the data's information (each cell's ``info`` H_c: it enters
    the (a, a), (a, e_c), (e_c, a) and (e_c, e_c) blocks), the image ``f`` of the type means and size
    slopes (Σ Gᵀ H P) and ``g`` (Σ Gᵀ H û)."""

    jobs: np.ndarray  # (B,) positions of the jobs
    cell_types: np.ndarray  # (B, n) type index of each cell
    info: np.ndarray  # (B, n, K, K)
    f: np.ndarray  # (B, K(n+1), dim)
    g: np.ndarray  # (B, K(n+1))
    fg: np.ndarray = field(init=False, repr=False)  # f and g side by side, (B, K(n+1), dim + 1)

    def __post_init__(self) -> None:
        self.fg = np.concatenate([self.f, self.g[:, :, None]], axis=2)

    def precision_solver(self, weights: np.ndarray, inv_shared: np.ndarray, particular: np.ndarray) -> _ArrowSolve:
        """The jobs' posterior precision of (a, e_1 … e_n), ``H + W·blockdiag(A⁻¹, E_1⁻¹ … E_n⁻¹)``, factorised;
        ``weights`` (B, K): each job's scale weight per coordinate, constant within each of :data:`SCALE_BLOCKS`
        (A is block-diagonal over them, so ``W^½ A⁻¹ W^½`` scales each block of A⁻¹ by its weight)."""
        root = np.sqrt(weights)
        return _ArrowSolve.of(self.info, root[:, :, None] * inv_shared * root[:, None, :],
                              weights[:, None, :] / particular[self.cell_types])


@dataclass
class _ArrowSolve:
    """Solves with a batch of "arrow" matrices [[Σ_c H_c + P_a, H_1 … H_n], [H_c, H_c + D_c] …] (K×K blocks,
    D_c diagonal) by eliminating the cells' blocks: the Schur complement S = P_a + Σ_c (H_c − H_c M_c⁻¹ H_c)
    with M_c = H_c + D_c. Only K×K matrices are inverted, not the (K(n+1))² whole."""

    m_inv: np.ndarray  # (B, n, K, K) M_c⁻¹
    p: np.ndarray  # (B, n, K, K) M_c⁻¹ H_c
    s_inv: np.ndarray  # (B, K, K) S⁻¹

    @classmethod
    def of(cls, info: np.ndarray, prec_a: np.ndarray, prec_e: np.ndarray) -> _ArrowSolve:
        m = info.copy()
        m[..., np.arange(K), np.arange(K)] += prec_e
        m_inv = np.linalg.inv(m)
        p = m_inv @ info
        s = prec_a + (info - info @ p).sum(axis=1)
        return cls(m_inv, p, np.linalg.inv(s))

    def solve(self, v: np.ndarray) -> np.ndarray:
        """x with (arrow) x = v, for ``v`` (B, K(n+1), d)."""
        b, n = self.p.shape[:2]
        v_a, v_c = v[:, :K], v[:, K:].reshape(b, n, K, -1)
        x_a = self.s_inv @ (v_a - (self.p.transpose(0, 1, 3, 2) @ v_c).sum(axis=1))  # H_c M_c⁻¹ = P_cᵀ
        x_c = self.m_inv @ v_c - self.p @ x_a[:, None]
        return np.concatenate([x_a, x_c.reshape(b, n * K, -1)], axis=1)

    def cell_variances(self) -> np.ndarray:
        """The diagonals of the inverse's cell blocks, M_c⁻¹ + P_c S⁻¹ P_cᵀ: (B, n, K)."""
        return np.diagonal(self.m_inv, axis1=2, axis2=3) + ((self.p @ self.s_inv[:, None]) * self.p).sum(axis=3)


def _job_groups(jobs: Mapping[str, Sequence[CellSummary]], index: Mapping[str, int], dim: int, dim_m: int,
                log_sizes: Mapping[str, float], center: float | None,
                imputed: frozenset[str] = frozenset()) -> tuple[list[_JobGroup], np.ndarray, np.ndarray]:
    """The EM's fixed inputs per group of jobs with as many cells, and the data's part of the type means'
    information and linear term (Σ Pᵀ H P, Σ Pᵀ H û over every cell)."""
    lam, eta = np.zeros((dim, dim)), np.zeros(dim)
    by_size: dict[int, list[tuple[int, list[int], np.ndarray, np.ndarray, np.ndarray]]] = {}
    for position, (job, job_cells) in enumerate(jobs.items()):
        n = len(job_cells)
        size = K * (n + 1)
        f, g = np.zeros((size, dim)), np.zeros(size)
        s_j = log_sizes[job] - center if center is not None and job in log_sizes else 0.0
        covariate = s_j * _size_covariate(job in imputed)
        for c_i, c in enumerate(job_cells):
            e = slice(K * (c_i + 1), K * (c_i + 2))
            design = np.zeros((K, dim))  # P_c: u_c = P_c β + a + e
            design[:, K * index[c.gpu_type]:K * (index[c.gpu_type] + 1)] = np.eye(K)
            if center is not None:
                design[:, dim_m:] = covariate
            hp, hu = c.info @ design, c.info @ c.u
            f[:K] += hp
            f[e] += hp
            g[:K] += hu
            g[e] += hu
            lam += design.T @ hp
            eta += design.T @ hu
        by_size.setdefault(n, []).append((position, [index[c.gpu_type] for c in job_cells],
                                          np.stack([c.info for c in job_cells]), f, g))
    groups = [_JobGroup(np.array([m[0] for m in members]), np.array([m[1] for m in members]),
                        np.stack([m[2] for m in members]), np.stack([m[3] for m in members]),
                        np.stack([m[4] for m in members]))
              for n, members in sorted(by_size.items())]
    return groups, lam, eta


def _fit_hierarchy(cells: Sequence[CellSummary], iterations: int = EM_ITERATIONS) -> _Fitted:
    """EM for A and E (module docstring) on the cells' Laplace likelihoods, the type means and size slopes integrated out.

    The type means get a N(level, τ²) prior around a level of their own, N(μ, :data:`TYPE_LEVEL_STD`²)
    around the mean of the cells' coordinates (integrated out), τ² per coordinate learned by the M-step of a
    one-way random-effects model from the means' posterior moments about their average over types, with
    :data:`TYPE_MEAN_WEIGHT` pseudo-types at :data:`TYPE_MEAN_STD` (Gelman et al., *Bayesian Data Analysis*,
    3rd ed., §5.4),
    the size slopes (when a job reports its size; with one, the prior alone places other sizes) N(:data:`SIZE_SLOPE_PRIOR`, :data:`SIZE_SLOPE_STD`²).
    Each job's effects are marginalised to give their information on those (a Schur complement), so they
    are the generalised-least-squares estimates for the current A and E (with one type, jobs' effects and
    the type's mean are told apart only so), and the E-step's moments carry their uncertainty.
    """
    types = sorted({c.gpu_type for c in cells})
    index = {t: i for i, t in enumerate(types)}
    jobs: dict[str, list[CellSummary]] = {}
    for c in cells:
        jobs.setdefault(c.job, []).append(c)
    imputation = _SizeImputation.of(jobs) if jobs else None
    log_sizes = {job: math.log(cs[0].size) for job, cs in jobs.items() if cs[0].size}
    imputed = frozenset(job for job in jobs if job not in log_sizes)
    if imputation is not None:
        for job in (j for j in jobs if j in imputed):  # in the jobs' order (a set of names iterates as PYTHONHASHSEED says)
            value = imputation.log_size(_cell_proxies(jobs[job]))
            if value is not None:
                log_sizes[job] = value
    center = float(np.mean(list(log_sizes.values()))) if log_sizes else None
    size_var = float(np.var(list(log_sizes.values()))) if center is not None else 0.0
    a0, e0 = default_shared_cov(), DEFAULT_TYPE_STD**2
    sd0 = np.sqrt(np.diag(a0)[_SYNC])
    target = a0[np.ix_(_SYNC, _SYNC)] / np.outer(sd0, sd0)  # the sync's correlations in A's weak default
    shared, particular = a0.copy(), np.tile(e0, (len(types), 1))
    dim_m = K * len(types)
    dim = dim_m + (K if center is not None else 0)
    mu = np.mean([c.u for c in cells], axis=0)
    # m[t] = level + δ[t] per coordinate: δ ~ N(0, τ²) (τ learned below), the level ~ N(mu, TYPE_LEVEL_STD²)
    type_mean_var = np.full(K, TYPE_MEAN_STD**2)
    prior_prec = np.zeros((dim, dim))
    prior_lin = np.zeros(dim)
    _set_type_mean_prior(prior_prec, prior_lin, len(types), mu, type_mean_var)
    if center is not None:
        prior_prec[dim_m:, dim_m:] = np.diag(1.0 / SIZE_SLOPE_STD**2)
        prior_lin[dim_m:] = SIZE_SLOPE_PRIOR / SIZE_SLOPE_STD**2
        if len(imputed) == len(jobs):  # no job's size known: the proxy moves both sync constants alike (the same bytes)
            tie = dim_m + np.array([2, 3])
            prior_prec[np.ix_(tie, tie)] += np.array([[1.0, -1.0], [-1.0, 1.0]]) / SIZE_SLOPE_TIE**2
    beta, beta_cov = np.linalg.solve(prior_prec, prior_lin), np.linalg.inv(prior_prec)
    groups, lam_data, eta_data = _job_groups(jobs, index, dim, dim_m, log_sizes, center, imputed)
    count = np.bincount([index[c.gpu_type] for c in cells], minlength=len(types)).astype(float)
    weights = np.ones((len(jobs), K))  # each job's scale weight per SCALE_BLOCKS (Student-t effects: an odd job widens only its own prior)
    for _ in range(iterations):
        inv_a = np.linalg.inv(shared)
        lam, eta = prior_prec + lam_data, prior_lin + eta_data
        solved = []
        for group in groups:  # the jobs' effects marginalised out, all jobs with as many cells at once
            arrow = group.precision_solver(weights[group.jobs], inv_a, particular)
            solved_fg = arrow.solve(group.fg)  # Q⁻¹ f and Q⁻¹ g at once
            qf, qg = solved_fg[..., :-1], solved_fg[..., -1]
            lam -= np.tensordot(group.f, qf, axes=([0, 1], [0, 1]))
            eta -= np.tensordot(qf, group.g, axes=([0, 1], [0, 1]))
            solved.append((group, arrow, qf, qg))
        beta_cov = np.linalg.inv(0.5 * (lam + lam.T))
        beta = beta_cov @ eta
        if len(types) > 1:
            type_mean_var = _type_mean_spread(beta[:dim_m], beta_cov[:dim_m, :dim_m], len(types))
            _set_type_mean_prior(prior_prec, prior_lin, len(types), mu, type_mean_var)
        sum_aa = np.zeros((K, K))
        sum_ee = np.zeros((len(types), K))
        root_w = np.sqrt(weights)  # the weights the sums below use (the E-step in the loop updates them for the next)
        for group, arrow, qf, qg in solved:
            w = weights[group.jobs]
            z = qg - qf @ beta  # the effects' posterior mean, Q⁻¹ (g − f β)
            qf_a, qf_e = qf[:, :K], qf[:, K:].reshape(group.cell_types.shape + (K, -1))
            cov_a = arrow.s_inv + qf_a @ beta_cov @ qf_a.transpose(0, 2, 1)
            var_e = arrow.cell_variances() + ((qf_e @ beta_cov) * qf_e).sum(axis=3)
            second_a = z[:, :K, None] * z[:, None, :K] + cov_a
            sum_aa += np.sum(np.sqrt(w[:, :, None] * w[:, None, :]) * second_a, axis=0)  # w within a block (A is 0 across)
            second_e = z[:, K:].reshape(group.cell_types.shape + (K,)) ** 2 + var_e
            np.add.at(sum_ee, group.cell_types, w[:, None, :] * second_e)
            # the quadratic form δᵀ Σ⁻¹ δ of each job's effects, per coordinate (A⁻¹'s columns split it by block)
            quad = (second_a * inv_a.T).sum(axis=1) + np.sum(second_e / particular[group.cell_types], axis=1)
            # E-step of the scale mixture (Lange, Little & Taylor, JASA 84, 1989), per block: E[w | data]
            dims = group.cell_types.shape[1] + 1  # a and one e per cell
            for block in SCALE_BLOCKS:
                cols = list(block)
                weights[np.ix_(group.jobs, cols)] = ((EFFECT_DOF + len(cols) * dims) / (EFFECT_DOF + quad[:, cols].sum(axis=1)))[:, None]
        # A's M-step divides the jobs' weighted second moments by their weights, not their number: the update of the
        # parameter-expanded EM for the Student-t (Liu, Rubin & Wu, Biometrika 85, 1998), so the weights
        # down-weight a job far out against the others without rescaling A; at the t's maximum likelihood they
        # average 1 and both updates agree (Kent, Tyler & Vardi, Comm. Stat. Simul. 23, 1994). Here their common
        # level also counts each job's e-dimensions, which had multiplied A (intervals too wide). E keeps its count.
        # One job cannot tell how jobs differ: A stays the default.
        if len(jobs) > 1:
            shared = np.where(_BLOCK_MASK, (PRIOR_WEIGHT * a0 + sum_aa) / (PRIOR_WEIGHT + root_w.T @ root_w), 0.0)
        else:
            shared = a0.copy()
        held = np.array(NO_JOB_EFFECT, dtype=int)
        shared[held, held] = a0[held, held]  # the diagonal held at the default's (near zero): no job effect there
        # the correlations of the sync's job effects: a few jobs hardly estimate them, so the block's
        # correlation matrix is shrunk by CORRELATION_WEIGHT pseudo-jobs toward the weak default's:
        # independence, except the constants' SYNC_CORRELATION, which physics says is strong (the same
        # gradient bytes cross both interconnects): separation strategy (Barnard, McCulloch & Meng,
        # Statistica Sinica 10, 2000); a mean of two correlation matrices is one, so A stays positive definite
        sd = np.sqrt(np.diag(shared))
        scale = np.outer(sd[_SYNC], sd[_SYNC])
        learned = shared[np.ix_(_SYNC, _SYNC)] / scale
        correlation = (CORRELATION_WEIGHT * target + len(jobs) * learned) / (CORRELATION_WEIGHT + len(jobs))
        shared[np.ix_(_SYNC, _SYNC)] = correlation * scale
        # what is particular to a job on a type, per type (one type's data may say less about a job in
        # general than another's), shrunk toward the pooled value by TYPE_SHRINKAGE pseudo-cells
        pooled = (PRIOR_WEIGHT * e0 + sum_ee.sum(0)) / (PRIOR_WEIGHT + len(cells))
        particular = (TYPE_SHRINKAGE * pooled + sum_ee) / (TYPE_SHRINKAGE + count[:, None])
    job_weights = {job: tuple(float(weights[j, block[0]]) for block in SCALE_BLOCKS) for j, job in enumerate(jobs)}
    return _Fitted(types, beta, 0.5 * (beta_cov + beta_cov.T), shared, particular, center, size_var, job_weights,
                   type_mean_var, imputation, len(imputed) < len(jobs), mu)


def _set_type_mean_prior(prior_prec: np.ndarray, prior_lin: np.ndarray, num_types: int, mu: np.ndarray,
                         type_mean_var: np.ndarray) -> None:
    """The type means' prior, in place: m[t] = level + δ[t], δ ~ N(0, diag(τ²)), level ~ N(μ, TYPE_LEVEL_STD²)."""
    dim_m = K * num_types
    prior_prec[:dim_m, :dim_m] = np.linalg.inv(shared_plus_own(num_types, np.diag(TYPE_LEVEL_STD**2), type_mean_var))
    prior_lin[:dim_m] = prior_prec[:dim_m, :dim_m] @ np.tile(mu, num_types)


def _type_mean_spread(means: np.ndarray, cov: np.ndarray, num_types: int) -> np.ndarray:
    """τ² per coordinate (K,): E[Σ_t (m[t] − m̄)²] under the means' posterior (mean ``means``, type-major, and
    covariance ``cov``), over T − 1 degrees of freedom, with TYPE_MEAN_WEIGHT pseudo-types at TYPE_MEAN_STD²."""
    m = means.reshape(num_types, K)
    c = np.einsum("tksk->tsk", cov.reshape(num_types, K, num_types, K))  # cov(m[t, k], m[s, k]): (T, T, K)
    var_dev = np.einsum("ttk->tk", c) - 2.0 / num_types * c.sum(axis=1) + c.sum(axis=(0, 1)) / num_types**2
    second = ((m - m.mean(axis=0)) ** 2 + var_dev).sum(axis=0)
    return (TYPE_MEAN_WEIGHT * TYPE_MEAN_STD**2 + second) / (TYPE_MEAN_WEIGHT + num_types - 1)


@dataclass
class ClusterPrior:
    """What the cluster's other jobs teach a new job's prior (module docstring).

    Build it with :meth:`from_observations` (summarises every (job, GPU type)) or
    :meth:`from_models` (other :class:`~goodput.model.JobModel`\\ s); save/load
    it as JSON. :meth:`exclude` drops a job (leave-one-out evaluation).
    """

    summaries: list[CellSummary] = field(default_factory=list)
    shapes: dict[str, SyncShape] = field(default_factory=dict)
    # the residual GP's typical hyperparameters on this cluster (goodput.gp_fit.fit_shared_hyperparameters of
    # every cell's residuals around its fit, a job's types one multitask process): a new job's GP prior
    gp_prior: HyperPrior | None = None
    # the jobs' observations when built from them (not saved): exclude() relearns the shapes without a job
    observations: dict[str, list[Observation]] | None = field(default=None, repr=False, compare=False)
    sizes: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    _fitted: _Fitted | None = field(default=None, init=False, repr=False, compare=False)
    _excluded: dict[str, ClusterPrior] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for index, item in enumerate(self.summaries):
            if not isinstance(item, CellSummary):
                raise ValidationError(f"summaries[{index}]", item, "expected a CellSummary")

    # ------------------------------------------------------------------ construction
    @classmethod
    @single_threaded
    def from_observations(cls, observations: Mapping[str, Iterable[Observation]],
                          sizes: Mapping[str, float] | None = None, *, gp_prior: bool = True) -> ClusterPrior:
        """Summarise every (job, GPU type) of ``{job: observations}``, each type's sync shape learned first.

        ``gp_prior=False`` skips fitting the residual GP's shared hyperparameters (:attr:`gp_prior` stays
        ``None``): for a caller that keeps only the :attr:`summaries` (e.g. one finished job's, added to a
        rolling window)."""
        kept, sizes = _checked_observations(observations), check_sizes("sizes", sizes, allow_unknown=True)
        shapes = _learn_shapes(kept)
        cells, residuals, cell_residuals = [], [], []
        for job, obs in kept.items():
            ref = reference_bsz(obs)
            features, values, types = [], [], []
            for k, (gpu, items) in enumerate(sorted(by_gpu_type(obs).items())):
                cell, rows, residual = summarize_with_residuals(job, gpu, items, ref, shapes.get(gpu), sizes.get(job))
                cells.append(cell)
                features.append(config_features(rows.nodes, rows.replicas, rows.bsz, rows.accum))
                values.append(residual)
                cell_residuals.append(residual)
                types.append(np.full(residual.size, k))
            residuals.append((np.concatenate(features), np.concatenate(values), np.concatenate(types)))  # one process per job
        hyper = fit_shared_hyperparameters(residuals) if gp_prior else None  # None: too few points, or the fit failed
        if hyper is not None:  # the noise's tails, from every cell's residuals around its own fit (goodput.tails)
            hyper = replace(hyper, noise_dof=fit_noise_dof(cell_residuals, default=DEFAULT_NOISE_DOF))
        return cls(cells, shapes=shapes, gp_prior=hyper,
                   observations=kept,
                   sizes={k: v for k, v in sizes.items() if v is not None})

    @classmethod
    def from_models(cls, models: Iterable[Any]) -> ClusterPrior:
        """The prior of other jobs' :class:`~goodput.model.JobModel` s (their observations and sizes)."""
        models = list(models)
        for index, model in enumerate(models):
            if not isinstance(getattr(model, "job", None), str) or not hasattr(model, "observations"):
                raise ValidationError(f"models[{index}]", model, "expected a JobModel (with .job and .observations)")
        return cls.from_observations({m.job: list(m.observations) for m in models},
                                     sizes={m.job: getattr(m, "model_size", None) for m in models})

    def exclude(self, job: str) -> ClusterPrior:
        """The prior without ``job``'s summaries (and, when built from observations, its sync shapes relearned without it)."""
        if job not in self.jobs:
            return self
        if job not in self._excluded:  # memoised: a harness asks once per protocol
            if self.observations is not None:
                self._excluded[job] = ClusterPrior.from_observations({j: o for j, o in self.observations.items() if j != job},
                                                                    {j: s for j, s in self.sizes.items() if j != job})
            else:
                self._excluded[job] = ClusterPrior([c for c in self.summaries if c.job != job], shapes=dict(self.shapes),
                                                   gp_prior=self.gp_prior)
        return self._excluded[job]

    # ------------------------------------------------------------------ what a job takes
    def fitted(self) -> _Fitted:
        if self._fitted is None:
            self._fitted = _fit_hierarchy(self.summaries)
        return self._fitted

    def prior(self, types: Sequence[str], size: float | None = None,
              proxies: Mapping[str, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Mean (T, 8) and covariance (8T, 8T) of a new job's coordinates on ``types`` (module docstring);
        ``size``: its trainable parameters, when known (the cluster's size slopes place it); else ``proxies``
        (:func:`log_size_proxies` of its observations) give it one from its 1-GPU compute (:data:`SIZE_PROXY_FLOOR`'s
        comment), with that guess's error; with neither, its size is averaged over the cluster's. On a cluster none of
        whose jobs reports its size, the sizes' centre and slopes are on the proxy's scale, where a parameter count
        has no place: ``size`` is then left out and ``proxies`` place the job."""
        fit = self.fitted()
        size = size if fit.sized else None
        imputed = not size
        log_size = math.log(size) if size else (fit.imputation.log_size(proxies) if fit.imputation is not None else None)
        num = len(types)
        rows = np.concatenate([fit.design(t, log_size, imputed) for t in types])
        mean = (rows @ fit.beta).reshape(num, K)
        # the type means' (and slopes') estimates are shared by the job's types, and so are its effect and its size
        cov = rows @ fit.beta_cov @ rows.T + np.kron(np.ones((num, num)), fit.shared + fit.size_cov(log_size, imputed))
        _, offset, level_var = fit.unseen_type()
        unseen = np.array([t not in fit.types for t in types])
        mean[unseen] += offset
        # unseen types share the level given the type means, and each has its own deviation from it
        cov += np.kron(np.outer(unseen, unseen), np.diag(level_var))
        for i, t in enumerate(types):
            block = slice(K * i, K * (i + 1))
            cov[block, block] += np.diag(fit.particular_of(t) + (fit.type_mean_var if unseen[i] else 0.0))
        return mean, 0.5 * (cov + cov.T)

    def describe(self) -> dict[str, Any]:
        """The fitted hierarchy, for diagnostics: per-coordinate std of the type means, of job and job × type effects, the job effects'
        correlation, each job's Student-t scale weight per :data:`SCALE_BLOCKS` (below 1: an odd job there), the size slopes,
        and how a job that reports no size is placed (``size_imputation``: ``calibrated`` on sized jobs or, with none, the
        proxy standing for the size; the imputed log size's error std)."""
        fit = self.fitted()
        std = np.sqrt(np.diag(fit.shared))
        return {"jobs": len(self.jobs), "types": fit.types,
                "type_mean_std": dict(zip(COORDS, np.round(np.sqrt(fit.type_mean_var), 3).tolist())),
                "job_effect_std": dict(zip(COORDS, np.round(std, 3).tolist())),
                "job_type_std": {t: dict(zip(COORDS, np.round(np.sqrt(fit.particular[k]), 3).tolist())) for k, t in enumerate(fit.types)},
                "job_effect_correlation": np.round(fit.shared / np.outer(std, std), 3).tolist(),
                "job_scale_weights": {job: dict(zip(SCALE_BLOCK_NAMES, np.round(w, 3).tolist())) for job, w in fit.job_weights.items()},
                "size_slopes": None if fit.size_center is None else
                dict(zip(COORDS, np.round(fit.beta[K * len(fit.types):], 3).tolist())),
                "size_imputation": None if fit.imputation is None or not fit.imputation.levels else
                {"calibrated": fit.sized, "error_std": round(math.sqrt(fit.imputation.var), 3)}}

    def sync_shape(self, gpu_type: str) -> SyncShape | None:
        """The inter-node sync shape the cluster's jobs share on ``gpu_type`` (``None``: not learned there)."""
        return self.shapes.get(gpu_type)

    @property
    def jobs(self) -> list[str]:
        return sorted({s.job for s in self.summaries})

    @property
    def gpu_types(self) -> list[str]:
        return sorted({s.gpu_type for s in self.summaries})

    def __len__(self) -> int:
        return len(self.summaries)

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        out = {"summaries": [s.to_dict() for s in self.summaries],
               "sync_shapes": {t: shape.to_dict() for t, shape in sorted(self.shapes.items())}}
        if self.gp_prior is not None:
            out["gp_prior"] = self.gp_prior.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterPrior:
        if not isinstance(data, Mapping) or not isinstance(data.get("summaries"), list):
            raise ValidationError("cluster_prior", data, "expected {'summaries': [...]}")
        shapes = data.get("sync_shapes") or {}
        if not isinstance(shapes, Mapping):
            raise ValidationError("cluster_prior.sync_shapes", shapes, "expected {gpu_type: sync shape}")
        summaries = []
        for index, item in enumerate(data["summaries"]):
            try:
                summaries.append(CellSummary.from_dict(item))
            except ValidationError as exc:  # the field itself, not the whole summary
                raise ValidationError(f"cluster_prior.summaries[{index}].{exc.field}", exc.value, exc.reason) from None
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ValidationError(f"cluster_prior.summaries[{index}]", item, f"not a cell summary ({type(exc).__name__}: {exc})") from None
        try:
            gp_prior = HyperPrior.from_dict(data["gp_prior"]) if data.get("gp_prior") is not None else None
        except ValidationError as exc:
            raise ValidationError(f"cluster_prior.gp_prior.{exc.field}", exc.value, exc.reason) from None
        except (KeyError, TypeError) as exc:
            raise ValidationError("cluster_prior.gp_prior", data.get("gp_prior"), f"not a GP prior ({exc})") from None
        return cls(summaries, shapes={normalize_gpu_type(t): SyncShape.from_dict(v) for t, v in shapes.items()}, gp_prior=gp_prior)

    def save(self, path: str | os.PathLike[str]) -> Path:
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ClusterPrior:
        path = Path(path)
        data = read_json(path)  # not JSON, not UTF-8: a DataFormatError with its line
        try:
            return cls.from_dict(data)
        except ValidationError as exc:  # the field and why, the value cut short (a whole summary is long)
            value = exc.value if len(repr(exc.value)) <= 80 else f"{repr(exc.value)[:80]}..."
            raise DataFormatError(path, None, exc.field, value, f"{exc.reason} (not a saved ClusterPrior)") from None
        except (KeyError, TypeError, OverflowError) as exc:  # OverflowError: a count of 1e400
            raise DataFormatError(path, None, "cluster_prior", str(exc)[:80], "not a saved ClusterPrior") from None


def _checked_observations(observations: Any) -> dict[str, list[Observation]]:
    """``{job: [Observation, ...]}`` as lists, every item checked (a ValidationError names the first bad one)."""
    if not isinstance(observations, Mapping):
        raise ValidationError("observations", type(observations).__name__, "expected {job: [Observation, ...]}")
    kept: dict[str, list[Observation]] = {}
    for job, obs in observations.items():
        if not isinstance(job, str) or not job:
            raise ValidationError("observations", job, "job names must be non-empty strings")
        if isinstance(obs, Observation) or not is_collection(obs):
            raise ValidationError(f"observations[{job!r}]", type(obs).__name__, "expected an iterable of Observation")
        kept[job] = list(obs)
        for index, o in enumerate(kept[job]):
            if not isinstance(o, Observation):
                raise ValidationError(f"observations[{job!r}][{index}]", o, "expected an Observation")
    return {job: obs for job, obs in kept.items() if obs}


def _learn_shapes(observations: Mapping[str, Sequence[Observation]]) -> dict[str, SyncShape]:
    """Per GPU type, :func:`~goodput.sync_shape.learn_sync_shape` of the jobs' observations there (types without one left out)."""
    per_type: dict[str, list[list[Observation]]] = {}
    for obs in observations.values():
        for gpu, items in by_gpu_type(obs).items():
            per_type.setdefault(gpu, []).append(items)
    shapes = {gpu: learn_sync_shape(jobs) for gpu, jobs in sorted(per_type.items())}
    return {gpu: shape for gpu, shape in shapes.items() if shape}
