"""Priors from other jobs on the same cluster: per GPU type, what their fitted models say.

A :class:`ClusterPrior` summarises, per (job, GPU type), the job's Pollux fit
(Qiao et al., OSDI'21, §3.2) to all its observations there
(:class:`JobTypeSummary`): its compute reference and size proxy, its sync
profile at the shared overlap :data:`TRANSFER_GAMMA`, and how well Pollux's form
fits each regime. :mod:`goodput.transfer` builds a new job's ensembles for the
regimes it has not been observed in from these summaries.

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

Where the cluster's jobs share a shape of inter-node sync over placements, the
prior learns it per type (:mod:`goodput.sync_shape`) and fits every summary of
that type with it.

Example::

    prior = ClusterPrior.from_observations(other_jobs_observations)   # {job: [Observation]}
    prior.save("cluster-prior.json")                                   # atomic JSON
    model = JobModel("new-job", init_batch_size=128, cluster_prior=ClusterPrior.load("cluster-prior.json"))
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

from .errors import DataFormatError, ValidationError
from .io import atomic_write_text
from .observations import Observation, by_gpu_type, indices_by_gpu_type
from .regimes import Regimes
from .sync_shape import SyncShape, learn_sync_shape
from .threads import single_threaded
from .throughput import ThroughputParams, _step_time, fit_throughput, throughput_arrays
from .validation import check_float, check_sizes, normalize_gpu_type

__all__ = [
    "TRANSFER_GAMMA",
    "WARM_SITUATIONS",
    "ClusterPrior",
    "JobTypeSummary",
    "compute_reference",
    "size_proxy",
]

# Sync profiles are transferred as fits with γ held at this value: on configurations where
# sync hides behind compute, γ and the sync costs are nearly collinear, so profiles with
# different fitted γ are not comparable (one job's γ = 2.5 with large α_r explains the same
# single-node steps as γ = 1 with small α_r, but predicts very different multi-node ones).
TRANSFER_GAMMA = 1.5  # between no overlap (1) and full overlap (10)


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
            c_ref=check_float("c_ref", data["c_ref"], positive=True),
            size=_optional(data, "size", positive=True),
            size_proxy=_optional(data, "size_proxy", positive=True),
            params_g=ThroughputParams(**data["params_g"]) if data.get("params_g") else None,
            struct_multi=_optional(data, "struct_multi", nonnegative=True),
            struct_inter=_optional(data, "struct_inter", nonnegative=True),
        )


def _optional(data: Mapping[str, Any], key: str, **bounds: bool) -> float | None:
    return None if data.get(key) is None else check_float(key, data[key], **bounds)


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
CALIBRATION_RANGE = (0.5, 3.0)  # a cold calibration factor is clipped to this range
# A warm factor may go lower: the transfer rules' ensembles (the γ posterior, two rules per other
# job) spread wider than their errors, and the cluster measures 0.30–0.43 on Pollux's T4 traces
# and the derived 5-type set (accuracy.md round 21), where 0.5 clipped every prior.
WARM_CALIBRATION_RANGE = (0.25, 3.0)
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


def _scale_factor(items: Sequence[tuple[np.ndarray, float]], bounds: tuple[float, float] = CALIBRATION_RANGE) -> float:
    """Weighted ``CALIBRATION_LEVEL`` quantile of |z| (each item: z-scores and the weight of each) over the normal's, within ``bounds``."""
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
    low, high = bounds
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
        kept, sizes = _checked_observations(observations), check_sizes("sizes", sizes, allow_unknown=True)
        shapes = _learn_shapes(kept)
        out = []
        for job, obs in kept.items():
            for gpu, items in sorted(by_gpu_type(obs).items()):
                params = fit_throughput(items, sync_shape=shapes.get(gpu))
                out.append(cls._summary(job, gpu, params, items, sizes.get(job), shapes.get(gpu)))
        return cls(out, shapes=shapes, observations=kept, sizes=sizes)

    @classmethod
    @single_threaded
    def from_models(cls, models: Iterable[Any]) -> ClusterPrior:
        """Summaries of other jobs' :class:`~goodput.model.JobModel` s (each type's fit to all its data).

        A model's own per-type fits are reused where it holds them up to date
        (no refit) and the models do not teach a sync shape for that type; anything
        else is fitted here.
        """
        models = list(models)
        for index, model in enumerate(models):
            if not isinstance(getattr(model, "job", None), str) or not hasattr(model, "observations"):
                raise ValidationError(f"models[{index}]", model, "expected a JobModel (with .job and .observations)")
        shapes = _learn_shapes({model.job: list(model.observations) for model in models})
        out = []
        for model in models:
            size = getattr(model, "model_size", None)
            if size is not None:
                size = check_float(f"models[{model.job!r}].model_size", size, positive=True)
            own_fit = getattr(model, "own_fit", None)
            for gpu, items in sorted(by_gpu_type(model.observations).items()):
                shape = shapes.get(gpu)
                # the model's own fit is this prior's only if it was made without a shape and without a caller's prior
                plain = own_fit is not None and shape is None and getattr(model, "sync_shape", lambda g: None)(gpu) is None \
                    and gpu not in getattr(model, "_prior", {})
                params = own_fit(gpu) if plain else fit_throughput(items, sync_shape=shape)
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
        others' (sync shapes relearned, fits redone; memoised). Otherwise (loaded, or from models)
        the job's summaries are dropped, and so are the sync shapes of the types it ran on several
        nodes of (they were learned with it); the other jobs' fits stay as they were made, under
        the shapes, so such a prior is not exactly leave-one-out. A job the prior does not hold (a
        new job's name) leaves it as it is: this prior itself is returned, nothing is refitted."""
        held = self.observations.keys() if self.observations is not None else {s.job for s in self.summaries}
        if job not in held:
            return self
        if self.observations is None:
            taught = {s.gpu_type for s in self.summaries if s.job == job and s.regimes.has_inter}
            return ClusterPrior([s for s in self.summaries if s.job != job],
                                shapes={t: shape for t, shape in self.shapes.items() if t not in taught})
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
        scored: set[str] = set()  # jobs, not (job, type) cells: one job on two types is one job
        for job, obs in sorted(self.observations.items()):
            single, multi = _cold_split(obs)
            if not single or not multi:
                continue
            model = self._left_out_model(job, single, self.cold_share())
            for gpu in sorted({o.gpu_type for o in multi}):
                z, _ = _abs_z(model, [o for o in multi if o.gpu_type == gpu])
                scores.setdefault(gpu, []).append((z, 1.0 / len(z)))
                scored.add(job)
        pooled = [item for items in scores.values() for item in items]
        if len(scored) < CALIBRATION_MIN_JOBS:
            return self.calibration
        self.calibration["*"] = _scale_factor(pooled)
        for gpu, items in scores.items():
            if len(items) >= CALIBRATION_MIN_JOBS:
                self.calibration[gpu] = _scale_factor(items)
        return self.calibration

    def cold_share(self) -> float:
        """The weight of the weak default sync profile beside the other jobs' for a cold job, chosen on this cluster.

        A cold job (1-GPU profiles only) predicts its multi-GPU configurations from the other
        jobs' sync profiles scaled by size (:func:`goodput.transfer._size_ratio`). Whether they beat Pollux's weak
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
        ones and other jobs' inter/intra ratios (:func:`goodput.transfer._ratio_member`), another type's
        multi-GPU configurations from its own fit carried over (:func:`goodput.transfer._carried_members`) or
        other jobs' sync profiles. How well those rules hold is, like the cold job's case
        (:meth:`cold_calibration`), a property of the cluster, measured on it leave-one-job-out:
        each job is modelled from its 1-GPU observations and its single-node multi-GPU ones on
        one type (each such type in turn), with the other jobs as prior, and its observations
        in the regimes that model has not seen give ``|z|``. The factor is the weighted 90%
        quantile of ``|z|`` over the normal's 1.645 (each (job, type, situation) cell weighing
        the same), pooled over GPU types, with at least :data:`CALIBRATION_MIN_JOBS` jobs per
        situation; clipped to :data:`WARM_CALIBRATION_RANGE`. Empty without the raw observations or
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
                self.warm[situation] = _scale_factor([(z, w) for z, w, _ in items], WARM_CALIBRATION_RANGE)
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
        summaries = []
        for index, item in enumerate(data["summaries"]):
            try:
                summaries.append(JobTypeSummary.from_dict(item))
            except (KeyError, TypeError, AttributeError) as exc:
                raise ValidationError(f"cluster_prior.summaries[{index}]", item, f"not a job summary ({type(exc).__name__}: {exc})") from None
        return cls(summaries, calibration=calibration, warm=warm, shapes=shapes, default_share=share)

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


def _checked_observations(observations: Any) -> dict[str, list[Observation]]:
    """``{job: [Observation, ...]}`` as lists, every item checked (a ValidationError names the first bad one)."""
    if not isinstance(observations, Mapping):
        raise ValidationError("observations", type(observations).__name__, "expected {job: [Observation, ...]}")
    kept: dict[str, list[Observation]] = {}
    for job, obs in observations.items():
        if not isinstance(job, str) or not job:
            raise ValidationError("observations", job, "job names must be non-empty strings")
        if isinstance(obs, (str, bytes, Observation)) or not isinstance(obs, Iterable):
            raise ValidationError(f"observations[{job!r}]", type(obs).__name__, "expected an iterable of Observation")
        kept[job] = list(obs)
        for index, o in enumerate(kept[job]):
            if not isinstance(o, Observation):
                raise ValidationError(f"observations[{job!r}][{index}]", o, "expected an Observation")
    return kept


def _learn_shapes(observations: Mapping[str, Sequence[Observation]]) -> dict[str, SyncShape]:
    """Per GPU type, :func:`~goodput.sync_shape.learn_sync_shape` of the jobs' observations there (types without one left out)."""
    per_type: dict[str, list[list[Observation]]] = {}
    for obs in observations.values():
        for gpu, items in by_gpu_type(obs).items():
            per_type.setdefault(gpu, []).append(items)
    shapes = {gpu: learn_sync_shape(jobs) for gpu, jobs in sorted(per_type.items())}
    return {gpu: shape for gpu, shape in shapes.items() if shape}
