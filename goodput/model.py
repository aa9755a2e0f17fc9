"""A job's performance model: throughput per GPU type, efficiency, goodput.

:class:`JobModel` holds every observation of one job. It models the job's step
time on each GPU type with Pollux's throughput model (:mod:`goodput.throughput`),
tracks the job's gradient statistics for statistical efficiency
(:mod:`goodput.efficiency`), and answers a scheduler's questions: the step time
of a configuration, the best batch configuration and goodput of an allocation,
and a goodput table over a cluster's configurations.

The model is Bayesian (``bayesian=True``, the default): one posterior over the
job's Pollux parameters on all its GPU types and a Gaussian-process residual
(:mod:`goodput.posterior`), under a hierarchical prior that other jobs on the
cluster inform (:mod:`goodput.hierarchy`, :class:`ClusterPrior`; weak defaults
without one). Every observation — on any type, 1 GPU or many — enters through
that one likelihood; predictions carry a standard deviation.

Updates are online: :meth:`JobModel.observe` conditions the GP posterior on the
new observations at once (an O(n²) Cholesky update) without refitting. The
maximum a posteriori parameters (the linearisation point) and the GP
hyperparameters are refitted now and then, lazily at the next question: after
``refit_every`` new observations (default: a quarter of those held at the last
refit, at least one; the hyperparameters too), when an observation is
surprising (``|z| > surprise``, or the mean z of the n ≥ 3 since the last
refit beyond ``surprise / √n``: the hyperparameters too, as the GP's scale
and length scales of the fewer observations before it may not hold for it),
when a new GPU type appears, or on :meth:`JobModel.refit`. A refit also reads
changes of the job's speed among its timestamped steps (:mod:`goodput.shifts`):
the steps before one are read at the current speed. Numerical trouble
never raises: the GP escalates jitter, then the prediction falls back to the
parametric one with an inflated ``std`` (:attr:`JobModel.diagnostics`).

With ``bayesian=False`` the model is the plain per-type Pollux fit, refitted
lazily whenever a type's data change, with ``std`` 0.

Example::

    model = JobModel("cifar10", init_batch_size=128, max_batch_size=4096,
                     local_bsz_bounds=(16, 512))
    model.observe(profile.observations)
    model.predict("t4", num_nodes=1, num_replicas=4, local_bsz=128).step_time
    best = model.goodput("t4", num_nodes=2, num_replicas=8)
    best.goodput, best.batch_size, best.local_bsz, best.accum_steps
    model.table(Cluster.parse("t4:6x4,a100:2x8")).frame
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from .cluster import Cluster
from .efficiency import check_batch_sizes
from .efficiency import efficiency as _efficiency
from .errors import UnknownGPUTypeError, ValidationError
from .gp import FEATURE_NAMES, GPHyperparameters, GPNumericalError, HyperPrior
from .cells import default_means_by_type, default_prior
from .hierarchy import EFFECT_DOF, SCALE_BLOCKS, ClusterPrior, log_size_proxies
from .hybrid import Stages, check_min_replicas, check_observation_stages, replicas_of, stages_of
from .lognormal import lognormal_std
from .observations import Observation, Profile
from .optimize import BatchLimits, GoodputChoices, optimize_goodput
from .posterior import DEFAULT_HYPER_PRIOR, JobPosterior, build_posterior
from .shifts import MIN_REGIME_POINTS, LevelShift, at_current_speed
from .sync_shape import SyncShape
from .table import GoodputTable
from .tails import gaussian_t_quantile, split_std
from .threads import single_threaded
from .throughput import ThroughputParams, _step_time, config_arrays, fit_throughput
from .validation import MAX_BATCH, check_bounds, check_float, check_int, check_str, normalize_gpu_type

__all__ = ["JobModel", "Prediction", "GoodputChoice"]

MAX_SHIFT_REFITS = 4  # refits one refit may add to read changes of the job's speed (goodput.shifts)
SETTLED_LOG_FACTOR = 0.02  # a change's rest below this (2%, under the steps' typical noise) is read as settled


@dataclass(frozen=True)
class Prediction:
    """Predicted step time of a configuration (scalars, or arrays for array inputs).

    The Bayesian model predicts log step time as a normal distribution:
    ``step_time`` is its median ``exp(μ)`` (the geometric mean; what a
    log-space fit estimates), ``log_std`` the std of the log, and ``std`` the
    standard deviation of the step time itself (log-normal).

    Attributes:
        step_time: predicted seconds of one optimizer step (median).
        std: standard deviation of the step time, seconds: the log-normal's of ``log_std`` (under Student-t
            noise the step time's own has no finite value, a t having no exponential moments).
        throughput: samples/s at ``step_time``.
        log_std: standard deviation of log step time (0 for a point estimate), the measurement noise
            counted by its scale.
        noise_log_std, noise_dof: that noise's scale (std of log step time) and Student-t degrees of
            freedom (:mod:`goodput.tails`; ``inf``: Gaussian): its tails widen :meth:`interval`.
    """

    step_time: Any
    std: Any
    throughput: Any
    log_std: Any = 0.0
    noise_log_std: Any = 0.0
    noise_dof: float = math.inf

    def interval(self, level: float = 0.9) -> tuple[Any, Any]:
        """Central ``level`` interval of the step time, seconds: ``step_time · exp(±z)`` with ``z`` the
        ``(1 + level) / 2`` quantile of log step time's spread: normal (``z = Φ⁻¹ · log_std``), or with
        Student-t noise a normal of std ``√(log_std² − noise_log_std²)`` plus ``noise_log_std · t_ν``."""
        level = check_float("level", level, positive=True)
        if level >= 1:
            raise ValidationError("level", level, "must be in (0, 1)")
        gaussian, noise = split_std(self.log_std, self.noise_log_std)
        spread = np.exp(gaussian_t_quantile(gaussian, noise, self.noise_dof, 0.5 + level / 2))
        low, high = np.asarray(self.step_time) / spread, np.asarray(self.step_time) * spread
        if np.ndim(low) == 0:
            return float(low), float(high)
        return low, high


@dataclass(frozen=True)
class GoodputChoice:
    """The goodput-maximising batch configuration of one allocation.

    ``goodput`` is samples/s × statistical efficiency and 0 when no batch within
    the job's limits fits; ``std`` is the standard deviation of goodput (same unit).
    """

    gpu_type: str
    num_nodes: int
    num_replicas: int
    goodput: float
    std: float
    throughput: float
    efficiency: float
    step_time: float
    batch_size: int
    local_bsz: int
    accum_steps: int

    @property
    def feasible(self) -> bool:
        return self.goodput > 0


class JobModel:
    """One job's model across GPU types.

    Args:
        job: the job's name; observations of other jobs are refused.
        init_batch_size: the reference batch M0 at which the job's learning
            rate and hyperparameters were tuned, samples.
        max_batch_size: the largest total batch the job tolerates (``None``:
            M0, no batch scaling). Where no batch up to it splits evenly over
            the replicas, the micro-batch is rounded up as Pollux does (M0 =
            128 on 3 GPUs runs 3 × 43 = 129; :class:`~goodput.optimize.BatchLimits`).
        local_bsz_bounds: ``(min, max)`` per-replica micro-batch, or a mapping
            ``{gpu_type: (min, max)}`` (memory differs by GPU type); ``None``:
            no limit beyond ``max_batch_size``.
        accumulation: allow gradient accumulation to reach large batches.
        bayesian: the hierarchical prior and GP residual with online updates
            (``False``: the plain per-type Pollux fit, ``std`` 0). Where a
            step on several replicas has its ``sync_time``, its compute
            (``Observation.compute_time``) enters the Bayesian model's
            likelihood beside its step time, online and at each refit (the
            plain fit uses it too; the cluster prior's cells fit step times
            alone).
        cluster_prior: other jobs on the same cluster
            (:class:`~goodput.hierarchy.ClusterPrior`): the prior of this job's
            parameters on every type (weak defaults without one).
        model_size: the job's parameter count, when known: places it on the
            cluster prior's size slopes (gradient bytes drive its sync costs);
            unknown, one is read off its 1-GPU compute at two or more batch
            sizes (:func:`goodput.cells.one_gpu_log_proxy`).
        refit_every: refit after this many new observations (``None``: a
            quarter of those held at the last refit, at least one).
        surprise: refit when a new observation's ``|z|`` exceeds this, or the
            mean z of the ``n`` (at least 3) since the last refit exceeds this
            over ``√n``.
        gp_hyperparameters: initial GP hyperparameters (e.g. another job's on
            the same cluster, :attr:`gp_hyperparameters`): used until the
            job's own observations call for a refit of the hyperparameters,
            which then starts from them.
        max_gp_points: a refit conditions the GP on at most this many (most
            recent) step observations; between refits it conditions on up to a
            quarter more, then refits.
        num_stages: GPUs per data-parallel replica, an ``int`` or
            ``{gpu_type: int}`` (:mod:`goodput.hybrid`): 1 for a data-parallel
            job, the pipeline stages of a hybrid-parallel one. Its replicas are
            then pipelines (``num_replicas`` everywhere in the model, as in its
            observations, whose ``num_stages`` must match), and its
            configurations whole pipelines: :meth:`table` lists only GPU counts
            that are multiples of the type's stage count, and :meth:`goodput`
            with ``num_gpus=`` gives 0 for any other (as Sia, SOSP'23, does).
        min_replicas: the fewest replicas (pipelines) the job runs on;
            configurations with fewer are left out of :meth:`table` and have
            goodput 0 in :meth:`goodput`.
        noise_dof: degrees of freedom of the step times' Student-t noise, which
            weighs each step in the fit and widens the intervals
            (:mod:`goodput.posterior`): > 2, ``math.inf`` for Gaussian noise;
            ``None``: the cluster prior's (:attr:`goodput.gp.HyperPrior.noise_dof`,
            learned from its jobs' residuals), else
            :data:`goodput.tails.DEFAULT_NOISE_DOF`.
        level_shifts: let a refit find a change of the job's speed in time among
            its timestamped steps (:mod:`goodput.shifts`: every step slower or
            faster from some moment on) and read the steps before it at the
            current speed; :attr:`level_shifts_found` lists those it found.
    """

    def __init__(
        self,
        job: str,
        init_batch_size: int,
        max_batch_size: int | None = None,
        local_bsz_bounds: tuple[int, int] | Mapping[str, tuple[int, int]] | None = None,
        *,
        accumulation: bool = True,
        bayesian: bool = True,
        cluster_prior: ClusterPrior | None = None,
        model_size: float | None = None,
        refit_every: int | None = None,
        surprise: float = 3.0,
        max_gp_points: int = 1024,
        gp_hyperparameters: GPHyperparameters | None = None,
        num_stages: int | Mapping[str, int] = 1,
        min_replicas: int = 1,
        noise_dof: float | None = None,
        level_shifts: bool = True,
    ) -> None:
        self.job = check_str("job", job)
        self._stages = Stages.parse(num_stages)
        self.min_replicas = check_min_replicas(min_replicas)
        self.init_batch_size = check_int("init_batch_size", init_batch_size, minimum=1, maximum=MAX_BATCH)
        if max_batch_size is not None:
            max_batch_size = check_int("max_batch_size", max_batch_size, minimum=1, maximum=MAX_BATCH)
            if max_batch_size < self.init_batch_size:
                raise ValidationError("max_batch_size", max_batch_size, f"must be >= init_batch_size ({self.init_batch_size})")
        self.max_batch_size = max_batch_size
        self._bounds_default: tuple[int, int] | None = None
        self._bounds_by_type: dict[str, tuple[int, int]] = {}
        if isinstance(local_bsz_bounds, Mapping):
            for gpu, bounds in local_bsz_bounds.items():
                name = normalize_gpu_type(gpu, "local_bsz_bounds")
                if name in self._bounds_by_type:
                    raise ValidationError("local_bsz_bounds", gpu, f"names GPU type {name!r} twice")
                self._bounds_by_type[name] = check_bounds(f"local_bsz_bounds[{gpu!r}]", bounds)
        else:
            self._bounds_default = check_bounds("local_bsz_bounds", local_bsz_bounds)
        for flag, value in (("accumulation", accumulation), ("bayesian", bayesian), ("level_shifts", level_shifts)):
            if not isinstance(value, bool):
                raise ValidationError(flag, value, "expected True or False")
        self.accumulation = accumulation
        self.bayesian = bayesian
        self.level_shifts = level_shifts
        self.level_shifts_found: tuple[LevelShift, ...] = ()  # the last refit's, oldest change first (its docstring)
        self._cluster_prior = _checked_cluster_prior(cluster_prior)
        self._model_size = _checked_model_size(model_size)
        self.refit_every = None if refit_every is None else check_int("refit_every", refit_every, minimum=1)
        self.surprise = check_float("surprise", surprise, positive=True)
        self.max_gp_points = check_int("max_gp_points", max_gp_points, minimum=2)
        if gp_hyperparameters is not None and not isinstance(gp_hyperparameters, GPHyperparameters):
            raise ValidationError("gp_hyperparameters", gp_hyperparameters, "expected GPHyperparameters")
        if gp_hyperparameters is not None and len(gp_hyperparameters.lengthscale) != len(FEATURE_NAMES):
            raise ValidationError("gp_hyperparameters.lengthscale", gp_hyperparameters.lengthscale,
                                  f"expected one per GP feature ({len(FEATURE_NAMES)}: {', '.join(FEATURE_NAMES)})")
        self._gp_init = gp_hyperparameters
        if noise_dof is not None:  # checked as the hyperprior checks it
            noise_dof = replace(DEFAULT_HYPER_PRIOR, noise_dof=noise_dof).noise_dof
        self._noise_dof = noise_dof
        self._observations: dict[str, list[Observation]] = {}
        self._params: dict[str, ThroughputParams] = {}  # each type's plain Pollux fit (bayesian=False, own_fit)
        self._dirty: set[str] = set()
        self._proxies: tuple[tuple[tuple[str, int], ...], dict[str, float]] | None = None  # (1-GPU counts per type, log size proxies)
        self.grad_sqr: float | None = None
        self.grad_var: float | None = None
        # the Bayesian layer
        self._state: JobPosterior | None = None
        self._refit_due = True
        self._hyper_due = gp_hyperparameters is None  # the next refit also refits the GP hyperparameters
        self._pending = 0  # observations since the last refit
        self.refits = 0
        self.last_z: float | None = None  # largest |z| of the last online update

    # ------------------------------------------------------------------ what the fits depend on
    @property
    def cluster_prior(self) -> ClusterPrior | None:
        """The cross-job prior; setting it (a scheduler's refreshed one) refits at the next question."""
        return self._cluster_prior

    @cluster_prior.setter
    def cluster_prior(self, value: ClusterPrior | None) -> None:
        self._cluster_prior = _checked_cluster_prior(value)
        self._invalidate()

    @property
    def model_size(self) -> float | None:
        """The job's trainable parameter count (places it on the cluster prior's size slopes); setting it refits."""
        return self._model_size

    @model_size.setter
    def model_size(self, value: float | None) -> None:
        self._model_size = _checked_model_size(value)
        self._invalidate()

    def _invalidate(self) -> None:
        """Forget the fits (their sync shape) and the posterior: the next question refits from scratch."""
        self._params.clear()
        self._dirty.update(self._observations)
        self._state = None
        self._refit_due = self._hyper_due = True

    @property
    def num_stages(self) -> int | dict[str, int]:
        """GPUs per data-parallel replica as given: an ``int`` or ``{gpu_type: int}`` (:mod:`goodput.hybrid`)."""
        return self._stages.value

    def stages(self, gpu_type: str) -> int:
        """GPUs per replica (pipeline stages) on ``gpu_type``."""
        return self._stages.of(normalize_gpu_type(gpu_type))

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_profile(cls, profile: Profile, **overrides: Any) -> JobModel:
        """A model bootstrapped from a :class:`Profile` (its job, M0 and per-type memory limits).

        A profile of several jobs needs ``job=``; the other jobs' observations are left out.
        """
        if not isinstance(profile, Profile):
            raise ValidationError("profile", profile, "expected a Profile")
        if "job" not in overrides and profile.job is None and len(profile.jobs) > 1:
            raise ValidationError("job", None, f"the profile holds jobs {sorted(profile.jobs)}; pass job= to choose one")
        job = overrides.pop("job", profile.job or (profile.jobs[0] if profile.jobs else None))
        if profile.observations and job not in profile.jobs:
            raise ValidationError("job", job, f"the profile holds no observation of it (jobs: {sorted(profile.jobs)})")
        if job is not None and profile.observations:
            profile = profile.select(job=job)  # that job's own settings (Profile.job_meta) and observations
        init = overrides.pop("init_batch_size", profile.init_batch_size)
        if init is None:
            raise ValidationError("init_batch_size", None, "the profile does not record one; pass init_batch_size=")
        overrides.setdefault("max_batch_size", profile.max_batch_size)
        if "local_bsz_bounds" not in overrides and profile.max_local_bsz:
            overrides["local_bsz_bounds"] = {gpu: (1, high) for gpu, high in profile.max_local_bsz.items()}
        if "num_stages" not in overrides:
            overrides["num_stages"] = stages_of(profile.observations)
        size = (profile.metadata or {}).get("num_parameters")
        if "model_size" not in overrides and isinstance(size, (int, float)) and size > 0:
            overrides["model_size"] = float(size)
        model = cls(job, init, **overrides)
        return model.observe(o for o in profile.observations if o.job == model.job)

    # ------------------------------------------------------------------ data
    @property
    def observations(self) -> list[Observation]:
        return [o for obs in self._observations.values() for o in obs]

    @property
    def gpu_types(self) -> list[str]:
        """GPU types with at least one observation."""
        return list(self._observations)

    @single_threaded
    def observe(self, observations: Observation | Iterable[Observation]) -> JobModel:
        """Add one observation or many; returns the model (online update).

        Bayesian model: the GP posterior is conditioned on them at once (no
        refit); a refit is scheduled when due (see the module docstring) and
        runs lazily at the next question. Plain model: the touched types are
        refitted lazily. Observations carrying ``grad_sqr``/``grad_var`` update
        the job's gradient statistics (the latest one wins: the reporter smooths them).
        """
        if isinstance(observations, (str, bytes)) or not isinstance(observations, (Observation, Iterable)):
            raise ValidationError("observations", observations, "expected an Observation or an iterable of them")
        batch = [observations] if isinstance(observations, Observation) else list(observations)
        for index, obs in enumerate(batch):
            if not isinstance(obs, Observation):
                raise ValidationError(f"observations[{index}]", obs, "expected an Observation")
            if obs.job != self.job:
                raise ValidationError(f"observations[{index}].job", obs.job, f"this model is for job {self.job!r}")
            check_observation_stages(self._stages, obs, index)
        for obs in batch:
            self._observations.setdefault(obs.gpu_type, []).append(obs)
            self._dirty.add(obs.gpu_type)
            if obs.grad_sqr is not None:
                self.grad_sqr, self.grad_var = obs.grad_sqr, obs.grad_var
        if batch and self.bayesian:
            self._on_observe(batch)
        return self

    def _on_observe(self, batch: list[Observation]) -> None:
        """Condition the GP posterior on the new observations (no refit); schedule a refit when due."""
        self._pending += len(batch)
        state = self._state
        if self._refit_due or state is None or state.posterior is None or any(o.gpu_type not in state.index for o in batch):
            if state is not None and (state.posterior is None or any(o.gpu_type not in state.index for o in batch)):
                self._hyper_due = True  # a new GPU type (a new task) or a failed posterior
            self._refit_due = True
            return
        try:
            self.last_z = state.condition(batch)
        except (GPNumericalError, np.linalg.LinAlgError, ValueError, FloatingPointError):
            self._refit_due = self._hyper_due = True
            return
        # A quarter of the observations held at the last refit: the linearisation point moves about as far as
        # the data's information grows. The floor was 5: a job's first refit, on one observation, then carried
        # four more through its linearisation, and a host-bound job's far from it (P4@5 on Pollux's traces:
        # 235 predictions off by more than 100%, 25 now; `git show ada7e64:experiments/results/accuracy.md`). The count of
        # refits stays logarithmic in the observations.
        threshold = self.refit_every or max(1, math.ceil(state.n_fit / 4))
        # ... or when three or more steps since the refit are surprising together, their mean z beyond surprise / √n
        # (a z-test of the lot: a change of speed whose steps each weigh as outliers of the old one, none beyond
        # the threshold alone, had waited for the scheduled refit, Gavel's jobs past the 10 steps after the change;
        # fewer than MIN_REGIME_POINTS cannot show a change, goodput.shifts)
        together = state.z_count >= MIN_REGIME_POINTS and abs(state.z_sum) > self.surprise * math.sqrt(state.z_count)
        if self.last_z > self.surprise or together:
            # the linearisation point is off, and the GP's hyperparameters were fitted to residuals that did
            # not include this one: both refitted, so the model is the one a fresh fit to the same observations
            # gives. (The MAP alone under the old hyperparameters let the GP carry a 2.6-log-unit miss to
            # other configurations: a step predicted 80 times faster than any measured, whether or not a
            # question had come between two observe() calls deciding which.)
            self._refit_due = self._hyper_due = True
        if self._pending >= threshold or len(state.posterior) >= 2 * (self.max_gp_points + max(5, self.max_gp_points // 4)):
            self._refit_due = self._hyper_due = True

    # ------------------------------------------------------------------ refits
    def _own_fit(self, name: str) -> ThroughputParams:
        """The type's plain Pollux fit to its own data, cached until its data change."""
        if name in self._dirty or name not in self._params:
            self._params[name] = fit_throughput(self._observations[name], initial=self._params.get(name),
                                                sync_shape=self.sync_shape(name))
            self._dirty.discard(name)
        return self._params[name]

    def sync_shape(self, gpu_type: str) -> SyncShape | None:
        """The cluster prior's inter-node sync shape on ``gpu_type`` (:mod:`goodput.sync_shape`); ``None`` without one."""
        return self.cluster_prior.sync_shape(normalize_gpu_type(gpu_type)) if self.cluster_prior is not None else None

    def own_fit(self, gpu_type: str) -> ThroughputParams:
        """The type's plain Pollux fit to its own observations alone (no prior), refitted if they changed."""
        return self._own_fit(self._known(gpu_type))

    def prior(self) -> tuple[np.ndarray, np.ndarray]:
        """Mean (T, 8) and covariance (8T, 8T) of the job's coordinates (:mod:`goodput.parametric`) on :attr:`gpu_types`:
        the cluster prior's, or the weak defaults around each type's observed compute."""
        if self.cluster_prior is not None and len(self.cluster_prior):
            return self.cluster_prior.prior(self.gpu_types, self.model_size,
                                            proxies=self._size_proxies())  # placed by proxy where the cluster cannot place a size
        return default_prior(default_means_by_type({t: self._observations[t] for t in self.gpu_types}))

    def _size_proxies(self) -> dict[str, float]:
        """The job's log size proxy on each type (:func:`goodput.hierarchy.log_size_proxies`), re-read when its 1-GPU
        observations (all it is read off) grow."""
        key = tuple((t, sum(1 for o in self._observations[t] if o.num_replicas == 1)) for t in self.gpu_types)
        if self._proxies is None or self._proxies[0] != key:
            self._proxies = (key, log_size_proxies({t: self._observations[t] for t in self.gpu_types}))
        return self._proxies[1]

    @single_threaded
    def refit(self, *, hyperparameters: bool = True) -> JobModel:
        """Refit now: the MAP parameters on every type and the GP posterior on all observations (its
        hyperparameters too unless ``hyperparameters=False``). Lazy refits pass ``hyperparameters`` only when due."""
        if not isinstance(hyperparameters, bool):  # "no" or 0 read as a wish, not a flag
            raise ValidationError("hyperparameters", hyperparameters, "expected True or False")
        if not self._observations:
            return self
        if not self.bayesian:
            for gpu in self._observations:
                self._own_fit(gpu)
            return self
        mean, cov = self.prior()
        shapes = {t: self.sync_shape(t) for t in self.gpu_types}
        previous = self._state
        fit_hyper = hyperparameters or (previous is None and self._gp_init is None)

        def build(observations: Mapping[str, list[Observation]], fit_hyper: bool) -> JobPosterior:
            return build_posterior(observations, mean, cov, shapes, previous, hyper=self._gp_init if previous is None else None,
                                   hyper_prior=self._hyper_prior(),
                                   prior_dof=EFFECT_DOF if self.cluster_prior is not None and len(self.cluster_prior) else None,
                                   prior_blocks=SCALE_BLOCKS, fit_hyper=fit_hyper, max_points=self.max_gp_points)

        observations: Mapping[str, list[Observation]] = self._observations
        state = build(observations, fit_hyper)
        found: dict[float, LevelShift] = {}  # by when the change came
        at = None  # the change just read: its rest, untested, at the next refit
        for _ in range(MAX_SHIFT_REFITS if self.level_shifts else 0):
            # A change's new steps weigh as outliers of the old speed in the fit that finds it, so its factor is
            # read in part (85-90% on Pollux's traces): refitted at the current speed, the rest is read again at
            # the same moment, until it settles; then another change is looked for.
            shift = state.level_shift(at)
            if at is not None and (shift is None or abs(math.log(shift.factor)) < SETTLED_LOG_FACTOR):
                shift = state.level_shift()
            if shift is None:
                break
            earlier = found.get(shift.at)  # its record: the first reading's, the factor the product of its readings
            found[shift.at] = replace(shift, moments=(), probabilities=(), log_factors=()) if earlier is None else \
                replace(earlier, factor=earlier.factor * shift.factor)
            at = shift.at
            observations = at_current_speed(observations, shift)  # the steps before it, read at the current speed
            state = build(observations, True)
        self._state, self.level_shifts_found = state, tuple(found[when] for when in sorted(found))
        self._refit_due = self._hyper_due = False
        self._pending = 0
        self.refits += 1
        return self

    @property
    def noise_dof(self) -> float | None:
        """The step noise's degrees of freedom as given (``None``: the cluster prior's, else the default's)."""
        return self._noise_dof

    def _hyper_prior(self) -> HyperPrior:
        """The GP's hyperprior: the cluster prior's (else the weak default), with :attr:`noise_dof` where given."""
        hyper_prior = (self.cluster_prior.gp_prior if self.cluster_prior is not None else None) or DEFAULT_HYPER_PRIOR
        return hyper_prior if self.noise_dof is None else replace(hyper_prior, noise_dof=self.noise_dof)

    def _current(self) -> JobPosterior:
        if self._refit_due or self._state is None:
            self.refit(hyperparameters=self._hyper_due)
        assert self._state is not None
        return self._state

    @property
    def unrefitted(self) -> int:
        """Observations conditioned online since the last refit (0 for the plain model, whose fits are always
        current): a :meth:`refit` now gives the model a fresh fit of every observation would."""
        return self._pending if self.bayesian and self._state is not None else 0

    @property
    def gp_hyperparameters(self) -> GPHyperparameters | None:
        """The GP hyperparameters of the last refit (``None`` before the first or for the plain model)."""
        return self._state.hyper if self._state is not None else None

    @property
    def diagnostics(self) -> dict[str, Any]:
        """State of the Bayesian layer: refits, hyperparameters, task correlation, the MAP parameters, fallback reason;
        the step noise's degrees of freedom (``noise_dof``, ``None`` for Gaussian noise) and how many of the GP's
        steps it weighs at under half (``downweighted``: their noise at least doubled, the stalls it reads as outliers);
        the changes of the job's speed the last refit read (``level_shifts``: :meth:`goodput.shifts.LevelShift.to_dict`
        each, oldest first)."""
        if not self.bayesian:
            return {"bayesian": False, "observations": len(self.observations)}
        state = self._current() if self._observations else None
        if state is None:
            return {"bayesian": True, "observations": 0}
        return {
            "bayesian": True,
            "observations": len(self.observations),
            "gp_points": 0 if state.posterior is None else int(np.sum(state.posterior.t < state.posterior.hyper.num_tasks)),
            "refits": self.refits,
            "pending": self._pending,
            "types": list(state.types),
            "hyperparameters": state.hyper.to_dict(),
            "gp_prior_mode": state.gp_mode,
            "task_correlation": state.hyper.task_correlation().round(3).tolist(),
            "noise_std": round(state.noise_std, 4),
            "noise_dof": None if math.isinf(state.noise_dof) else state.noise_dof,
            "downweighted": 0 if state.posterior is None else int(np.sum(
                (state.posterior.t < state.posterior.hyper.num_tasks) & (state.posterior.extra_noise > state.posterior.hyper.noise))),
            "level_shifts": [shift.to_dict() for shift in self.level_shifts_found],
            "params": {t: ThroughputParams(*state.theta(t).tolist()).to_dict() for t in state.types},
            "compute_power": {t: round(state.compute_power(t), 3) for t in state.types},
            "prior": "cluster" if self.cluster_prior is not None and len(self.cluster_prior) else "defaults",
            "sync_shape": {t: {f"{n}x{r}": round(f, 3) for (n, r), f in sorted(s.factors.items())}
                           for t, s in state.shapes.items() if s},
            "fallback": state.posterior is None,
            "reason": state.reason,
            "jitter": None if state.posterior is None else state.posterior.jitter,
            "last_z": self.last_z,
        }

    # ------------------------------------------------------------------ throughput
    def _known(self, gpu_type: str) -> str:
        name = normalize_gpu_type(gpu_type)
        if name not in self._observations:
            raise UnknownGPUTypeError(gpu_type, self.gpu_types)
        return name

    @single_threaded
    def params(self, gpu_type: str) -> ThroughputParams:
        """The Pollux parameters of one GPU type in use as the mean.

        Plain model: the type's fit, refitted if new data arrived. Bayesian
        model: the maximum a posteriori parameters of the last refit (refits
        happen now and then, see the module docstring); the GP's correction
        comes on top of them, and its compute combines α_c and β_c·b by a soft
        maximum whose power ``diagnostics["compute_power"]`` gives (1: Pollux's sum;
        :mod:`goodput.parametric`).
        """
        name = self._known(gpu_type)
        if not self.bayesian:
            return self._own_fit(name)
        return ThroughputParams(*self._current().theta(name).tolist())

    def _mean_and_log_std(
        self, gpu_type: str, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray, accum: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Predicted step time (s, the median) and std of log step time; never raises on numerical trouble."""
        if not self.bayesian:
            theta = self.params(gpu_type).as_array()
            mean = _step_time(theta, nodes, replicas, bsz, accum, self.sync_shape(gpu_type))
            return mean, np.zeros_like(mean)
        state = self._current()
        shape = np.broadcast(nodes, replicas, bsz, accum).shape
        log_mean, log_std = state.predict(gpu_type, *_flat(nodes, replicas, bsz, accum))
        return np.exp(log_mean).reshape(shape), log_std.reshape(shape)

    def _step_time_mean(self, gpu_type: str, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray, accum: np.ndarray) -> np.ndarray:
        """Predicted step time without its spread (the goodput optimiser's hot path)."""
        if not self.bayesian:
            return _step_time(self.params(gpu_type).as_array(), nodes, replicas, bsz, accum, self.sync_shape(gpu_type))
        shape = np.broadcast(nodes, replicas, bsz, accum).shape
        return np.exp(self._current().log_mean(gpu_type, *_flat(nodes, replicas, bsz, accum))).reshape(shape)

    @single_threaded
    def predict(
        self, gpu_type: str, num_nodes: Any, num_replicas: Any, local_bsz: Any, accum_steps: Any = 0
    ) -> Prediction:
        """Step time of a configuration: mean and standard deviation (seconds), throughput (samples/s).

        Accepts scalars or numpy arrays of numbers (broadcast together); fractional
        values evaluate the continuous model (an optimiser's candidates).
        """
        name = self._known(gpu_type)
        nodes, replicas, bsz, accum = config_arrays(num_nodes, num_replicas, local_bsz, accum_steps, self._stages.of(name))
        mean, log_std = self._mean_and_log_std(name, nodes, replicas, bsz, accum)
        std = lognormal_std(mean, log_std)
        throughput = replicas * bsz * (accum + 1.0) / mean
        noise, dof = self._current().noise_tails() if self.bayesian else (0.0, math.inf)
        if mean.ndim == 0:
            return Prediction(float(mean), float(std), float(throughput), float(log_std), noise, dof)
        return Prediction(mean, std, throughput, log_std, noise, dof)

    # ------------------------------------------------------------------ efficiency and goodput
    @property
    def has_gradient_stats(self) -> bool:
        return self.grad_sqr is not None

    def efficiency(self, batch_size: Any) -> Any:
        """Statistical efficiency E(batch_size); 1 at M0, and 1 everywhere until gradient statistics arrive."""
        if self.grad_sqr is None:
            m = check_batch_sizes(batch_size, self.init_batch_size)  # the same checks as with statistics
            return np.ones_like(m) if m.ndim else 1.0
        return _efficiency(self.grad_sqr, self.grad_var, self.init_batch_size, batch_size)

    def limits(self, gpu_type: str) -> BatchLimits:
        """The batch limits on one GPU type.

        Without gradient statistics the batch stays at M0 (statistical
        efficiency of larger batches is unknown, so they are not offered).
        """
        bounds = self._bounds_by_type.get(normalize_gpu_type(gpu_type), self._bounds_default)
        low, high = bounds if bounds is not None else (1, None)
        max_bs = self.max_batch_size if self.grad_sqr is not None else None
        return BatchLimits(
            init_batch_size=self.init_batch_size,
            max_batch_size=max_bs,
            min_local_bsz=low,
            max_local_bsz=high,
            accumulation=self.accumulation,
        )

    def _choices(self, gpu_type: str, num_nodes: np.ndarray, num_replicas: np.ndarray) -> tuple[GoodputChoices, np.ndarray]:
        """Best configurations and the std of their goodput for allocations on one type."""

        def step_time(n: np.ndarray, r: np.ndarray, b: np.ndarray, a: np.ndarray) -> np.ndarray:
            return self._step_time_mean(gpu_type, n, r, b, a)

        choices = optimize_goodput(step_time, self.efficiency, num_nodes, num_replicas, self.limits(gpu_type),
                                   num_stages=self._stages.of(gpu_type))
        ok = choices.feasible
        _, log_std = self._mean_and_log_std(
            gpu_type,
            np.asarray(num_nodes, dtype=float),
            np.asarray(num_replicas, dtype=float),
            np.where(ok, choices.local_bsz, 1).astype(float),
            choices.accum_steps.astype(float),
        )
        # goodput ∝ 1/step_time: log-normal with the same log-std
        std = np.where(ok, lognormal_std(choices.goodput, log_std), 0.0)
        return choices, std

    @single_threaded
    def goodput(self, gpu_type: str, num_nodes: int, num_replicas: int | None = None, *,
                num_gpus: int | None = None) -> GoodputChoice:
        """The goodput-maximising batch size, local batch and accumulation of an allocation.

        The allocation is given by its replicas or (``num_gpus=``) by its GPUs; they
        differ for a hybrid-parallel job only (``num_replicas = num_gpus / num_stages``).
        GPUs that are not whole pipelines, or fewer replicas than ``min_replicas``,
        give an infeasible choice (goodput 0).
        """
        name = self._known(gpu_type)
        nodes = check_int("num_nodes", num_nodes, minimum=1)
        replicas = replicas_of(self._stages, name, nodes, num_replicas, num_gpus)
        if replicas < self.min_replicas:
            return GoodputChoice(name, nodes, replicas, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0)
        choices, std = self._choices(name, np.array([nodes], float), np.array([replicas], float))
        return GoodputChoice(
            gpu_type=name,
            num_nodes=nodes,
            num_replicas=replicas,
            goodput=float(choices.goodput[0]),
            std=float(std[0]),
            throughput=float(choices.throughput[0]),
            efficiency=float(choices.efficiency[0]),
            step_time=float(choices.step_time[0]),
            batch_size=int(choices.batch_size[0]),
            local_bsz=int(choices.local_bsz[0]),
            accum_steps=int(choices.accum_steps[0]),
        )

    @single_threaded
    def table(self, cluster: Cluster) -> GoodputTable:
        """Goodput over the cluster's configuration set (Sia's), one vectorised solve per GPU type.

        GPU types without observations are listed in ``missing_gpu_types``. A
        hybrid-parallel job's rows are its whole-pipeline configurations only
        (:meth:`goodput.cluster.NodePool.configurations` with its stage count and
        ``min_replicas``), with a ``num_replicas`` column (pipelines per row).
        """
        if not isinstance(cluster, Cluster):
            raise ValidationError("cluster", cluster, "expected a Cluster")
        parts: list[dict[str, Any]] = []
        missing = []
        for pool in cluster:
            if pool.gpu_type not in self._observations:
                missing.append(pool.gpu_type)
                continue
            stages = self._stages.of(pool.gpu_type)
            configs = pool.configurations(stages, self.min_replicas)
            if not configs:  # not one pipeline (min_replicas of them) fits this pool
                continue
            nodes = np.array([c[1] for c in configs], dtype=float)
            gpus = np.array([c[2] for c in configs], dtype=float)
            choices, std = self._choices(pool.gpu_type, nodes, gpus / stages)
            parts.append({
                "gpu_type": [pool.gpu_type] * len(configs),
                "num_nodes": nodes.astype(int),
                "num_gpus": gpus.astype(int),
                **({"num_replicas": (gpus / stages).astype(int)} if self._stages.hybrid else {}),
                "goodput": choices.goodput,
                "batch_size": choices.batch_size,
                "local_bsz": choices.local_bsz,
                "accum_steps": choices.accum_steps,
                "throughput": choices.throughput,
                "efficiency": choices.efficiency,
                "step_time": choices.step_time,
                "std": np.broadcast_to(np.asarray(std, dtype=float), nodes.shape),
            })
        if not parts:
            empty = pd.DataFrame(columns=["gpu_type", "num_nodes", "num_gpus", *(["num_replicas"] if self._stages.hybrid else []),
                                          "goodput"])
            return GoodputTable(self.job, empty, missing_gpu_types=missing)
        # numpy columns, validated without pandas (GoodputTable.from_columns); the frame is built when read
        columns = {name: (sum((p[name] for p in parts), []) if name == "gpu_type" else
                          np.concatenate([np.asarray(p[name]) for p in parts])) for name in parts[0]}
        return GoodputTable.from_columns(self.job, columns, missing_gpu_types=missing)

    def empty_table_reason(self, cluster: Cluster) -> str:
        """Why :meth:`table` over ``cluster`` has no rows, in one sentence for a user: its observed GPU types'
        pools hold not one whole pipeline (``min_replicas`` of them, a hybrid job's ``num_stages`` GPUs each),
        or none of its GPU types has observations. Empty string when the table has rows."""
        if not isinstance(cluster, Cluster):
            raise ValidationError("cluster", cluster, "expected a Cluster")
        covered = [pool for pool in cluster if pool.gpu_type in self._observations]
        if any(pool.configurations(self._stages.of(pool.gpu_type), self.min_replicas) for pool in covered):
            return ""
        if covered:
            return ("no configuration of it holds " + "; ".join(
                f"{self.min_replicas} pipeline(s) of {self._stages.of(p.gpu_type)} {p.gpu_type} GPUs" for p in covered)
                + " (the job's num_stages, min_replicas)")
        observed = ", ".join(self._observations) or "none"
        return (f"no observations for its GPU type(s) {', '.join(pool.gpu_type for pool in cluster)}; "
                f"the job's observed types: {observed}")

    def __repr__(self) -> str:
        counts = ", ".join(f"{g}: {len(o)}" for g, o in self._observations.items())
        return f"JobModel(job={self.job!r}, init_batch_size={self.init_batch_size}, observations={{{counts}}})"


def _checked_cluster_prior(value: Any) -> ClusterPrior | None:
    if value is not None and not isinstance(value, ClusterPrior):
        raise ValidationError("cluster_prior", value, "expected a ClusterPrior")
    return value


def _checked_model_size(value: Any) -> float | None:
    return None if value is None else check_float("model_size", value, positive=True)


def _flat(*arrays: Any) -> tuple[np.ndarray, ...]:
    """Broadcast configuration arrays together and flatten them (float)."""
    return tuple(np.asarray(a, dtype=float).ravel() for a in np.broadcast_arrays(*arrays))
