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
  the single-node → multi-node error, 24% → 12%). Single-node data hardly
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

How far other jobs can be trusted is a property of the cluster, measured on it:
:meth:`ClusterPrior.cold_share` chooses, leave-one-job-out on the cluster's own
jobs, how much of a cold job's members the weak default takes beside the other
jobs' sync profiles (stacking: 0–0.2 on Pollux's T4 jobs, which resemble each
other; 0.4–0.75 on Gavel's, which do not; 0 on the derived 5-type set);
:meth:`ClusterPrior.cold_calibration` models each of its jobs from that job's
1-GPU data and the others, and scales a cold job's predictive spread so that
90% intervals cover 90% there; :meth:`ClusterPrior.warm_calibration` does the
same for a job that has run multi-GPU on one node of some type, per situation
(that type's multi-node regime; another type's single-node and multi-node
regimes).

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

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import scipy.optimize

from .errors import DataFormatError, ValidationError
from .io import atomic_write_text
from .observations import Observation, by_gpu_type, indices_by_gpu_type
from .sync_shape import SyncShape, learn_sync_shape
from .throughput import ThroughputParams, _step_time, fit_throughput, throughput_arrays
from .threads import single_threaded
from .validation import check_float, normalize_gpu_type

__all__ = [
    "GROUPS",
    "REGIMES",
    "DEFAULTS",
    "LogNormal",
    "Regimes",
    "Member",
    "TypeTransfer",
    "ClusterPrior",
    "JobTypeSummary",
    "config_regime",
    "compute_reference",
    "size_proxy",
    "build_transfer",
    "sensitivities",
]

# Parameter groups of the delta-method uncertainty of a type's own fit (see sensitivities()):
#   alpha_c: α_c × e^δ            beta_c: β_c × e^δ
#   sync:    α_r, β_r, α_n, β_n × e^δ (all sync costs)
#   slope:   β_r, β_n × e^δ        inter: α_n, β_n × e^δ (the inter-node terms)
#   gamma:   γ + δ
GROUPS = ("alpha_c", "beta_c", "sync", "slope", "inter", "gamma")
# Configuration regimes: 1 GPU; 2 GPUs on one node; more GPUs on one node; several nodes.
REGIMES = ("one", "intra2", "intramany", "inter")
IDENTIFIED_LOG_STD = 1.0  # weak prior std of a group the type's own data identify (the data narrow it)
RHOS = (0.0, 0.5, 1.0)  # exponents of the compute ratio in cross-type sync transfer
INTERCONNECT_LOG_STD = 0.5  # GPU types may sit on different interconnects
GH_NODES = (-math.sqrt(3.0), 0.0, math.sqrt(3.0))  # 3-point Gauss-Hermite quadrature of N(0, 1)
GH_WEIGHTS = (1.0 / 6.0, 2.0 / 3.0, 1.0 / 6.0)
ALPHA_C_LOG_STD = 0.3  # the constant/per-sample split of compute copied from another type


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
# Sync profiles are transferred as fits with γ held at this value: on configurations where
# sync hides behind compute, γ and the sync costs are nearly collinear, so profiles with
# different fitted γ are not comparable (one job's γ = 2.5 with large α_r explains the same
# single-node steps as γ = 1 with small α_r, but predicts very different multi-node ones).
TRANSFER_GAMMA = 1.5  # between no overlap (1) and full overlap (10)


def config_regime(nodes: Any, replicas: Any) -> np.ndarray:
    """Regime index (into :data:`REGIMES`) of configurations."""
    nodes = np.asarray(nodes, dtype=float)
    replicas = np.asarray(replicas, dtype=float)
    return np.where(replicas <= 1, 0, np.where(nodes > 1, 3, np.where(replicas > 2, 2, 1))).astype(int)


# ====================================================================== what a type's data identify


@dataclass(frozen=True)
class Regimes:
    """What a job has been observed in on one GPU type."""

    covered: tuple[int, ...]  # regime indices (REGIMES) with at least one observation
    has_many: bool  # some observation with num_replicas > 2 (on one node or several)
    one_bsz: bool  # a single local batch size
    min_bsz: float  # smallest local batch observed (1-replica observations preferred)
    bsz0: float  # the batch size of a one_bsz type

    @classmethod
    def of(cls, observations: Iterable[Observation]) -> Regimes:
        cols = throughput_arrays(observations)
        nodes, replicas, bsz = cols["num_nodes"], cols["num_replicas"], cols["local_bsz"]
        single = replicas == 1
        return cls(
            covered=tuple(sorted({int(r) for r in config_regime(nodes, replicas)})),
            has_many=bool(np.any(replicas > 2)),
            one_bsz=len(np.unique(bsz)) == 1,
            min_bsz=float(bsz[single].min()) if single.any() else float(bsz.min()),
            bsz0=float(bsz[0]),
        )

    @property
    def has_multi(self) -> bool:
        return any(r > 0 for r in self.covered)

    @property
    def has_single_node_multi(self) -> bool:
        return 1 in self.covered or 2 in self.covered

    @property
    def has_inter(self) -> bool:
        return 3 in self.covered

    def unidentified(self) -> tuple[str, ...]:
        """Parameter groups the type's data cannot identify (mirrors :func:`fit_throughput`)."""
        out = []
        if self.one_bsz:
            out.append("alpha_c")
        if not self.has_multi:
            out += ["sync", "slope", "inter", "gamma"]
        else:
            if not self.has_many:
                out.append("slope")
            if not self.has_inter:
                out.append("inter")
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return {"covered": list(self.covered), "has_many": self.has_many, "one_bsz": self.one_bsz,
                "min_bsz": self.min_bsz, "bsz0": self.bsz0}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Regimes:
        return cls(covered=tuple(int(r) for r in data["covered"]), has_many=bool(data["has_many"]),
                   one_bsz=bool(data["one_bsz"]), min_bsz=float(data["min_bsz"]), bsz0=float(data["bsz0"]))


def compute_reference(params: ThroughputParams, bsz: float) -> float:
    """Seconds of one micro-batch of compute at ``bsz``: ``α_c + β_c · bsz``."""
    return float(params.alpha_c + params.beta_c * bsz)


SIZE_PROXY_FLOOR = 0.05  # α_c below this fraction of c_ref (a fit that put all compute per sample) counts as this


def size_proxy(params: ThroughputParams, bsz: float) -> float:
    """Seconds that scale with a model's size (gradient bytes) when its parameter count is unknown.

    ``√(α_c · c_ref)``, the geometric mean of two proxies from a fit to 1-GPU observations: the
    compute at the smallest micro-batch ``c_ref = α_c + β_c · bsz`` (:func:`compute_reference`),
    which also grows with the FLOPs per sample (a convolutional network's sync is small next to
    it), and the batch-independent compute ``α_c`` (optimizer step and per-parameter work, but
    also fixed overheads). Across the other jobs on a GPU type, the leave-one-job-out error of a
    job's intra-node sync predicted by the ratio of either proxy alone is smaller for one dataset
    and larger for another; their geometric mean cut the cold (P1) median error on Pollux's T4
    traces from 18.4% to 14.1% and on Gavel's from 31.5% to 30.9%
    (``experiments/results/accuracy.md``, round 5).
    """
    c_ref = compute_reference(params, bsz)
    return math.sqrt(max(params.alpha_c, SIZE_PROXY_FLOOR * c_ref) * c_ref)


def _size_ratio(size: float | None, own_proxy: float | None, own_c_ref: float, other: JobTypeSummary) -> float:
    """λ guess of another job's sync on the job's: the ratio of model sizes, else of size proxies, else of compute references."""
    if size is not None and other.size:
        return size / other.size
    if own_proxy is not None and other.size_proxy is not None:
        return own_proxy / other.size_proxy
    return own_c_ref / other.c_ref


# ====================================================================== priors from other jobs


@dataclass(frozen=True)
class JobTypeSummary:
    """What one job's fitted model says about one GPU type (an entry of a :class:`ClusterPrior`)."""

    job: str
    gpu_type: str
    params: ThroughputParams
    regimes: Regimes
    c_ref: float  # compute seconds at the job's smallest micro-batch on this type
    size: float | None = None  # model parameters (when reported)
    size_proxy: float | None = None  # size_proxy() of a fit to its 1-GPU observations (None: < 2 batch sizes there)
    params_g: ThroughputParams | None = None  # fit with γ held at TRANSFER_GAMMA (when it ran multi-GPU)
    struct_multi: float | None = None  # RMS log residual of its fit on multi-GPU single-node configurations
    struct_inter: float | None = None  # ... on multi-node configurations

    def to_dict(self) -> dict[str, Any]:
        out = {
            "job": self.job,
            "gpu_type": self.gpu_type,
            "params": {k: v for k, v in self.params.to_dict().items() if k != "fixed"},
            "fixed": list(self.params.fixed),
            "regimes": self.regimes.to_dict(),
            "c_ref": self.c_ref,
        }
        for key in ("size", "size_proxy", "struct_multi", "struct_inter"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.params_g is not None:
            out["params_g"] = {k: v for k, v in self.params_g.to_dict().items() if k != "fixed"}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobTypeSummary:
        params = ThroughputParams(**data["params"], fixed=tuple(data.get("fixed", ())))
        return cls(
            job=data["job"],
            gpu_type=normalize_gpu_type(data["gpu_type"]),
            params=params,
            regimes=Regimes.from_dict(data["regimes"]),
            c_ref=float(data["c_ref"]),
            size=data.get("size"),
            size_proxy=None if data.get("size_proxy") is None else check_float("size_proxy", data["size_proxy"], positive=True),
            params_g=ThroughputParams(**data["params_g"]) if data.get("params_g") else None,
            struct_multi=data.get("struct_multi"),
            struct_inter=data.get("struct_inter"),
        )


def _one_gpu_size_proxy(items: list[Observation], params: ThroughputParams, regimes: Regimes) -> float | None:
    """:func:`size_proxy` of a fit to the 1-GPU observations (``None`` with fewer than 2 batch sizes there).

    ``params`` is the fit to all ``items``: it is that fit already when they are all 1-GPU.
    """
    one = [o for o in items if o.num_replicas == 1]
    if len({o.local_bsz for o in one}) < 2:
        return None
    return size_proxy(fit_throughput(one) if regimes.has_multi else params, min(o.local_bsz for o in one))


def _rms_residual(params: ThroughputParams, obs: list[Observation], mask_fn: Any, shape: SyncShape | None = None) -> float | None:
    cols = throughput_arrays(obs)
    mask = mask_fn(cols["num_nodes"], cols["num_replicas"])
    if mask.sum() < 2:
        return None
    pred = _step_time(params.as_array(), cols["num_nodes"][mask], cols["num_replicas"][mask], cols["local_bsz"][mask], cols["accum_steps"][mask],
                      shape)
    return float(np.sqrt(np.mean(np.log(cols["step_time"][mask] / pred) ** 2)))


CALIBRATION_MIN_JOBS = 2  # jobs with multi-GPU data a calibration factor needs (per type, else pooled)
CALIBRATION_RANGE = (0.5, 3.0)  # a calibration factor is clipped to this range
CALIBRATION_LEVEL = 0.9
# Where a job that has run multi-GPU (on one node of some type) still predicts by transfer
# (ClusterPrior.warm_calibration): the multi-node regime of a type with single-node multi-GPU data,
# and the single-node and multi-node regimes of a type it has run on 1 GPU only.
WARM_SITUATIONS = ("same type, multi-node", "other type, single-node", "other type, multi-node")


def _warm_situations(same_type: bool, inter: np.ndarray) -> list[tuple[str, np.ndarray]]:
    if same_type:
        return [(WARM_SITUATIONS[0], inter)]
    return [(WARM_SITUATIONS[1], ~inter), (WARM_SITUATIONS[2], inter)]


def _log_predictions(model: Any, rows: list[Observation]) -> tuple[np.ndarray, np.ndarray]:
    """Predicted log step time and its log-std of ``rows`` (any GPU types) under ``model``, in their order."""
    mean, std = np.empty(len(rows)), np.empty(len(rows))
    for gpu, index in indices_by_gpu_type(rows).items():
        cols = throughput_arrays([rows[i] for i in index])
        pred = model.predict(gpu, cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"])
        mean[index], std[index] = np.log(np.asarray(pred.step_time)), np.asarray(pred.log_std)
    return mean, std


def _abs_z(model: Any, rows: list[Observation]) -> tuple[np.ndarray, np.ndarray]:
    """``|log(measured / predicted)| / predicted log-std`` of ``rows`` under ``model``, and which are multi-node."""
    cols = throughput_arrays(rows)
    mean, std = _log_predictions(model, rows)
    return np.abs(np.log(cols["step_time"]) - mean) / np.maximum(std, 1e-9), cols["num_nodes"] > 1


def _cold_split(obs: Sequence[Observation]) -> tuple[list[Observation], list[Observation]]:
    """A job's 1-GPU observations (what a cold job knows) and its multi-GPU ones on the types they cover."""
    single = [o for o in obs if o.num_replicas == 1]
    types = {o.gpu_type for o in single}
    return single, [o for o in obs if o.num_replicas > 1 and o.gpu_type in types]


def _scale_factor(items: Sequence[tuple[np.ndarray, float]]) -> float:
    """Weighted ``CALIBRATION_LEVEL`` quantile of |z| (each item: z-scores and the weight of each) over the normal's."""
    z = np.concatenate([v for v, _ in items])
    w = np.concatenate([np.full(v.size, weight) for v, weight in items])
    ok = np.isfinite(z)
    z, w = z[ok], w[ok]
    if not z.size:
        return 1.0
    order = np.argsort(z)
    cum = np.cumsum(w[order]) / w.sum()
    q = float(z[order][min(int(np.searchsorted(cum, CALIBRATION_LEVEL)), z.size - 1)])
    normal = 1.6448536269514722  # the normal's 95% quantile (two-sided 90%)
    low, high = CALIBRATION_RANGE
    return min(max(q / normal, low), high)


@dataclass
class ClusterPrior:
    """Per-GPU-type knowledge from other jobs' fitted models on the same cluster.

    Build it with :meth:`from_observations` (fits Pollux's model per job and
    type) or :meth:`from_models` (other :class:`~goodput.model.JobModel`\\ s);
    save/load it as JSON. ``exclude`` drops a job (leave-one-out evaluation).
    """

    summaries: list[JobTypeSummary] = field(default_factory=list)
    # Per GPU type (and "*" for all), the factor on the predictive log-std of a cold job's
    # multi-GPU configurations (see cold_calibration); None: not computed yet.
    calibration: dict[str, float] | None = None
    # Per situation of WARM_SITUATIONS, the factor on the predictive log-std of a job that has run
    # multi-GPU, in the regimes a type has not been observed in (see warm_calibration); None: not computed yet.
    warm: dict[str, float] | None = None
    # Per GPU type, the shape of inter-node sync its jobs share (goodput.sync_shape); the summaries'
    # fits of that type were made with it.
    shapes: dict[str, SyncShape] = field(default_factory=dict)
    # The weight of the weak default sync profile among a cold job's transfer members (see
    # cold_share); None: not computed yet.
    default_share: float | None = None
    # The jobs' raw observations, when built from them (not saved): what the calibrations need.
    observations: dict[str, list[Observation]] | None = field(default=None, repr=False, compare=False)
    sizes: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    _excluded: dict[str, ClusterPrior] = field(default_factory=dict, init=False, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    @single_threaded
    def from_observations(
        cls, observations: Mapping[str, Iterable[Observation]], sizes: Mapping[str, float] | None = None
    ) -> ClusterPrior:
        """Fit every (job, GPU type) of ``{job: observations}`` and summarise it (the observations are kept for :meth:`cold_calibration`).

        Each type's inter-node sync shape is learned first (:func:`~goodput.sync_shape.learn_sync_shape`),
        and the fits of that type are made with it.
        """
        kept = {job: list(obs) for job, obs in observations.items()}
        shapes = _learn_shapes(kept)
        out = []
        for job, obs in kept.items():
            for gpu, items in sorted(by_gpu_type(obs).items()):
                params = fit_throughput(items, sync_shape=shapes.get(gpu))
                out.append(cls._summary(job, gpu, params, items, (sizes or {}).get(job), shapes.get(gpu)))
        return cls(out, shapes=shapes, observations=kept, sizes=dict(sizes or {}))

    @classmethod
    @single_threaded
    def from_models(cls, models: Iterable[Any]) -> ClusterPrior:
        """Summaries of other jobs' :class:`~goodput.model.JobModel` s (each type's fit to all its data).

        A model's own per-type fits are reused where it holds them up to date
        (no refit) and the models do not teach a sync shape for that type; anything
        else is fitted here.
        """
        models = list(models)
        shapes = _learn_shapes({model.job: list(model.observations) for model in models})
        out = []
        for model in models:
            size = getattr(model, "model_size", None)
            own_fit = getattr(model, "own_fit", None)
            for gpu, items in sorted(by_gpu_type(model.observations).items()):
                shape = shapes.get(gpu)
                params = own_fit(gpu) if own_fit is not None and shape is None else fit_throughput(items, sync_shape=shape)
                out.append(cls._summary(model.job, gpu, params, items, size, shape))
        return cls(out, shapes=shapes)

    @staticmethod
    def _summary(job: str, gpu: str, params: ThroughputParams, items: list[Observation], size: float | None,
                 shape: SyncShape | None = None) -> JobTypeSummary:
        regimes = Regimes.of(items)
        return JobTypeSummary(
            job=job,
            gpu_type=gpu,
            params=params,
            regimes=regimes,
            c_ref=compute_reference(params, regimes.min_bsz),
            size=size,
            size_proxy=_one_gpu_size_proxy(items, params, regimes),
            params_g=fit_throughput(items, gamma=TRANSFER_GAMMA, sync_shape=shape) if regimes.has_multi else None,
            struct_multi=_rms_residual(params, items, lambda n, r: (r > 1) & (n == 1)),
            struct_inter=_rms_residual(params, items, lambda n, r: n > 1, shape),
        )

    def exclude(self, job: str) -> ClusterPrior:
        """The prior without ``job`` (leave-one-out). Built from observations, it is rebuilt from the
        others' (sync shapes relearned, fits redone; memoised); otherwise the job's summaries are
        dropped and the shapes kept."""
        if self.observations is None:
            return ClusterPrior([s for s in self.summaries if s.job != job], shapes=dict(self.shapes))
        if job not in self._excluded:
            kept = {j: o for j, o in self.observations.items() if j != job}
            self._excluded[job] = ClusterPrior.from_observations(kept, {j: v for j, v in self.sizes.items() if j != job})
        return self._excluded[job]

    def cold_calibration(self) -> dict[str, float]:
        """Per GPU type, the factor that makes a cold job's 90% intervals cover 90% on this cluster.

        A job seen only on 1 GPU per type (Sia's bootstrap) is predicted on multi-GPU
        configurations almost entirely from the other jobs' sync profiles, and whether they
        transfer well is a property of the cluster: Pollux's T4 jobs resemble each other, Gavel's
        K80/P100/V100 jobs do not. This measures it on the cluster's own jobs, leave-one-job-out:
        each job with multi-GPU observations is modelled from its 1-GPU observations and the
        other jobs (:class:`~goodput.model.JobModel`, the same path a new job takes), and the
        factor is the weighted 90% quantile of ``|z|`` of its multi-GPU observations over the
        normal's 1.645, each job weighing the same (split conformal calibration of a scale:
        Angelopoulos & Bates, "A gentle introduction to conformal prediction", 2021, §2). Per type
        when at least :data:`CALIBRATION_MIN_JOBS` jobs ran multi-GPU there, otherwise the factor
        pooled over types ("*"); clipped to :data:`CALIBRATION_RANGE`. Empty (no correction)
        without the raw observations (a prior loaded from JSON carries the factors it was saved
        with) or with fewer jobs.
        """
        if self.calibration is not None:
            return self.calibration
        self.calibration = {}
        if self.observations is None or len(self.observations) < CALIBRATION_MIN_JOBS:
            return self.calibration
        scores: dict[str, list[tuple[np.ndarray, float]]] = {}
        for job, obs in sorted(self.observations.items()):
            single, multi = _cold_split(obs)
            if not single or not multi:
                continue
            model = self._left_out_model(job, single, self.cold_share())
            for gpu in sorted({o.gpu_type for o in multi}):
                z, _ = _abs_z(model, [o for o in multi if o.gpu_type == gpu])
                scores.setdefault(gpu, []).append((z, 1.0 / len(z)))
        pooled = [item for items in scores.values() for item in items]
        if len({id(z) for z, _ in pooled}) < CALIBRATION_MIN_JOBS:
            return self.calibration
        self.calibration["*"] = _scale_factor(pooled)
        for gpu, items in scores.items():
            if len(items) >= CALIBRATION_MIN_JOBS:
                self.calibration[gpu] = _scale_factor(items)
        return self.calibration

    def cold_share(self) -> float:
        """The weight of the weak default sync profile beside the other jobs' for a cold job, chosen on this cluster.

        A cold job (1-GPU profiles only) predicts its multi-GPU configurations from the other
        jobs' sync profiles scaled by size (:func:`_size_ratio`). Whether they beat Pollux's weak
        default is a property of the cluster: Pollux's T4 jobs resemble each other, Gavel's do
        not (``experiments/results/accuracy.md``, round 12). This stacks the two predictive
        means (Breiman, "Stacked regressions", *Machine Learning* 24, 1996; Yao et al., "Using
        stacking to average Bayesian predictive distributions", *Bayesian Analysis* 13, 2018):
        leave-one-job-out, each job with multi-GPU observations is modelled from its 1-GPU
        observations twice, with the other jobs' members only and with the default only, and
        the share w ∈ {0, 0.05, …, 1} minimises the mean absolute log error of the mixture
        ``(1 − w)·log T_others + w·log T_default`` on its multi-GPU observations, each job
        weighing the same. 0 (the other jobs only) without the raw observations or with fewer
        than :data:`CALIBRATION_MIN_JOBS` such jobs.
        """
        if self.default_share is not None:
            return self.default_share
        self.default_share = 0.0
        if self.observations is None or len(self.observations) < CALIBRATION_MIN_JOBS:
            return self.default_share
        errors: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for job, obs in sorted(self.observations.items()):
            single, multi = _cold_split(obs)
            if not single or not multi:
                continue
            logs = [_log_predictions(self._left_out_model(job, single, share), multi)[0] for share in (0.0, 1.0)]
            errors.append((np.log(throughput_arrays(multi)["step_time"]), *logs))
        if len(errors) < CALIBRATION_MIN_JOBS:
            return self.default_share
        grid = np.linspace(0.0, 1.0, 21)
        loss = [np.mean([np.mean(np.abs(y - (1.0 - w) * others - w * default)) for y, others, default in errors]) for w in grid]
        self.default_share = float(grid[int(np.argmin(loss))])
        return self.default_share

    def warm_calibration(self) -> dict[str, float]:
        """Per situation (:data:`WARM_SITUATIONS`), the factor that makes a warm job's 90% intervals cover 90%.

        A job that has run multi-GPU on some type still predicts the regimes a type has not
        been observed in from transfer rules: its multi-node configurations from its single-node
        ones and other jobs' inter/intra ratios (:func:`_ratio_member`), another type's
        multi-GPU configurations from its own fit carried over (:func:`_carried_members`) or
        other jobs' sync profiles. How well those rules hold is, like the cold job's case
        (:meth:`cold_calibration`), a property of the cluster, measured on it leave-one-job-out:
        each job is modelled from its 1-GPU observations and its single-node multi-GPU ones on
        one type (each such type in turn), with the other jobs as prior, and its observations
        in the regimes that model has not seen give ``|z|``. The factor is the weighted 90%
        quantile of ``|z|`` over the normal's 1.645 (each (job, type, situation) cell weighing
        the same), pooled over GPU types, with at least :data:`CALIBRATION_MIN_JOBS` jobs per
        situation; clipped to :data:`CALIBRATION_RANGE`. Empty without the raw observations or
        with fewer jobs. Computed once per prior, at the first refit of a warm job that uses it
        (8 s for 5 jobs × 5 types on the 2-core development VM; call it ahead, or :meth:`save`
        the prior, to keep it out of a scheduler's path).
        """
        if self.warm is not None:
            return self.warm
        self.warm = {}
        if self.observations is None or len(self.observations) < CALIBRATION_MIN_JOBS:
            return self.warm
        scores: dict[str, list[tuple[np.ndarray, float, str]]] = {}
        for job, obs in sorted(self.observations.items()):
            one = [o for o in obs if o.num_replicas == 1]
            one_types = {o.gpu_type for o in one}
            for warm_type in sorted({o.gpu_type for o in obs if o.num_replicas > 1 and o.num_nodes == 1} & one_types):
                model = self._left_out_model(job, one + [o for o in obs if o.gpu_type == warm_type and o.num_replicas > 1 and o.num_nodes == 1])
                for gpu in sorted(one_types):
                    rows = [o for o in obs if o.gpu_type == gpu and o.num_replicas > 1 and not (gpu == warm_type and o.num_nodes == 1)]
                    if not rows:
                        continue
                    z, inter = _abs_z(model, rows)
                    for situation, mask in _warm_situations(gpu == warm_type, inter):
                        if mask.any():
                            scores.setdefault(situation, []).append((z[mask], 1.0 / int(mask.sum()), job))
        for situation, items in scores.items():
            if len({job for _, _, job in items}) >= CALIBRATION_MIN_JOBS:
                self.warm[situation] = _scale_factor([(z, w) for z, w, _ in items])
        return self.warm

    def _left_out_model(self, job: str, train: list[Observation], share: float = 0.0) -> Any:
        """A :class:`~goodput.model.JobModel` of ``job`` fitted to ``train`` with the other jobs as prior
        (not calibrated: no nesting), a cold job's default share held at ``share``."""
        from .model import JobModel  # noqa: PLC0415 - model builds on this module

        others = dataclasses.replace(self.exclude(job), calibration={}, warm={}, default_share=share)  # no nesting
        model = JobModel(job, init_batch_size=min(o.local_bsz for o in train), cluster_prior=others, model_size=self.sizes.get(job))
        return model.observe(train)

    def warm_factors(self, regimes: Regimes) -> dict[int, float]:
        """:meth:`warm_calibration`'s factor per regime index that a type with these ``regimes`` has not been observed in."""
        factors = self.warm_calibration()
        if regimes.has_multi:
            if regimes.has_single_node_multi and not regimes.has_inter and WARM_SITUATIONS[0] in factors:
                return {3: factors[WARM_SITUATIONS[0]]}
            return {}
        out = {}
        if WARM_SITUATIONS[1] in factors:
            out[1] = out[2] = factors[WARM_SITUATIONS[1]]
        if WARM_SITUATIONS[2] in factors:
            out[3] = factors[WARM_SITUATIONS[2]]
        return out

    def cold_factor(self, gpu_type: str) -> float:
        """:meth:`cold_calibration`'s factor for one type (1 when there is none)."""
        calibration = self.cold_calibration()
        return float(calibration.get(gpu_type, calibration.get("*", 1.0)))

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
        """Summaries and the calibrations (computed now when the observations are at hand)."""
        return {"summaries": [s.to_dict() for s in self.summaries], "calibration": self.cold_calibration(),
                "warm_calibration": self.warm_calibration(), "sync_shapes": {t: shape.to_dict() for t, shape in sorted(self.shapes.items())},
                "default_share": self.cold_share()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterPrior:
        if not isinstance(data, Mapping) or not isinstance(data.get("summaries"), list):
            raise ValidationError("cluster_prior", data, "expected {'summaries': [...]}")
        calibration = data.get("calibration")
        if calibration is not None:
            if not isinstance(calibration, Mapping):
                raise ValidationError("cluster_prior.calibration", calibration, "expected {gpu_type: factor}")
            calibration = {str(k): check_float(f"calibration[{k!r}]", v, positive=True) for k, v in calibration.items()}
        warm = data.get("warm_calibration")
        if warm is not None:
            if not isinstance(warm, Mapping) or set(warm) - set(WARM_SITUATIONS):
                raise ValidationError("cluster_prior.warm_calibration", warm, f"expected {{situation: factor}}, situations {WARM_SITUATIONS}")
            warm = {str(k): check_float(f"warm_calibration[{k!r}]", v, positive=True) for k, v in warm.items()}
        shapes = data.get("sync_shapes") or {}
        if not isinstance(shapes, Mapping):
            raise ValidationError("cluster_prior.sync_shapes", shapes, "expected {gpu_type: sync shape}")
        shapes = {normalize_gpu_type(t): SyncShape.from_dict(v) for t, v in shapes.items()}
        share = data.get("default_share")
        if share is not None:
            share = check_float("cluster_prior.default_share", share, nonnegative=True)
            if share > 1.0:
                raise ValidationError("cluster_prior.default_share", share, "must be in [0, 1]")
        return cls([JobTypeSummary.from_dict(s) for s in data["summaries"]], calibration=calibration, warm=warm, shapes=shapes,
                   default_share=share)

    def save(self, path: str | os.PathLike[str]) -> Path:
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ClusterPrior:
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (json.JSONDecodeError, KeyError, TypeError, ValidationError) as exc:
            raise DataFormatError(path, None, "cluster_prior", str(exc)[:80], "not a saved ClusterPrior") from None

    # ------------------------------------------------------------------ queries
    def on(self, gpu_type: str, regime: int | None = None) -> list[JobTypeSummary]:
        """Summaries of other jobs on ``gpu_type`` (observed in ``regime`` when given)."""
        return [s for s in self.summaries if s.gpu_type == gpu_type and (regime is None or regime in s.regimes.covered)]

    def sync_shape(self, gpu_type: str) -> SyncShape | None:
        """The inter-node sync shape the cluster's jobs share on ``gpu_type`` (``None``: not learned there)."""
        return self.shapes.get(gpu_type)

    def find(self, job: str, gpu_type: str) -> JobTypeSummary | None:
        for s in self.summaries:
            if s.job == job and s.gpu_type == gpu_type:
                return s
        return None

    def struct(self, gpu_type: str, regime: int) -> float | None:
        """Typical error of Pollux's form in a regime: RMS log residual of other jobs' fits there."""
        key = "struct_inter" if regime == 3 else "struct_multi"
        values = [getattr(s, key) for s in self.summaries if s.gpu_type == gpu_type and getattr(s, key) is not None]
        if not values:
            values = [getattr(s, key) for s in self.summaries if getattr(s, key) is not None]
        return float(np.sqrt(np.mean(np.square(values)))) if values else None


def _learn_shapes(observations: Mapping[str, Sequence[Observation]]) -> dict[str, SyncShape]:
    """Per GPU type, :func:`~goodput.sync_shape.learn_sync_shape` of the jobs' observations there (types without one left out)."""
    per_type: dict[str, list[list[Observation]]] = {}
    for obs in observations.values():
        for gpu, items in by_gpu_type(obs).items():
            per_type.setdefault(gpu, []).append(items)
    shapes = {gpu: learn_sync_shape(jobs) for gpu, jobs in sorted(per_type.items())}
    return {gpu: shape for gpu, shape in shapes.items() if shape}


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
                     shape: SyncShape | None = None) -> list[tuple[np.ndarray, float]]:
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
    edges = np.concatenate([[gammas[0]], (np.array(gammas[1:]) + np.array(gammas[:-1])) / 2, [max(gammas[-1], GAMMA_GRID[-1])]])
    weights = np.diff(edges) * np.exp(np.array(log_like) - max(log_like))
    keep = weights >= GAMMA_MIN_WEIGHT * weights.sum()  # negligible overlaps would only cost prediction time
    weights = weights[keep] / weights[keep].sum()
    return list(zip([t for t, k in zip(thetas, keep) if k], weights.tolist()))


def _ratio_members(grid: Sequence[tuple[np.ndarray, float]], own: np.ndarray, other: JobTypeSummary) -> list[Member]:
    """:func:`_ratio_member` of each γ of a :func:`_gamma_posterior`, with its weight and the job's own compute terms."""
    out = []
    for theta, weight in grid:
        member = _ratio_member(theta, other)
        if member is not None:
            member.theta[0], member.theta[1] = own[0], own[1]
            out.append(Member(member.theta, weight, member.source))
    return out


# Above this overlap γ, a single-node fit's sync can hide behind its compute (the step is within
# 2^(1/γ) − 1 < 26% of the larger of the two): its sync terms are not identified well enough to
# carry to a type where compute is faster and the sync shows (Gavel's resnet-18 on K80: γ = 4.4).
CARRY_MAX_GAMMA = 3.0


def _carried_members(own: np.ndarray, own_ref: np.ndarray, ref_grid: Sequence[tuple[np.ndarray, float]] | None, ref_regimes: Regimes,
                     ref_c: float, on_ref: JobTypeSummary, other: JobTypeSummary) -> list[Member]:
    """Multi-node members of a type without multi-GPU data: the job's own fit on a reference type, carried over.

    The job's fit on type ``ref`` (``own_ref``: its sync terms and γ; when ``ref`` has no
    multi-node data, P3's ratio rule, :func:`_ratio_member`, from the other job on ``ref``,
    applied to each γ of ``ref_grid``, the :func:`_gamma_posterior` of its data, with its
    weight), with this type's compute terms and the inter-node terms × the other job's ratio
    of inter-node sync between the two types (α_n here / α_n on ``ref``, γ-held fits): what
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
        weighted = [(m.theta, m.weight) for m in _ratio_members(ref_grid or [(own_ref, 1.0)], own, on_ref)]
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
    ``cache`` (a dict the caller keeps) memoises the γ-held fits by (type, number of observations).
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
            value = _gamma_posterior(observations[t], noise, own_fits[t], shapes[t])
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
                f = min(max(float(np.median(fractions)), 1e-6), 1 - 1e-6)
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
                        group = _ratio_members(gamma_grid(gpu), own, other)
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
                        for ref in sorted(multi_cols, key=lambda t: -len(multi_cols[t]["step_time"])):
                            on_ref = cluster_prior.find(other.job, ref)
                            if regime == 3 and on_ref is not None:
                                ref_grid = gamma_grid(ref) if regimes[ref].has_single_node_multi and not regimes[ref].has_inter else None
                                carried = _carried_members(own, own_fits[ref].as_array(), ref_grid, regimes[ref], c_ref[ref], on_ref, other)
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

