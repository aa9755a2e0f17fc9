"""A job's performance model: throughput per GPU type, efficiency, goodput.

:class:`JobModel` holds every observation of one job. It fits Pollux's
throughput model (:mod:`goodput.throughput`) per GPU type, tracks the job's
gradient statistics for statistical efficiency (:mod:`goodput.efficiency`), and
answers a scheduler's questions: the step time of a configuration, the best
batch configuration and goodput of an allocation, and a goodput table over a
cluster's configurations.

Fits are lazy: :meth:`JobModel.observe` only marks the GPU types its
observations touch, and the next question refits those types alone.

This first version's ``std`` is 0: the Pollux fit is a point estimate. The
Bayesian layer (a Gaussian process on the residual, shared across GPU types)
adds calibrated uncertainty.

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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from .cluster import Cluster
from .efficiency import efficiency as _efficiency
from .errors import UnknownGPUTypeError, ValidationError
from .observations import Observation, Profile
from .optimize import BatchLimits, GoodputChoices, optimize_goodput
from .table import GoodputTable
from .throughput import ThroughputParams, _step_time, config_arrays, fit_throughput
from .validation import check_bounds, check_int, check_str, normalize_gpu_type

__all__ = ["JobModel", "Prediction", "GoodputChoice"]


@dataclass(frozen=True)
class Prediction:
    """Predicted step time of a configuration (scalars, or arrays for array inputs).

    Attributes:
        step_time: mean seconds of one optimizer step.
        std: standard deviation of the step time, seconds.
        throughput: samples/s at the mean step time.
    """

    step_time: Any
    std: Any
    throughput: Any


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
            M0, no batch scaling).
        local_bsz_bounds: ``(min, max)`` per-replica micro-batch, or a mapping
            ``{gpu_type: (min, max)}`` (memory differs by GPU type); ``None``:
            no limit beyond ``max_batch_size``.
        accumulation: allow gradient accumulation to reach large batches.
        prior: per GPU type, values for throughput parameters the job's own
            observations cannot identify (see :func:`fit_throughput`).
    """

    def __init__(
        self,
        job: str,
        init_batch_size: int,
        max_batch_size: int | None = None,
        local_bsz_bounds: tuple[int, int] | Mapping[str, tuple[int, int]] | None = None,
        *,
        accumulation: bool = True,
        prior: Mapping[str, ThroughputParams | Mapping[str, float]] | None = None,
    ) -> None:
        self.job = check_str("job", job)
        self.init_batch_size = check_int("init_batch_size", init_batch_size, minimum=1)
        if max_batch_size is not None:
            max_batch_size = check_int("max_batch_size", max_batch_size, minimum=1)
            if max_batch_size < self.init_batch_size:
                raise ValidationError("max_batch_size", max_batch_size, f"must be >= init_batch_size ({self.init_batch_size})")
        self.max_batch_size = max_batch_size
        self._bounds_default: tuple[int, int] | None = None
        self._bounds_by_type: dict[str, tuple[int, int]] = {}
        if isinstance(local_bsz_bounds, Mapping):
            for gpu, bounds in local_bsz_bounds.items():
                name = normalize_gpu_type(gpu, "local_bsz_bounds")
                self._bounds_by_type[name] = check_bounds(f"local_bsz_bounds[{gpu!r}]", bounds)
        else:
            self._bounds_default = check_bounds("local_bsz_bounds", local_bsz_bounds)
        if not isinstance(accumulation, bool):
            raise ValidationError("accumulation", accumulation, "expected True or False")
        self.accumulation = accumulation
        self._prior: dict[str, ThroughputParams | Mapping[str, float]] = {}
        for gpu, values in (prior or {}).items():
            self._prior[normalize_gpu_type(gpu, "prior")] = values
        self._observations: dict[str, list[Observation]] = {}
        self._params: dict[str, ThroughputParams] = {}
        self._dirty: set[str] = set()
        self.grad_sqr: float | None = None
        self.grad_var: float | None = None

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_profile(cls, profile: Profile, **overrides: Any) -> JobModel:
        """A model bootstrapped from a :class:`Profile` (its job, M0 and per-type memory limits)."""
        if not isinstance(profile, Profile):
            raise ValidationError("profile", profile, "expected a Profile")
        job = overrides.pop("job", profile.job or (profile.jobs[0] if profile.jobs else None))
        init = overrides.pop("init_batch_size", profile.init_batch_size)
        if init is None:
            raise ValidationError("init_batch_size", None, "the profile does not record one; pass init_batch_size=")
        overrides.setdefault("max_batch_size", profile.max_batch_size)
        if "local_bsz_bounds" not in overrides and profile.max_local_bsz:
            overrides["local_bsz_bounds"] = {gpu: (1, high) for gpu, high in profile.max_local_bsz.items()}
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

    def observe(self, observations: Observation | Iterable[Observation]) -> JobModel:
        """Add one observation or many; returns the model (online update).

        Only the GPU types the new observations touch are refitted, lazily, at
        the next prediction. Observations carrying ``grad_sqr``/``grad_var``
        update the job's gradient statistics (the latest one wins: the
        reporter smooths them).
        """
        batch = [observations] if isinstance(observations, Observation) else list(observations)
        for index, obs in enumerate(batch):
            if not isinstance(obs, Observation):
                raise ValidationError(f"observations[{index}]", obs, "expected an Observation")
            if obs.job != self.job:
                raise ValidationError(f"observations[{index}].job", obs.job, f"this model is for job {self.job!r}")
        for obs in batch:
            self._observations.setdefault(obs.gpu_type, []).append(obs)
            self._dirty.add(obs.gpu_type)
            if obs.grad_sqr is not None:
                self.grad_sqr, self.grad_var = obs.grad_sqr, obs.grad_var
        if batch:
            self._on_observe(batch)
        return self

    def _on_observe(self, batch: list[Observation]) -> None:
        """Hook for subclasses and the Bayesian layer: called after observations are stored."""

    # ------------------------------------------------------------------ throughput
    def _known(self, gpu_type: str) -> str:
        name = normalize_gpu_type(gpu_type)
        if name not in self._observations:
            raise UnknownGPUTypeError(gpu_type, self.gpu_types)
        return name

    def params(self, gpu_type: str) -> ThroughputParams:
        """The fitted Pollux parameters of one GPU type (refitted if new data arrived)."""
        name = self._known(gpu_type)
        if name in self._dirty or name not in self._params:
            self._params[name] = fit_throughput(self._observations[name], prior=self._prior.get(name))
            self._dirty.discard(name)
        return self._params[name]

    def _mean_and_log_std(
        self, gpu_type: str, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray, accum: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Mean step time (s) and std of log step time; the Bayesian layer overrides this."""
        theta = self.params(gpu_type).as_array()
        mean = _step_time(theta, nodes, replicas, bsz, accum)
        return mean, np.zeros_like(mean)

    def predict(
        self, gpu_type: str, num_nodes: Any, num_replicas: Any, local_bsz: Any, accum_steps: Any = 0
    ) -> Prediction:
        """Step time of a configuration: mean and standard deviation (seconds), throughput (samples/s).

        Accepts scalars or numpy arrays (broadcast together).
        """
        name = self._known(gpu_type)
        nodes, replicas, bsz, accum = config_arrays(num_nodes, num_replicas, local_bsz, accum_steps)
        mean, log_std = self._mean_and_log_std(name, nodes, replicas, bsz, accum)
        std = mean * np.sqrt(np.expm1(log_std**2))  # std of a log-normal with this median-ish mean
        throughput = replicas * bsz * (accum + 1.0) / mean
        if mean.ndim == 0:
            return Prediction(float(mean), float(std), float(throughput))
        return Prediction(mean, std, throughput)

    # ------------------------------------------------------------------ efficiency and goodput
    @property
    def has_gradient_stats(self) -> bool:
        return self.grad_sqr is not None

    def efficiency(self, batch_size: Any) -> Any:
        """Statistical efficiency E(batch_size); 1 at M0, and 1 everywhere until gradient statistics arrive."""
        if self.grad_sqr is None:
            return np.ones_like(np.asarray(batch_size, dtype=float)) if np.ndim(batch_size) else 1.0
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
            return self._mean_and_log_std(gpu_type, n, r, b, a)[0]

        choices = optimize_goodput(step_time, self.efficiency, num_nodes, num_replicas, self.limits(gpu_type))
        ok = choices.feasible
        _, log_std = self._mean_and_log_std(
            gpu_type,
            np.asarray(num_nodes, dtype=float),
            np.asarray(num_replicas, dtype=float),
            np.where(ok, choices.local_bsz, 1).astype(float),
            choices.accum_steps.astype(float),
        )
        # goodput ∝ 1/step_time: the same relative spread (delta method on the log scale)
        std = np.where(ok, choices.goodput * np.sqrt(np.expm1(log_std**2)), 0.0)
        return choices, std

    def goodput(self, gpu_type: str, num_nodes: int, num_replicas: int) -> GoodputChoice:
        """The goodput-maximising batch size, local batch and accumulation of an allocation."""
        name = self._known(gpu_type)
        nodes = check_int("num_nodes", num_nodes, minimum=1)
        replicas = check_int("num_replicas", num_replicas, minimum=1)
        if replicas < nodes:
            raise ValidationError("num_replicas", replicas, f"must be >= num_nodes ({nodes})")
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

    def table(self, cluster: Cluster) -> GoodputTable:
        """Goodput over the cluster's configuration set (Sia's), one vectorised solve per GPU type.

        GPU types without observations are listed in ``missing_gpu_types``.
        """
        if not isinstance(cluster, Cluster):
            raise ValidationError("cluster", cluster, "expected a Cluster")
        frames = []
        missing = []
        for pool in cluster:
            if pool.gpu_type not in self._observations:
                missing.append(pool.gpu_type)
                continue
            configs = pool.configurations()
            nodes = np.array([c[1] for c in configs], dtype=float)
            gpus = np.array([c[2] for c in configs], dtype=float)
            choices, std = self._choices(pool.gpu_type, nodes, gpus)
            frames.append(
                pd.DataFrame(
                    {
                        "gpu_type": pool.gpu_type,
                        "num_nodes": nodes.astype(int),
                        "num_gpus": gpus.astype(int),
                        "goodput": choices.goodput,
                        "batch_size": choices.batch_size,
                        "local_bsz": choices.local_bsz,
                        "accum_steps": choices.accum_steps,
                        "throughput": choices.throughput,
                        "efficiency": choices.efficiency,
                        "step_time": choices.step_time,
                        "std": std,
                    }
                )
            )
        frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["gpu_type", "num_nodes", "num_gpus", "goodput"])
        return GoodputTable(self.job, frame, missing_gpu_types=missing)

    def __repr__(self) -> str:
        counts = ", ".join(f"{g}: {len(o)}" for g, o in self._observations.items())
        return f"JobModel(job={self.job!r}, init_batch_size={self.init_batch_size}, observations={{{counts}}})"

