"""What a job's other GPU types and other jobs teach about what its own data cannot identify.

Pollux's throughput model (Qiao et al., OSDI'21, §3.2) has seven parameters per
job and GPU type. A job profiled on 1 GPU per type identifies only the compute
terms α_c, β_c; the synchronisation terms α_r, β_r (intra-node), α_n, β_n
(inter-node) and the overlap γ stay unknown, and Pollux falls back to
optimistic defaults (no sync cost: linear scaling). Transferring single
parameters is fragile: α_r and γ are nearly collinear on few configurations
(more overlap needs more sync to explain the same step time), so a ratio taken
from another job or type, applied to a differently fitted α_r, can be far off.

This module therefore transfers **whole, self-consistent sync profiles**. For
each *regime* a GPU type has not been observed in (:data:`REGIMES`: 2 GPUs on
one node, more GPUs on one node, several nodes) it builds an ensemble of
*members*: complete parameter vectors that keep the job's own compute terms
and take the sync terms (α_r, β_r, α_n, β_n, γ) from a source that has been
observed in that regime, scaled by a factor λ:

* **the same job on another GPU type A** (:func:`build_transfer`): λ is fitted
  to the type's own multi-GPU observations when it has any; otherwise
  ``λ = (c_B / c_A)^ρ`` with ``c`` the compute time of the smallest
  micro-batch, over ρ ∈ {0, ½, 1} (ρ = 0: sync costs the same seconds on both
  types; ρ = 1: sync scales with compute, as Sia's ratio estimator assumes —
  Jayaram Subramanya et al., SOSP'23 §4.2) and an interconnect factor
  ``exp(±√3 · 0.5)`` (3-point Gauss–Hermite), since types may sit on different
  interconnects;
* **other jobs on the same type** (:class:`ClusterPrior`): for the multi-node
  regime of a type with its own single-node multi-GPU observations, the job's
  own fit (compute, intra-node terms, γ) with inter-node terms = its own
  intra-node constant × the other job's inter/intra ratio (α_n/α_r, and its
  β_n/α_n, read from its fit at the shared overlap γ = 1.5, where the ratio
  does not carry that job's own trade of γ against sync): what other jobs
  teach there is the premium of the network over the node's interconnect, not
  their sync profile (:func:`_ratio_member`; on Pollux's T4 traces this halves
  the single-node → multi-node error, 24% → 12%); where both jobs' parameter
  counts are known, half of that job's vote goes to its inter-node terms
  scaled by the ratio of counts (:func:`_size_law_member`). Single-node data hardly
  separate γ from the intra-node sync, so the rule is applied to fits over a
  grid of γ, weighted by their posterior (:func:`_gamma_posterior`; Pollux's
  T4 traces 12% → 10.5%; with the ratio at the shared overlap and the
  cluster's sync shape, 9.5%). For the
  multi-node regime of a type without multi-GPU data, the job's
  own fit on another type it ran multi-GPU on (its sync terms and γ, its
  inter-node terms by the ratio rule when it has no multi-node data there),
  with this type's compute terms and the inter-node terms × the other job's
  ratio of inter-node sync between the two types (:func:`_carried_members`:
  P2's multi-node configurations then rest on the rule P3 measured, not on
  the other jobs' sync shape). Otherwise λ is fitted to the job's own
  multi-GPU observations on that type, else to its observations on another
  type that the other job also ran on (their sync costs relate as on that
  type), else the ratio of model sizes
  when both are known, else the ratio of their size proxies
  (:func:`size_proxy`: compute time tracks the model's size, as gradient
  bytes do);
* **a weak default** when nothing else covers the regime (:data:`DEFAULTS`).

Where the cluster's jobs share a shape of inter-node sync over placements (how
the wait depends on the number of nodes, not only of replicas), the prior
learns it per type (:mod:`goodput.sync_shape`); every fit of that type, the
job's own and the other jobs' summaries, and every member's prediction use it,
so α_n, β_n are the sync before the cluster's factor for the placement.

How far other jobs can be trusted is measured on the cluster itself, leave-one-job-out
(:mod:`goodput.cluster_prior`: the weak default's share of a cold job's members, and
the factors that make cold and warm jobs' 90% intervals cover 90% there).

A configuration in an unobserved regime is predicted by the weighted mean of
the members' log step times; their weighted variance, plus a structural
variance for Pollux's form (:data:`DEFAULTS` ``struct_std`` or the residuals
of other jobs' fits), is its prior uncertainty, carried by the Gaussian process
(:mod:`goodput.gp`) as a per-point variance. In regimes the type has been
observed in, its own fit is used, and :func:`sensitivities` gives the
delta-method uncertainty of its identified parameters.

Example::

    prior = ClusterPrior.from_observations(other_jobs_observations)   # {job: [Observation]}
    model = JobModel("new-job", init_batch_size=128, cluster_prior=prior)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.optimize

from .cluster_prior import (
    TRANSFER_GAMMA,
    ClusterPrior,
    JobTypeSummary,
    compute_reference,
    size_proxy,
)
from .observations import Observation
from .regimes import REGIMES, Regimes, config_regime
from .sync_shape import SyncShape
from .throughput import ThroughputParams, _step_time, fit_throughput, throughput_arrays
from .validation import check_float

__all__ = [
    "GROUPS",
    "DEFAULTS",
    "LogNormal",
    "Member",
    "TypeTransfer",
    "build_transfer",
    "sensitivities",
    # defined in goodput.regimes and goodput.cluster_prior, importable from here as before
    "REGIMES",
    "Regimes",
    "config_regime",
    "TRANSFER_GAMMA",
    "ClusterPrior",
    "JobTypeSummary",
    "compute_reference",
    "size_proxy",
]

# Parameter groups of the delta-method uncertainty of a type's own fit (see sensitivities()):
#   alpha_c: α_c × e^δ            beta_c: β_c × e^δ
#   sync:    α_r, β_r, α_n, β_n × e^δ (all sync costs)
#   slope:   β_r, β_n × e^δ        inter: α_n, β_n × e^δ (the inter-node terms)
#   gamma:   γ + δ
GROUPS = ("alpha_c", "beta_c", "sync", "slope", "inter", "gamma")
IDENTIFIED_LOG_STD = 1.0  # weak prior std of a group the type's own data identify (the data narrow it)
RHOS = (0.0, 0.5, 1.0)  # exponents of the compute ratio in cross-type sync transfer
INTERCONNECT_LOG_STD = 0.5  # GPU types may sit on different interconnects
GH_NODES = (-math.sqrt(3.0), 0.0, math.sqrt(3.0))  # 3-point Gauss-Hermite quadrature of N(0, 1)
GH_WEIGHTS = (1.0 / 6.0, 2.0 / 3.0, 1.0 / 6.0)
ALPHA_C_LOG_STD = 0.3  # the constant/per-sample split of compute copied from another type
SPLIT_BOUNDS = (1e-6, 1.0 - 1e-6)  # the compute split α_c / c₀ is kept inside (0, 1)


@dataclass(frozen=True)
class LogNormal:
    """A positive quantity's prior: median ``value`` and standard deviation of its logarithm."""

    value: float
    log_std: float

    def __post_init__(self) -> None:
        check_float("value", self.value, positive=True)
        check_float("log_std", self.log_std, nonnegative=True)


# Weak defaults when neither the job's other types nor other jobs cover a regime:
DEFAULTS: dict[str, LogNormal] = {
    "sync_ratio": LogNormal(0.5, 1.0),  # α_r / compute time of the smallest micro-batch: a factor ~5 either way at 90%
    "slope_ratio": LogNormal(0.02, 1.0),  # β / α: the per-extra-replica cost a few % of the constant
    "inter_ratio": LogNormal(3.0, 0.7),  # α_n / α_r: inter-node sync 1–10× intra-node (network vs PCIe/NVLink bandwidth)
    "struct_std": LogNormal(0.1, 0.0),  # error of Pollux's form in a regime not observed (std of log step time)
}


def _size_ratio(size: float | None, own_proxy: float | None, own_c_ref: float, other: JobTypeSummary) -> float:
    """λ guess of another job's sync on the job's: the ratio of model sizes, else of size proxies, else of compute references."""
    if size is not None and other.size:
        return size / other.size
    if own_proxy is not None and other.size_proxy is not None:
        return own_proxy / other.size_proxy
    return own_c_ref / other.c_ref


# ====================================================================== ensembles for unobserved regimes


@dataclass(frozen=True)
class Member:
    """One complete parameter vector (θ in PARAM_NAMES order) of an ensemble, with its weight and origin."""

    theta: np.ndarray
    weight: float
    source: str


@dataclass
class TypeTransfer:
    """One GPU type of a job: its own fit, and ensembles for the regimes it has not been observed in.

    Attributes:
        gpu_type: the type.
        regimes: what its data cover.
        params: its own fit (compute split from other types when it saw one
            batch size); unobserved sync terms replaced by the ensemble's
            weighted geometric mean (a representative, for display).
        members: per unobserved regime index, the ensemble (weights sum to 1).
        struct: per unobserved regime index, the structural std of log step time.
        alpha_c_log_std: prior std of the compute split when it came from other types (else 0).
        sources: per regime name, where its ensemble came from.
        inflate: per unobserved regime index, a factor on the ensemble's variance.
        inherited: per unobserved regime index, the total weight of members that carry the
            type's own fitted sync terms and γ (:func:`_ratio_member`): the uncertainty of
            those parameters carries over to them (every member carries the own compute terms).
        borrowed: per unobserved regime index, ``{type: weight}`` of members that carry the
            job's own fitted sync terms and γ on another type (:func:`_carried_members`): that
            type's parameter uncertainty carries over to them.
    """

    gpu_type: str
    regimes: Regimes
    params: ThroughputParams
    members: dict[int, list[Member]] = field(default_factory=dict)
    struct: dict[int, float] = field(default_factory=dict)
    alpha_c_log_std: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)
    inflate: dict[int, float] = field(default_factory=dict)  # per regime: factor on the ensemble variance
    inherited: dict[int, float] = field(default_factory=dict)  # per regime: weight of members with the type's own sync terms
    borrowed: dict[int, dict[str, float]] = field(default_factory=dict)  # per regime: {other type: weight of members with its sync terms}
    shape: SyncShape | None = None  # the cluster's inter-node sync shape on this type (every member's prediction uses it)

    def __post_init__(self) -> None:
        self.theta = self.params.as_array()
        self._stack = {r: (np.stack([m.theta for m in ms]), np.array([m.weight for m in ms])) for r, ms in self.members.items() if ms}

    def predict_log(self, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray, accum: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Prior mean and variance of log step time, and whether each configuration's regime was observed."""
        factor = self.shape(nodes, replicas) if self.shape is not None else None  # once for every member
        log_mean = np.log(_step_time(self.theta, nodes, replicas, bsz, accum, factor))
        var = np.zeros_like(log_mean)
        regime = config_regime(nodes, replicas)
        covered = np.isin(regime, self.regimes.covered) | (regime == 0)
        if covered.all():
            return log_mean, var, covered
        for r in np.unique(regime[~covered]):
            rows = regime == r
            if r in self._stack:
                thetas, weights = self._stack[r]
                part = None if factor is None else factor[rows]
                logs = np.log(np.stack([_step_time(th, nodes[rows], replicas[rows], bsz[rows], accum[rows], part) for th in thetas]))
                mean = weights @ logs
                log_mean[rows] = mean
                var[rows] = (weights @ (logs - mean) ** 2) * self.inflate.get(int(r), 1.0)
            var[rows] += self.struct.get(int(r), 0.0) ** 2
        return log_mean, var, covered


def _member_theta(own: np.ndarray, source: np.ndarray, scale: float) -> np.ndarray:
    """Own compute terms, the source's sync terms × ``scale``, γ = :data:`TRANSFER_GAMMA`."""
    theta = source.copy()
    theta[0], theta[1] = own[0], own[1]
    theta[2:6] = source[2:6] * scale
    theta[6] = TRANSFER_GAMMA
    return theta


SCALE_RANGE = 100.0  # a fitted λ may differ from its compute-ratio guess by at most this factor


def _fit_scale(own: np.ndarray, source: np.ndarray, cols: Mapping[str, np.ndarray], guess: float = 1.0,
               shape: SyncShape | None = None) -> float | None:
    """λ minimising the squared log error of ``_member_theta(own, source, λ)`` on multi-GPU observations.

    Searched within ``guess`` ×/÷ :data:`SCALE_RANGE`; ``None`` when the optimum sits on that
    bound (the observations do not identify λ, e.g. the source shows no sync cost at all).
    """
    target = np.log(cols["step_time"])
    factor = shape(cols["num_nodes"], cols["num_replicas"]) if shape is not None else None

    def loss(u: float) -> float:
        pred = _step_time(_member_theta(own, source, math.exp(u)), cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"],
                          factor)
        return float(np.sum((np.log(pred) - target) ** 2))

    low, high = math.log(guess / SCALE_RANGE), math.log(guess * SCALE_RANGE)
    result = scipy.optimize.minimize_scalar(loss, bounds=(low, high), method="bounded", options={"xatol": 1e-3})
    u = float(result.x)
    if not np.isfinite(u) or min(u - low, high - u) < 0.01:
        return None
    return math.exp(u)


RATIO_MIN_SYNC = 0.01  # α_r below this fraction of the compute: intra-node sync hidden, its ratio not usable


def _ratio_member(own: np.ndarray, other: JobTypeSummary) -> Member | None:
    """Own θ with inter-node terms = own intra-node constant × the other job's inter/intra ratio.

    ``α_n = α_r · (α_n / α_r)_other`` and ``β_n = α_n · (β_n / α_n)_other`` from the other job's
    fit to all its data on the type with γ held at :data:`TRANSFER_GAMMA` (``params_g``), with
    the job's own compute, intra-node terms and γ (all identified by its single-node multi-GPU
    data). At a shared overlap the other jobs' ratios measure the network's premium over the
    node's interconnect, not each job's trade of γ against its sync costs (with each job's
    own γ instead, the P3 median is 11.3 rather than 9.5 on Pollux's traces, 14.4 rather than
    12.4 on the derived 5-type set, 17.7 rather than 16.2 on Gavel's: accuracy.md round 11).
    ``None`` when the other job's ratio is not identified: no single-node multi-GPU data, or
    intra-node sync hidden behind compute (the caller likewise skips the rule when the job's
    own intra-node sync is hidden).
    """
    if other.params_g is None:
        return None
    src = other.params_g.as_array()
    if not (other.regimes.has_single_node_multi and other.regimes.has_inter) or src[4] <= RATIO_MIN_SYNC * other.c_ref:
        return None
    theta = own.copy()
    theta[2] = own[4] * src[2] / src[4]
    theta[3] = theta[2] * src[3] / max(src[2], 1e-12)
    return Member(theta, 1.0, f"job {other.job}, own intra-node sync × its inter/intra ratio")


# Overlaps γ over which a single-node fit is averaged when its sync is carried to several nodes
# (a uniform prior on these values; Pollux's γ ranges over [1, 10], fits land mostly in 1–3).
GAMMA_GRID = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0)
GAMMA_MIN_WEIGHT = 1e-3  # posterior weight below which an overlap of the grid is dropped


def _gamma_posterior(observations: Sequence[Observation], noise_std: float, own: ThroughputParams,
                     shape: SyncShape | None = None, sync_prior: tuple[float, float] | None = None) -> list[tuple[np.ndarray, float]]:
    """Fits of one type's observations over the overlap γ (θ), and their posterior weights.

    On one node, the overlap γ and the intra-node sync cost α_r explain the same step times in
    many combinations (more overlap hides more sync), and they part ways only on several nodes,
    where sync outgrows compute: Pollux's T4 deepspeech2 fits α_r = 0.33 s at γ = 2.6 on its
    single-node data and 0.084 s at γ = 1.4 on all of them. Rather than carry the one
    combination the single-node fit happens to pick, the multi-node prediction averages over γ
    (Bayesian model averaging: Hoeting et al., "Bayesian model averaging: a tutorial",
    Statistical Science 14(4), 1999). The nodes are :data:`GAMMA_GRID` and the free fit's γ
    (``own``, the likelihood's mode), each a fit with γ held there; its weight is the
    likelihood ``exp(−½ Σ r² / σ²)`` times the width of its cell of a uniform prior on
    [1, max(5, γ_own)], with ``r`` the log residuals of step time, and of compute time where
    the observations measured it (the fits match both), and σ = ``noise_std``: the
    error of Pollux's form itself (the cluster's other jobs' fits on single-node multi-GPU
    configurations), which dominates the residuals of a fit, not measurement noise. Nodes of
    weight below :data:`GAMMA_MIN_WEIGHT` are dropped.

    ``sync_prior`` = (mean, std) of log α_r in seconds, when the job's parameter count and
    other jobs' on the type are known (:func:`_size_sync_prior`): a further likelihood
    factor of each node's α_r. Sync moves the gradient, so α_r per parameter is nearly
    a constant of the type (on Pollux's T4 traces 2.4–3.1 ms per million parameters
    over six models whose α_r spans 80×), and it tells apart the overlaps that the
    single-node step times cannot.
    """
    cols = throughput_arrays(observations)
    log_step = np.log(cols["step_time"])
    measured = np.isfinite(cols["compute_time"]) & (cols["compute_time"] > 0)
    log_compute = np.log(cols["compute_time"][measured])
    gammas = sorted(set(GAMMA_GRID) | {own.gamma})
    thetas, log_like = [], []
    for gamma in gammas:
        theta = own.as_array() if gamma == own.gamma else fit_throughput(observations, gamma=gamma, initial=own, sync_shape=shape).as_array()
        resid = np.log(_step_time(theta, cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"], shape)) - log_step
        # the compute times measured beside (step − sync wait), which the fits match too
        resid = np.concatenate([resid, np.log(theta[0] + theta[1] * cols["local_bsz"][measured]) - log_compute])
        thetas.append(theta)
        log_like.append(-0.5 * float(np.sum(resid**2)) / noise_std**2)
        if sync_prior is not None:
            log_like[-1] -= 0.5 * ((math.log(max(theta[4], 1e-12)) - sync_prior[0]) / sync_prior[1]) ** 2
    edges = np.concatenate([[gammas[0]], (np.array(gammas[1:]) + np.array(gammas[:-1])) / 2, [max(gammas[-1], GAMMA_GRID[-1])]])
    weights = np.diff(edges) * np.exp(np.array(log_like) - max(log_like))
    keep = weights >= GAMMA_MIN_WEIGHT * weights.sum()  # negligible overlaps would only cost prediction time
    weights = weights[keep] / weights[keep].sum()
    return list(zip([t for t, k in zip(thetas, keep) if k], weights.tolist()))


SIZE_SYNC_MIN_JOBS = 2  # other jobs with a known size that a type's α_r-per-parameter needs
SIZE_SYNC_MIN_STD = 0.25  # floor of that prior's log std (its spread over few jobs understates it)


def _size_sync_prior(size: float | None, others: Sequence[JobTypeSummary]) -> tuple[float, float] | None:
    """(mean, std) of a job's log α_r from its ``size`` and the α_r per parameter of ``others`` with known sizes.

    Only other jobs whose fit saw one node with several GPUs and several nodes (so their γ and
    α_r are identified) and whose intra-node sync shows (α_r ≥ :data:`RATIO_MIN_SYNC` of compute)
    count; ``None`` with fewer than :data:`SIZE_SYNC_MIN_JOBS` of them. The std is their spread
    inflated by √(1 + 1/m) (a new draw), at least :data:`SIZE_SYNC_MIN_STD`.
    """
    if size is None:
        return None
    logs = [math.log(o.params.alpha_r / o.size) for o in others
            if o.size and o.regimes.has_single_node_multi and o.regimes.has_inter and o.params.alpha_r > RATIO_MIN_SYNC * o.c_ref]
    if len(logs) < SIZE_SYNC_MIN_JOBS:
        return None
    m = len(logs)
    std = max(float(np.std(logs, ddof=1)) * math.sqrt(1.0 + 1.0 / m), SIZE_SYNC_MIN_STD)
    return math.log(size) + float(np.mean(logs)), std


def _size_law_member(own: np.ndarray, other: JobTypeSummary, size: float | None) -> Member | None:
    """Own θ with inter-node terms = the other job's, scaled by the ratio of parameter counts.

    ``α_n = α_n,other · size / size_other`` and ``β_n = α_n · (β_n / α_n)_other`` from the other
    job's fit at the shared overlap (``params_g``, as :func:`_ratio_member` reads it), with the
    job's own compute, intra-node terms and γ. Inter-node sync moves the gradient over the network,
    so its cost per parameter is nearly a constant of the type (accuracy.md rounds 19–20: over
    Pollux's six T4 models α_n per parameter varies by 1.4×, on Gavel's P100 and V100 by 1.7×
    and 1.6×). Unlike the ratio rule it does not rest on the job's own intra-node constant,
    which single-node data confound with γ. ``None`` without both parameter counts or without
    the other job's multi-node data.
    """
    if size is None or not other.size or other.params_g is None or not other.regimes.has_inter:
        return None
    src = other.params_g.as_array()
    if not src[2] > 0:
        return None
    theta = own.copy()
    theta[2] = src[2] * size / other.size
    theta[3] = theta[2] * src[3] / src[2]
    return Member(theta, 1.0, f"job {other.job}, its inter-node sync × the ratio of parameter counts")


SIZE_LAW_WEIGHT = 0.5  # share of another job's vote that the size law takes from the ratio rule, both known


def _ratio_members(grid: Sequence[tuple[np.ndarray, float]], own: np.ndarray, other: JobTypeSummary,
                   size: float | None = None) -> list[Member]:
    """:func:`_ratio_member` of each γ of a :func:`_gamma_posterior`, with its weight and the job's own compute terms.

    Where both parameter counts are known, :func:`_size_law_member` of each γ takes
    :data:`SIZE_LAW_WEIGHT` of the vote: the two rules err on different jobs (the ratio rule
    on those whose single-node data pick the wrong overlap, the size law on those whose sync
    per parameter strays), and their average is the better (round 21: the derived 5-type
    set's P3 9.7 → 8.8 and P2 11.1 → 9.6, Gavel's P2 18.6 → 15.9; the size law alone:
    Pollux P3 7.8 → 8.9).
    """
    ratio, law = [], []
    for theta, weight in grid:
        member = _ratio_member(theta, other)
        if member is None:
            continue
        member.theta[0], member.theta[1] = own[0], own[1]
        ratio.append(Member(member.theta, weight, member.source))
        by_size = _size_law_member(theta, other, size)
        if by_size is not None:
            by_size.theta[0], by_size.theta[1] = own[0], own[1]
            law.append(Member(by_size.theta, weight, by_size.source))
    if not law:
        return ratio
    return _normalised(ratio, 1.0 - SIZE_LAW_WEIGHT) + _normalised(law, SIZE_LAW_WEIGHT)


# Above this overlap γ, a single-node fit's sync can hide behind its compute (the step is within
# 2^(1/γ) − 1 < 26% of the larger of the two): its sync terms are not identified well enough to
# carry to a type where compute is faster and the sync shows (Gavel's resnet-18 on K80: γ = 4.4).
CARRY_MAX_GAMMA = 3.0


def _carried_members(own: np.ndarray, own_ref: np.ndarray, ref_grid: Sequence[tuple[np.ndarray, float]] | None, ref_regimes: Regimes,
                     ref_c: float, on_ref: JobTypeSummary, other: JobTypeSummary, size: float | None = None) -> list[Member]:
    """Multi-node members of a type without multi-GPU data: the job's own fit on a reference type, carried over.

    The job's fit on type ``ref`` (``own_ref``: its sync terms and γ; when ``ref`` has no
    multi-node data, P3's ratio rule, :func:`_ratio_member`, from the other job on ``ref``,
    applied to each γ of ``ref_grid``, the :func:`_gamma_posterior` of its data, with its
    weight, beside the size law when ``size`` and the other job's are known:
    :func:`_ratio_members`), with this type's compute terms and the inter-node terms × the
    other job's ratio of inter-node sync between the two types (α_n here / α_n on ``ref``, γ-held fits): what
    the other job teaches is how the two types' networks compare, not its sync profile.
    Empty when ``ref`` does not identify the job's sync (no single-node multi-GPU data, or
    its intra-node sync hidden behind compute in its fit: α_r below :data:`RATIO_MIN_SYNC` of
    the compute, or γ above :data:`CARRY_MAX_GAMMA`) or the other job has no multi-node data
    on either type.
    """
    if other.params_g is None or on_ref.params_g is None or not (other.regimes.has_inter and on_ref.regimes.has_inter):
        return []
    if ref_regimes.has_inter:
        weighted = [(own_ref.copy(), 1.0)]
    elif ref_regimes.has_single_node_multi and own_ref[4] > RATIO_MIN_SYNC * ref_c and own_ref[6] <= CARRY_MAX_GAMMA:
        weighted = [(m.theta, m.weight) for m in _ratio_members(ref_grid or [(own_ref, 1.0)], own, on_ref, size)]
    else:
        return []
    here, there = other.params_g.alpha_n, on_ref.params_g.alpha_n
    if not (here > 0 and there > 0):
        return []
    source = f"job {other.job}, own fit on {on_ref.gpu_type} × its {other.gpu_type}/{on_ref.gpu_type} inter-node sync"
    out = []
    for theta, weight in weighted:
        theta[0], theta[1] = own[0], own[1]  # this type's compute terms
        theta[2:4] *= here / there
        out.append(Member(theta, weight, source))
    return out


def _default_source(c_ref: float) -> np.ndarray:
    alpha_r = DEFAULTS["sync_ratio"].value * c_ref
    alpha_n = DEFAULTS["inter_ratio"].value * alpha_r
    slope = DEFAULTS["slope_ratio"].value
    return np.array([0.0, 0.0, alpha_n, slope * alpha_n, alpha_r, slope * alpha_r, TRANSFER_GAMMA])


def _normalised(members: list[Member], total: float = 1.0) -> list[Member]:
    weight = sum(m.weight for m in members)
    return [Member(m.theta, total * m.weight / weight, m.source) for m in members] if weight > 0 else []


def build_transfer(
    own_fits: Mapping[str, ThroughputParams],
    observations: Mapping[str, Sequence[Observation]],
    cluster_prior: ClusterPrior | None = None,
    *,
    size: float | None = None,
    defaults: bool = True,
    keep_own: Iterable[str] = (),
    cache: dict[Any, Any] | None = None,
) -> dict[str, TypeTransfer]:
    """Ensembles for every type of one job (see the module docstring).

    ``own_fits`` holds each type's Pollux fit to its own ``observations``;
    types in ``keep_own`` (fitted with a caller's explicit prior) keep their fit everywhere.
    ``cache`` (a dict the caller keeps) memoises the γ-held fits by (type, number of observations):
    keep one per job, cluster prior and ``size`` (:class:`goodput.JobModel` clears its own when
    either changes).
    """
    keep_own = set(keep_own)
    shapes = {t: cluster_prior.sync_shape(t) if cluster_prior is not None else None for t in observations}
    regimes = {t: Regimes.of(obs) for t, obs in observations.items()}
    c_ref = {t: max(compute_reference(own_fits[t], regimes[t].min_bsz), 1e-9) for t in own_fits}
    # size proxies of the types whose own fit saw only 1-GPU data at 2+ batch sizes (as the other jobs' are)
    proxy = {t: size_proxy(own_fits[t], regimes[t].min_bsz) for t in own_fits if not regimes[t].has_multi and not regimes[t].one_bsz}
    multi_cols = {}
    held: dict[str, np.ndarray] = {}  # γ-held fits of the types with multi-GPU data (the sources)
    for t, obs in observations.items():
        multi = [o for o in obs if o.num_replicas > 1]
        if multi:
            multi_cols[t] = throughput_arrays(multi)
            if gpu_sources_needed(regimes, t):
                key = ("held", t, len(obs))
                if cache is None or key not in cache:
                    value = fit_throughput(obs, gamma=TRANSFER_GAMMA, sync_shape=shapes[t]).as_array()
                    if cache is None:
                        held[t] = value
                        continue
                    cache[key] = value
                held[t] = cache[key]

    def gamma_grid(t: str) -> list[tuple[np.ndarray, float]]:
        """:func:`_gamma_posterior` of type ``t``'s observations (memoised in ``cache``)."""
        key = ("gamma grid", t, len(observations[t]))
        if cache is None or key not in cache:
            noise = (cluster_prior.struct(t, 1) if cluster_prior is not None else None) or DEFAULTS["struct_std"].value
            prior = _size_sync_prior(size, cluster_prior.on(t)) if cluster_prior is not None else None
            value = _gamma_posterior(observations[t], noise, own_fits[t], shapes[t], prior)
            if cache is None:
                return value
            cache[key] = value
        return cache[key]

    out: dict[str, TypeTransfer] = {}
    for gpu, params in own_fits.items():
        reg = regimes[gpu]
        own = params.as_array()
        sources: dict[str, str] = {}
        alpha_c_std = 0.0
        if reg.one_bsz:
            fractions = [p.alpha_c / compute_reference(p, reg.bsz0) for t, p in own_fits.items() if t != gpu and not regimes[t].one_bsz]
            if fractions:
                c0 = compute_reference(params, reg.bsz0)
                f = min(max(float(np.median(fractions)), SPLIT_BOUNDS[0]), SPLIT_BOUNDS[1])
                own[0], own[1] = f * c0, (1 - f) * c0 / reg.bsz0
                alpha_c_std = ALPHA_C_LOG_STD if len(fractions) == 1 else max(float(np.std(np.log(fractions))), ALPHA_C_LOG_STD)
                sources["compute split"] = "other GPU types of this job"
            else:
                alpha_c_std = 0.7
                sources["compute split"] = "Pollux default (half the compute)"
        members: dict[int, list[Member]] = {}
        struct: dict[int, float] = {}
        inflate: dict[int, float] = {}
        inherited: dict[int, float] = {}
        borrowed: dict[int, dict[str, float]] = {}
        for regime in (1, 2, 3):
            if regime in reg.covered or gpu in keep_own:
                continue
            family_w: list[Member] = []
            for src_type, src_reg in regimes.items():
                if src_type == gpu or regime not in src_reg.covered:
                    continue
                source = held[src_type]
                if gpu in multi_cols:
                    lam = _fit_scale(own, source, multi_cols[gpu], c_ref[gpu] / c_ref[src_type], shapes[gpu])
                    if lam is not None:
                        family_w.append(Member(_member_theta(own, source, lam), 1.0, f"{src_type}, scaled to own multi-GPU data"))
                else:
                    ratio = c_ref[gpu] / c_ref[src_type]
                    group = [
                        Member(_member_theta(own, source, ratio**rho * math.exp(z * INTERCONNECT_LOG_STD)), w / len(RHOS), f"{src_type}, compute ratio^{rho}")
                        for rho in RHOS
                        for z, w in zip(GH_NODES, GH_WEIGHTS)
                    ]
                    family_w += _normalised(group)
            family_x: list[list[Member]] = []  # one group (one vote) per other job
            if cluster_prior is not None:
                for other in cluster_prior.on(gpu, regime):
                    if other.params_g is None:
                        continue
                    source = other.params_g.as_array()
                    guess = _size_ratio(size, proxy.get(gpu), c_ref[gpu], other)
                    lam, how = None, ""
                    if regime == 3 and reg.has_single_node_multi and own[4] > RATIO_MIN_SYNC * c_ref[gpu]:
                        group = _ratio_members(gamma_grid(gpu), own, other, size)
                        if group:
                            family_x.append(group)
                            inherited[regime] = inherited.get(regime, 0.0) + 1.0
                            continue
                    if gpu in multi_cols:
                        lam, how = _fit_scale(own, source, multi_cols[gpu], guess, shapes[gpu]), "scaled to own multi-GPU data"
                        if lam is None:
                            continue  # its sync profile cannot be matched to the job's: no vote
                    else:
                        carried: list[Member] = []
                        # the type with most multi-GPU data first; ties by name, not by the order types were seen
                        for ref in sorted(multi_cols, key=lambda t: (-len(multi_cols[t]["step_time"]), t)):
                            on_ref = cluster_prior.find(other.job, ref)
                            if regime == 3 and on_ref is not None:
                                ref_grid = gamma_grid(ref) if regimes[ref].has_single_node_multi and not regimes[ref].has_inter else None
                                carried = _carried_members(own, own_fits[ref].as_array(), ref_grid, regimes[ref], c_ref[ref], on_ref, other, size)
                                if carried:
                                    counts = borrowed.setdefault(regime, {})
                                    counts[ref] = counts.get(ref, 0.0) + 1.0
                                    break
                            if on_ref is not None and on_ref.params_g is not None:
                                ref_guess = _size_ratio(size, proxy.get(ref), c_ref[ref], on_ref)
                                lam = _fit_scale(own_fits[ref].as_array(), on_ref.params_g.as_array(), multi_cols[ref], ref_guess, shapes[ref])
                                if lam is not None:
                                    how = f"scaled as on {ref}"
                                    break
                        if carried:
                            family_x.append(carried)
                            continue
                        if lam is None:
                            lam, how = guess, ("scaled by model size" if size is not None and other.size else "scaled by size proxy")
                    family_x.append([Member(_member_theta(own, source, lam), 1.0, f"job {other.job}, {how}")])
            family_d: list[Member] = []
            default_scaled = False
            if defaults:
                source = _default_source(c_ref[gpu])
                lam = _fit_scale(own, source, multi_cols[gpu], shape=shapes[gpu]) if gpu in multi_cols else None
                default_scaled = lam is not None
                if default_scaled:
                    spread = DEFAULTS["inter_ratio"].log_std if regime == 3 else DEFAULTS["slope_ratio"].log_std
                    for z, w in zip(GH_NODES, GH_WEIGHTS):
                        theta = _member_theta(own, source, lam)
                        if regime == 3:
                            theta[2:4] *= math.exp(z * spread)
                        else:
                            theta[3] *= math.exp(z * spread)
                            theta[5] *= math.exp(z * spread)
                        family_d.append(Member(theta, w, "weak default, scaled to own multi-GPU data"))
                else:
                    spread = DEFAULTS["sync_ratio"].log_std
                    family_d = [Member(_member_theta(own, source, math.exp(z * spread)), w, "weak default") for z, w in zip(GH_NODES, GH_WEIGHTS)]
            chosen: list[Member] = []
            m = len(family_x)
            # Every source has one vote: each other job, each other type of this job, and — when
            # nothing else covers the regime, or when the default too was scaled to the job's own
            # multi-GPU data (then they agree on what was observed and may share a shape the job
            # does not have) — the weak default. The spread of m votes is inflated by (m+1)/(m-1),
            # the predictive variance of a new draw.
            # An unscaled default beside members that were matched to the type's own data would pull
            # them off what was observed (0.1 s of sync measured, the default's members at 1e-5 s):
            # it votes then only when nothing else covers the regime.
            use_default = bool(family_d) and (not (family_w or family_x) or default_scaled)
            groups_w: dict[str, list[Member]] = {}
            for mem in family_w:
                groups_w.setdefault(mem.source.split(",")[0], []).append(mem)
            votes = len(groups_w) + m + (1 if use_default else 0)
            for group in groups_w.values():
                chosen += _normalised(group, 1.0 / votes)
            for group in family_x:
                chosen += _normalised(group, 1.0 / votes)
            if regime in inherited:
                inherited[regime] /= votes  # the weight of the members carrying the type's own sync terms
            if regime in borrowed:
                borrowed[regime] = {t: w / votes for t, w in borrowed[regime].items()}
            if use_default:
                chosen += _normalised(family_d, 1.0 / votes)
            share = 0.0
            if not multi_cols and family_x and family_d and not family_w and cluster_prior is not None:
                # a cold job: the other jobs' sync profiles beside the weak default, in the proportion
                # that predicted the cluster's own jobs best (ClusterPrior.cold_share)
                share = cluster_prior.cold_share()
                chosen = [] if share >= 1.0 else [Member(mem.theta, mem.weight * (1.0 - share), mem.source) for mem in chosen]
                chosen += _normalised(family_d, share)
            if m >= 2 and share < 1.0:
                inflate[regime] = (votes + 1.0) / (votes - 1.0)
            if chosen:
                members[regime] = _normalised(chosen)
                sources[REGIMES[regime]] = "; ".join(sorted({m.source for m in chosen}))
                value = cluster_prior.struct(gpu, regime) if cluster_prior is not None else None
                if value is None and defaults:
                    value = DEFAULTS["struct_std"].value
                if value:
                    struct[regime] = value
        out[gpu] = TypeTransfer(gpu, reg, _representative(own, members, params.fixed, reg.covered), members, struct, alpha_c_std, sources, inflate,
                                inherited, borrowed, shapes[gpu])
    return out


def gpu_sources_needed(regimes: Mapping[str, Regimes], source: str) -> bool:
    """Whether ``source`` covers a regime some other type of the job lacks (so it serves as a source)."""
    return any(r != source and any(g not in regimes[r].covered for g in regimes[source].covered if g) for r in regimes)


def _representative(own: np.ndarray, members: Mapping[int, list[Member]], fixed: tuple[str, ...],
                    covered: Sequence[int] = ()) -> ThroughputParams:
    """Own θ with the sync terms of unobserved regimes at the ensembles' weighted geometric means.

    When either single-node regime (2 GPUs, or more GPUs on a node) is unobserved, α_r, β_r and
    γ all come from that regime's ensemble, even if the other single-node regime was observed:
    the members were then scaled to the job's own multi-GPU data (:func:`_fit_scale`), so they
    agree with what was observed, and one θ stays consistent across regimes. The GP corrects
    what remains in observed regimes. Keeping the own fit as the mean of observed regimes was
    measured and not kept (no gain across datasets: ``experiments/results/accuracy.md``).

    But γ stays the own fit's when the type was observed on several nodes (``covered`` holds
    regime 3): its inter-node terms were fitted with that γ, and the ensemble's γ beside them
    mispredicted the placements they were fitted to (accuracy.md, round 12).
    """
    theta = own.copy()
    sync_members = members.get(1) or members.get(2)
    if sync_members:
        w = np.array([m.weight for m in sync_members])
        stack = np.stack([m.theta for m in sync_members])
        theta[4:6] = np.exp(w @ np.log(np.maximum(stack[:, 4:6], 1e-12)))
        if 3 not in covered:
            theta[6] = float(w @ stack[:, 6])
    if members.get(3):
        w = np.array([m.weight for m in members[3]])
        stack = np.stack([m.theta for m in members[3]])
        theta[2:4] = np.exp(w @ np.log(np.maximum(stack[:, 2:4], 1e-12)))
    theta[6] = min(max(theta[6], 1.0), 10.0)
    return ThroughputParams(*theta.tolist(), fixed=fixed)


# ====================================================================== sensitivities


def sensitivities(theta: np.ndarray, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray, accum: np.ndarray,
                  shape: SyncShape | None = None) -> np.ndarray:
    """∂ log T_iter / ∂ δ_g for each group of :data:`GROUPS`, shape (N, 6).

    Analytic derivatives of Pollux's T_iter = a·C + (C^γ + S^γ)^{1/γ}
    (DESIGN.md) with C = α_c + β_c·b and S the sync time (its inter-node
    terms × the cluster's sync ``shape`` when given).
    """
    a_c, b_c, a_n, b_n, a_r, b_r, g = (float(v) for v in theta)
    nodes, replicas, bsz, accum = (np.asarray(v, dtype=float).ravel() for v in np.broadcast_arrays(nodes, replicas, bsz, accum))
    multi = replicas > 1
    inter = multi & (nodes > 1)
    extra = np.maximum(replicas - 2.0, 0.0)
    compute = a_c + b_c * bsz
    factor = shape(nodes, replicas) if shape is not None else 1.0
    alpha = np.where(inter, a_n * factor, a_r)
    beta = np.where(inter, b_n * factor, b_r)
    sync = np.where(multi, alpha + beta * extra, 0.0)
    top = np.maximum(compute, sync)
    x = compute / top
    y = sync / top
    xg, yg = x**g, y**g
    q = xg + yg
    overlap = top * q ** (1.0 / g)
    step = accum * compute + overlap
    d_c = accum + (compute / overlap) ** (g - 1.0)
    d_s = np.where(multi & (sync > 0), (np.where(sync > 0, sync, 1.0) / overlap) ** (g - 1.0), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ylogy = np.where(yg > 0, yg * np.log(np.where(y > 0, y, 1.0)), 0.0)
        d_g = overlap * (-np.log(q) / g**2 + (xg * np.log(x) + ylogy) / (g * q))
    out = np.empty((step.size, len(GROUPS)))
    out[:, 0] = d_c * a_c
    out[:, 1] = d_c * b_c * bsz
    out[:, 2] = d_s * sync
    out[:, 3] = d_s * np.where(multi, beta * extra, 0.0)
    out[:, 4] = d_s * np.where(inter, alpha + beta * extra, 0.0)
    out[:, 5] = np.where(multi, d_g, 0.0)
    out /= step[:, None]
    return np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0)
