"""Ground truth for simulation: how fast each job family really runs, and how much work it has.

Two sources share one interface, :class:`Family`:

* :func:`load_catalog` — the built-in catalog (``catalog.json``, derived by
  :mod:`experiments.simulator.build_catalog` from public measurements): Pollux's
  throughput model per GPU type and a gradient-noise trajectory per family.
* :func:`load_measured` — a directory of measured tables, one folder per model
  with ``placements-<gpu_type>.csv``, ``scalability-<gpu_type>.csv`` and
  ``validation-<batch>.csv`` (Pollux's formats; a plain ``placements.csv`` /
  ``scalability.csv`` is read as ``default_gpu_type``), and optionally an
  ``application.json`` (below). Step times are interpolated across batch sizes
  within a measured placement and, for placements never measured, across
  (nodes, GPUs, local batch) — as Pollux's simulator does — with a Pollux fit
  as the fallback outside the data (the nearest measurement for pipeline tables).

``application.json`` beside a model's tables (every key optional)::

    {"restart_cost_s": 80, "num_stages": {"rtx2080ti": 8, "a100": 2}}

``restart_cost_s``: seconds the job loses on every (re)allocation: checkpoint,
restart, restore. Without it the application's name picks one of Sia's
measured costs (:data:`RESTART_COST_S`), else 30 s. ``num_stages``: GPUs per
data-parallel replica, an ``int`` or ``{gpu_type: int}`` (types left out: 1):
the tables of a GPU type with more than one stage are *pipeline-parallel*
tables (Sia's format, e.g. its artifact's ``gpt_pmp``)::

    placement,local_bsz,step_time,sync_time            (placements-<gpu_type>.csv)
    local_bsz,step_time,sync_time,num_nodes,num_replicas   (scalability-<gpu_type>.csv)

Every GPU count counts GPUs: a placement's digits are GPUs per node (``88`` =
2 nodes of 8 GPUs) and scalability's ``num_replicas`` column is GPUs too; each
``num_stages`` of them form one pipeline replica, so every count must be a
multiple of ``num_stages`` (else a one-line error naming file, row and field).
``local_bsz`` is the micro-batch per pipeline; ``step_time`` the seconds of one
forward pass of one micro-batch through one stage; ``sync_time`` the seconds of
communication per optimizer step that compute does not hide (gradient
all-reduce between replicas, activations between stages). It may exceed
``step_time``, which is per micro-batch: that is no error in a pipeline table,
where each time must only be a finite number (``step_time`` > 0, ``sync_time`` ≥ 0).
An optimizer step of M = ``accum_steps + 1`` micro-batches on S stages takes

    T_iter = 3 · (S − 1 + M) · step_time + sync_time

(a GPipe schedule: a backward pass costs two forward passes, and the pipeline
fills and drains in S − 1 micro-batch slots — the step time Sia's goodput model
gives such jobs; Sia's simulator leaves ``sync_time`` out of it, which this
truth does not). In a data-parallel table (one stage), ``sync_time`` is part of
``step_time`` and must not exceed it.

Hybrid-parallel jobs are scaled in whole pipelines (Sia, SOSP'23): a family's
methods take GPU counts (``num_gpus``), of which ``num_gpus / num_stages`` are
replicas; GPU counts that are not whole pipelines run at rate 0. The batch
optimizer (:func:`goodput.optimize.optimize_goodput`) chooses a pipeline's
micro-batch and micro-batches as a data-parallel job's: the largest micro-batch
that fits, then as many as the batch needs. With fixed M a smaller micro-batch
could fill the pipeline better (its bubble is S − 1 slots of M); that choice is
not searched (Sia fixes one micro-batch size for its pipelined job).

Progress follows Pollux (OSDI'21 §5.1): a job's progress is counted in
scale-invariant iterations at its reference batch M0, so one second at batch M
with step time T advances it by ``E(M) · M / M0 / T``, with statistical
efficiency ``E(M) = (φ + M0)/(φ + M)`` and φ the gradient noise scale at the
job's current progress.
"""

from __future__ import annotations

import bisect
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from experiments.datasets import (gpu_slug, read_csv_rows, read_placements, read_scalability, read_validation,
                                  table_files)
from goodput.errors import DataFormatError, ValidationError
from goodput.hybrid import Stages, check_num_stages
from goodput.io import read_json
from goodput.observations import Observation
from goodput.optimize import BatchLimits, GoodputCandidates, GoodputChoices, best_goodput, goodput_candidates
from goodput.throughput import ThroughputParams, _step_time, fit_throughput
from goodput.validation import check_float

__all__ = ["Family", "ParametricFamily", "MeasuredFamily", "check_cluster_types", "load_catalog", "load_measured",
           "CATALOG_PATH", "RESTART_COST_S", "DEFAULT_RESTART_COST_S", "restart_cost_of", "APPLICATION_FILE"]

CATALOG_PATH = Path(__file__).with_name("catalog.json")

#: Seconds each application loses per (re)allocation — checkpoint, restart, restore — as measured on a
#: physical cluster and charged by Sia's simulator (Jayaram Subramanya et al., "Sia: Heterogeneity-aware,
#: goodput-optimized ML-cluster scheduling", SOSP'23; artifact github.com/siasosp23/artifacts,
#: ``sia-simulator/applications.py``, ``Application.rescale_time``). Other applications:
#: :data:`DEFAULT_RESTART_COST_S`, the artifact's default (and Pollux's flat delay).
RESTART_COST_S: dict[str, float] = {"bert": 120.0, "cifar10": 50.0, "deepspeech2": 25.0, "imagenet": 250.0,
                                    "ncf": 15.0, "yolov3": 80.0}
DEFAULT_RESTART_COST_S = 30.0

#: the optional per-model settings file of a measured-tables folder (see the module docstring)
APPLICATION_FILE = "application.json"


def restart_cost_of(application: str) -> float:
    """The bundled restart cost of an application by name (:data:`RESTART_COST_S`, else the default), seconds."""
    return RESTART_COST_S.get(application, DEFAULT_RESTART_COST_S)


@dataclass(eq=False)  # identity semantics: families are hashed by identity in caches
class Family(ABC):
    """A job family's true behaviour (base class; subclasses give step and sync times).

    Attributes:
        name: the application name used by workloads (``"cifar10"``).
        init_batch_size: reference batch M0, samples.
        max_batch_size: largest total batch, samples.
        min_local_bsz: smallest per-replica micro-batch.
        max_local_bsz: largest micro-batch per GPU type (memory).
        work: progress (scale-invariant iterations at M0) to finish.
        noise: the gradient noise scale φ (samples) along training, as
            ``{batch size of the run: ((fraction of work, φ), ...)}`` — one
            trajectory per batch size the job was trained at (Pollux's
            validation runs); a single ``((fraction, φ), ...)`` is the run at M0.
        restart_cost_s: seconds lost on every reallocation (default: the
            application's in :data:`RESTART_COST_S`, else 30).
        num_stages: GPUs per data-parallel replica, an ``int`` or
            ``{gpu_type: int}`` (:mod:`goodput.hybrid`): more than one for a
            hybrid-parallel (pipelined) job, whose replicas are pipelines.

    The speed methods take GPU counts (``num_gpus``); a hybrid job runs
    ``num_gpus / num_stages`` replicas (:meth:`replicas`), and a GPU count that
    is not whole pipelines is refused by :meth:`step_sync` and :meth:`iter_time`
    and runs at rate 0 (goodput 0 in :meth:`best_config`).
    """

    name: str
    init_batch_size: int
    max_batch_size: int
    min_local_bsz: int
    max_local_bsz: dict[str, int]
    work: float
    noise: Any
    restart_cost_s: float | None = None
    num_stages: Any = 1
    _noise_runs: list[tuple[float, np.ndarray, np.ndarray]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.restart_cost_s = (restart_cost_of(self.name) if self.restart_cost_s is None else
                               check_float(f"{self.name}.restart_cost_s", self.restart_cost_s, nonnegative=True))
        self._stages = Stages.parse(self.num_stages, f"{self.name}.num_stages")
        self.num_stages = self._stages.value
        runs = self.noise if isinstance(self.noise, Mapping) else {self.init_batch_size: self.noise}
        self._noise_runs = []
        for batch, knots in sorted(runs.items()):
            knots = sorted(knots)
            if not knots:
                raise ValidationError(f"{self.name}.noise[{batch}]", knots, "needs at least one (fraction, φ) knot")
            self._noise_runs.append((math.log(float(batch)), np.array([k[0] for k in knots], dtype=float),
                                     np.log(np.maximum([k[1] for k in knots], 1e-12))))
        if not self._noise_runs:
            raise ValidationError(f"{self.name}.noise", self.noise, "needs at least one trajectory")
        self._knots = np.array([b for b, _, _ in self._noise_runs])
        if self.work <= 0:
            raise ValidationError(f"{self.name}.work", self.work, "must be > 0")
        for gpu, largest in self.max_local_bsz.items():  # no micro-batch would fit: found only when the job ran
            if largest < self.min_local_bsz:
                raise ValidationError(f"{self.name}.max_local_bsz[{gpu}]", largest,
                                      f"must be >= min_local_bsz ({self.min_local_bsz})")

    @property
    def gpu_types(self) -> list[str]:
        return list(self.max_local_bsz)

    def supports(self, gpu_type: str) -> bool:
        return gpu_type in self.max_local_bsz

    # ------------------------------------------------------------------ pipelines (goodput.hybrid)
    @property
    def hybrid(self) -> bool:
        """Whether the job runs pipelines of several GPUs on some GPU type."""
        return self._stages.hybrid

    def stages(self, gpu_type: str) -> int:
        """GPUs per replica (pipeline stages) on ``gpu_type``."""
        return self._stages.of(gpu_type)

    def replicas(self, gpu_type: str, num_gpus: int) -> int:
        """Replicas (pipelines) on ``num_gpus`` GPUs of ``gpu_type``; 0 when they are not whole pipelines."""
        return self._stages.replicas(gpu_type, int(num_gpus))

    def configurations(self, pool: Any) -> list[tuple[str, int, int]]:
        """Sia's configurations of a node pool for this job: whole pipelines only (:meth:`NodePool.configurations`)."""
        return pool.configurations(self.stages(pool.gpu_type))

    def _replicas_of(self, gpu_type: str, num_gpus: Any) -> int:
        replicas = self.replicas(gpu_type, num_gpus)
        if replicas < 1:
            raise ValidationError(f"{self.name}.num_gpus", num_gpus,
                                  f"not whole pipelines of {self.stages(gpu_type)} GPUs on {gpu_type}")
        return replicas

    def limits(self, gpu_type: str, fixed_batch: int | None = None) -> BatchLimits:
        """Batch limits on a type; ``fixed_batch`` pins the total batch (strong scaling)."""
        m0 = fixed_batch or self.init_batch_size
        return BatchLimits(
            init_batch_size=m0,
            max_batch_size=fixed_batch or self.max_batch_size,
            min_local_bsz=self.min_local_bsz,
            max_local_bsz=self.max_local_bsz[gpu_type],
        )

    # ------------------------------------------------------------------ statistics
    def noise_scale(self, progress: float, batch_size: Any = None) -> Any:
        """φ (samples) at a progress (scale-invariant iterations) for a job training at ``batch_size``.

        Along each run's trajectory φ is interpolated in log space between
        knots; across runs, in log φ over log batch size between the runs that
        bracket ``batch_size`` (clamped at the smallest and largest), as
        Pollux's simulator interpolates gradient statistics between its
        batch-size runs. ``batch_size=None``: the run at the reference batch M0.
        """
        fraction = min(max(progress / self.work, 0.0), 1.0)
        if batch_size is None:  # the first run alone (what the branch below takes from it)
            _, x, y = self._noise_runs[0]
            return float(np.exp(np.interp(fraction, x, y)))
        at_runs = np.array([np.interp(fraction, x, y) for _, x, y in self._noise_runs])
        if batch_size is None or len(self._noise_runs) == 1:
            log_phi = at_runs[0] if batch_size is None else np.full(np.shape(batch_size), at_runs[0])
        else:
            batches = np.array([b for b, _, _ in self._noise_runs])
            log_phi = np.interp(np.log(np.asarray(batch_size, dtype=float)), batches, at_runs)
        phi = np.exp(log_phi)
        return float(phi) if np.ndim(phi) == 0 else phi

    def efficiencies(self, progress: Any, batch_sizes: list[np.ndarray]) -> list[np.ndarray]:
        """:meth:`efficiency` for several jobs and arrays of batch sizes: ``progress`` a number or K of them,
        the result per array of shape ``(K,) + batch.shape`` (or ``batch.shape`` for one number); the noise
        trajectories are interpolated once per progress. The same values as one call per job and array."""
        single = np.ndim(progress) == 0
        progresses = np.atleast_1d(np.asarray(progress, dtype=float))
        fractions = np.minimum(np.maximum(progresses / self.work, 0.0), 1.0)
        at_runs = np.stack([np.interp(fractions, x, y) for _, x, y in self._noise_runs], axis=1)  # (K, R)
        knots = np.array([b for b, _, _ in self._noise_runs])
        m0 = self.init_batch_size
        out = []
        for batch in batch_sizes:
            batch = np.asarray(batch, dtype=float)
            log_batch = np.log(batch)
            result = np.empty((progresses.size,) + batch.shape)
            for k in range(progresses.size):
                if len(self._noise_runs) == 1:
                    log_phi = np.full(batch.shape, at_runs[k, 0])
                else:
                    log_phi = np.interp(log_batch, knots, at_runs[k])
                phi = np.exp(log_phi)
                result[k] = (phi + m0) / (phi + batch)
            out.append(result[0] if single else result)
        return out

    def column_efficiencies(self, progress: Any, batch: np.ndarray) -> np.ndarray:
        """:meth:`efficiency` of K jobs, column k of ``batch`` (shape (C, K)) at ``progress[k]``: the same values
        as one call per job and column."""
        progresses = np.asarray(progress, dtype=float)
        batch = np.asarray(batch, dtype=float)
        fractions = np.minimum(np.maximum(progresses / self.work, 0.0), 1.0)
        at_runs = np.stack([np.interp(fractions, x, y) for _, x, y in self._noise_runs], axis=1)  # (K, R)
        knots = np.array([b for b, _, _ in self._noise_runs])
        m0 = self.init_batch_size
        log_phi = np.empty(batch.shape)
        if len(self._noise_runs) == 1:
            log_phi[:] = at_runs[:, 0]
        else:
            log_batch = np.log(batch)
            for k in range(batch.shape[1]):
                log_phi[:, k] = np.interp(log_batch[:, k], knots, at_runs[k])
        phi = np.exp(log_phi)
        return (phi + m0) / (phi + batch)

    def efficiency(self, progress: float, batch_size: Any) -> Any:
        """E(M) = (φ_M + M0)/(φ_M + M), with φ_M the noise scale of training at batch M (Pollux, OSDI'21)."""
        batch = np.asarray(batch_size, dtype=float)
        phi = self.noise_scale(progress, batch)
        m0 = self.init_batch_size
        return (phi + m0) / (phi + batch)

    # ------------------------------------------------------------------ speed
    @abstractmethod
    def _step_sync(self, gpu_type: str, num_nodes: int, num_replicas: int, local_bsz: float) -> tuple[float, float]:
        """(step seconds, sync seconds) of one synchronised step without accumulation, for ``num_replicas`` replicas."""

    def _iter_time(self, gpu_type: str, num_nodes: int, num_replicas: int, local_bsz: float, accum_steps: int) -> tuple[float, float]:
        """(T_iter, sync seconds) for ``num_replicas`` replicas: accumulation adds compute-only micro-batches."""
        step, sync = self._step_sync(gpu_type, num_nodes, num_replicas, local_bsz)
        return step + accum_steps * (step - sync), sync

    def step_sync(self, gpu_type: str, num_nodes: int, num_gpus: int, local_bsz: float) -> tuple[float, float]:
        """(step seconds, sync seconds) of one synchronised step without accumulation on ``num_gpus`` GPUs."""
        return self._step_sync(gpu_type, num_nodes, self._replicas_of(gpu_type, num_gpus), local_bsz)

    def iter_time(self, gpu_type: str, num_nodes: int, num_gpus: int, local_bsz: float, accum_steps: int) -> tuple[float, float]:
        """(seconds of one optimizer step T_iter, sync seconds) on ``num_gpus`` GPUs."""
        return self._iter_time(gpu_type, num_nodes, self._replicas_of(gpu_type, num_gpus), local_bsz, accum_steps)

    def rate(self, gpu_type: str, num_nodes: int, num_gpus: int, local_bsz: int, accum_steps: int, progress: float) -> float:
        """Progress per second, E(M) · M / M0 / T_iter, with M = replicas · local_bsz · (accum_steps + 1)."""
        replicas = self.replicas(gpu_type, num_gpus)
        if replicas < 1:
            return 0.0
        t_iter, _ = self._iter_time(gpu_type, num_nodes, replicas, local_bsz, accum_steps)
        batch = replicas * local_bsz * (accum_steps + 1)
        return self._efficiency_at(progress, batch) * batch / self.init_batch_size / t_iter

    def _efficiency_at(self, progress: float, batch: float) -> float:
        """:meth:`efficiency` of one batch size as a float (the simulator's per-job, per-round hot path: scalar
        interpolation, the same arithmetic as numpy's, instead of array calls)."""
        fraction = min(max(progress / self.work, 0.0), 1.0)
        runs = self._noise_runs
        if len(runs) == 1:
            log_phi = _interp(fraction, runs[0][1], runs[0][2])
        else:
            knots, at_runs = self._knots, [_interp(fraction, x, y) for _, x, y in runs]
            log_phi = _interp(float(np.log(float(batch))), knots, at_runs)
        phi = float(np.exp(log_phi))
        return (phi + self.init_batch_size) / (phi + float(batch))

    def candidates(self, gpu_type: str, num_nodes: Any, num_gpus: Any, fixed_batch: int | None = None) -> GoodputCandidates:
        """The batch candidates of allocations of ``num_gpus`` GPUs each and their true step times
        (:func:`goodput.optimize.goodput_candidates`): everything of :meth:`best_config` that does not move
        with progress. Every count must be whole pipelines (:meth:`configurations` gives only those)."""
        gpus = np.asarray(num_gpus)
        stages = self.stages(gpu_type)
        if stages > 1 and np.any(gpus % stages):
            bad = gpus[np.flatnonzero(gpus % stages)[0]] if gpus.ndim else gpus
            raise ValidationError(f"{self.name}.num_gpus", int(bad), f"not whole pipelines of {stages} GPUs on {gpu_type}")
        return self._candidates(gpu_type, num_nodes, gpus // stages if stages > 1 else gpus, fixed_batch)

    def _candidates(self, gpu_type: str, num_nodes: Any, num_replicas: Any, fixed_batch: int | None) -> GoodputCandidates:

        def step_fn(n: np.ndarray, r: np.ndarray, b: np.ndarray, a: np.ndarray) -> np.ndarray:
            return self._vector_iter_time(gpu_type, n, r, b, a)

        return goodput_candidates(step_fn, num_nodes, num_replicas, self.limits(gpu_type, fixed_batch),
                                  num_stages=self.stages(gpu_type))  # a pipeline may span nodes

    def best_config(self, gpu_type: str, num_nodes: Any, num_gpus: Any, progress: float,
                    fixed_batch: int | None = None, candidates: GoodputCandidates | None = None) -> GoodputChoices:
        """The true goodput-optimal batch configurations (an oracle's view) on ``num_gpus`` GPUs each;
        GPU counts that are not whole pipelines get goodput 0.

        ``candidates``: :meth:`candidates` of the same allocations, kept by the caller (the answer is the same).
        """
        efficiency = lambda m: self.efficiency(progress, m)  # noqa: E731
        if candidates is not None:
            return best_goodput(candidates, efficiency)
        stages = self.stages(gpu_type)
        if stages == 1:
            return best_goodput(self._candidates(gpu_type, num_nodes, num_gpus, fixed_batch), efficiency)
        gpus = np.asarray(num_gpus)
        whole = gpus % stages == 0
        replicas = np.where(whole, gpus // stages, 1)
        best = best_goodput(self._candidates(gpu_type, num_nodes, replicas, fixed_batch), efficiency)
        if np.all(whole):
            return best
        return GoodputChoices(*(np.where(whole, getattr(best, f), 0) for f in GoodputChoices.__dataclass_fields__))

    def _vector_iter_time(self, gpu_type: str, n: np.ndarray, r: np.ndarray, b: np.ndarray, a: np.ndarray) -> np.ndarray:
        """T_iter for arrays of (nodes, replicas, local batch, accumulation)."""
        out = np.empty(np.broadcast(n, r, b, a).shape)
        flat = [np.broadcast_to(x, out.shape).ravel() for x in (n, r, b, a)]
        for i, (ni, ri, bi, ai) in enumerate(zip(*flat)):
            out.flat[i] = self._iter_time(gpu_type, int(ni), int(ri), float(bi), int(ai))[0]
        return out


@dataclass(eq=False)
class ParametricFamily(Family):
    """Truth given by Pollux's throughput model per GPU type (the built-in catalog).

    For a hybrid-parallel family the model's replicas are pipelines: the parameters describe one
    pipeline's micro-batch and the synchronisation between pipelines.
    """

    params: dict[str, ThroughputParams] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._theta = {g: p.as_array() for g, p in self.params.items()}
        self._floats = {g: tuple(float(v) for v in theta) for g, theta in self._theta.items()}

    def _step_sync(self, gpu_type: str, num_nodes: int, num_replicas: int, local_bsz: float) -> tuple[float, float]:
        """Pollux's step time (``goodput.throughput._step_time``, no accumulation) of one configuration, in
        Python floats (the same arithmetic, without numpy's per-call cost), and its sync part."""
        a_c, b_c, a_n, b_n, a_r, b_r, gamma = self._floats[gpu_type]
        nodes, replicas, bsz = float(num_nodes), float(num_replicas), float(local_bsz)
        compute = a_c + b_c * bsz
        extra = max(replicas - 2.0, 0.0)
        sync = (a_n + b_n * extra) if nodes > 1 else (a_r + b_r * extra)
        sync = sync if replicas > 1 else 0.0
        top = max(compute, sync)
        if not top > 0:  # degenerate parameters: numpy's result (nan or inf), as before
            theta = self._theta[gpu_type]
            step = float(_step_time(theta, np.float64(num_nodes), np.float64(num_replicas), np.float64(local_bsz), 0.0))
            return step, max(step - compute, 0.0)
        step = 0.0 * compute + top * ((compute / top) ** gamma + (sync / top) ** gamma) ** (1.0 / gamma)
        return step, max(step - compute, 0.0)

    def _vector_iter_time(self, gpu_type: str, n: np.ndarray, r: np.ndarray, b: np.ndarray, a: np.ndarray) -> np.ndarray:
        return _step_time(self._theta[gpu_type], n, r, b, a)


def _interp(x: float, xp: Any, fp: Any) -> float:
    """``np.interp`` of one number, with numpy's arithmetic (the same result) but without an array call:
    clamped at the ends, ``fp[j]`` at a knot, else ``slope * (x - xp[j]) + fp[j]``."""
    n = len(xp)
    if x > xp[n - 1]:
        return float(fp[n - 1])
    if x < xp[0] or n == 1:
        return float(fp[0])
    j = bisect.bisect_right(xp, x) - 1
    if j >= n - 1:
        return float(fp[n - 1])
    if xp[j] == x:
        return float(fp[j])
    slope = (float(fp[j + 1]) - float(fp[j])) / (float(xp[j + 1]) - float(xp[j]))
    value = slope * (x - float(xp[j])) + float(fp[j])
    if math.isnan(value):  # numpy's fallbacks for infinite slopes
        value = slope * (x - float(xp[j + 1])) + float(fp[j + 1])
        if math.isnan(value) and fp[j] == fp[j + 1]:
            value = float(fp[j])
    return value


def check_cluster_types(families: Mapping[str, Family], cluster: Any, covered: Iterable[str] | None = None) -> None:
    """Raise :class:`~goodput.errors.ValidationError` naming the cluster's GPU types that no family of the
    ground truth has data for (their GPUs could never run a job, yet would count in the cluster's capacity
    and utilisation). ``covered``: every type the truth covers, for the message, where ``families`` were
    cut to the cluster's types (default: theirs)."""
    known = {g for family in families.values() for g in family.gpu_types}
    missing = [g for g in cluster.gpu_types if g not in known]
    if missing:
        listed = sorted(set(covered) if covered is not None else known)
        raise ValidationError("cluster", ",".join(missing), f"no ground truth for GPU type(s) {', '.join(missing)} "
                              f"(the truth covers {', '.join(listed) or 'none'}); remove them from the cluster")


def load_catalog(path: str | Path = CATALOG_PATH, gpu_types: list[str] | None = None) -> dict[str, ParametricFamily]:
    """The built-in job families (or those of another catalog file written by ``build_catalog``).

    Raises :class:`~goodput.errors.DataFormatError` naming the file and the field for a file that is
    not such a catalog (no ``families`` mapping, an entry lacking a field or holding a bad value).
    """
    data = read_json(path)
    entries = data.get("families") if isinstance(data, Mapping) else None
    if not isinstance(entries, Mapping) or not entries:
        raise DataFormatError(path, None, "families", entries if isinstance(data, Mapping) else type(data).__name__,
                              "expected a catalog {'families': {name: {...}}, ...} as build_catalog writes")
    families = {}
    for name, entry in entries.items():
        try:
            families[name] = _family_from_json(name, entry, gpu_types)
        except ValidationError as exc:
            raise DataFormatError(path, None, f"families.{name}: {exc.field}", exc.value, exc.reason) from None
        except KeyError as exc:
            raise DataFormatError(path, None, f"families.{name}.{exc.args[0]}", None, "missing") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise DataFormatError(path, None, f"families.{name}", type(entry).__name__,
                                  f"not a catalog entry ({exc})") from None
    return families


def _family_from_json(name: str, entry: Mapping[str, Any], gpu_types: list[str] | None) -> ParametricFamily:
    types = [g for g in entry["params"] if gpu_types is None or g in gpu_types]
    return ParametricFamily(
        name=name,
        init_batch_size=int(entry["init_batch_size"]),
        max_batch_size=int(entry["max_batch_size"]),
        min_local_bsz=int(entry["min_local_bsz"]),
        max_local_bsz={g: int(entry["max_local_bsz"][g]) for g in types},
        work=float(entry["work"]),
        noise=_noise_from_json(entry["noise"]),
        restart_cost_s=float(entry["restart_cost_s"]) if "restart_cost_s" in entry else None,
        num_stages=entry.get("num_stages", 1),
        params={g: ThroughputParams(**entry["params"][g]) for g in types},
    )


def _noise_from_json(value: Any) -> Any:
    """``[[fraction, φ], ...]`` (the run at M0) or ``{"<batch>": [[fraction, φ], ...]}``."""
    if isinstance(value, Mapping):
        return {int(b): tuple((float(x), float(y)) for x, y in knots) for b, knots in value.items()}
    return tuple((float(x), float(y)) for x, y in value)


def catalog_workload_stats(path: str | Path = CATALOG_PATH) -> Mapping[str, Any]:
    """The catalog's workload-generator statistics (application mix, GPU counts, arrival profile)."""
    return json.loads(Path(path).read_text(encoding="utf-8"))["workload"]


# ====================================================================== measured tables


@dataclass
class _TypeTables:
    """One GPU type's measurements of one model, prepared for interpolation (counts are GPUs, not replicas)."""

    by_placement: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]]  # bsz, step, sync
    points: np.ndarray  # (k, 3): nodes, GPUs, log bsz
    values: np.ndarray  # (k, 2): log step, log sync (+ tiny)
    fallback: ThroughputParams | None  # a Pollux fit (data-parallel); None: the nearest measurement (pipelines)


@dataclass(eq=False)
class MeasuredFamily(Family):
    """Truth interpolated from measured tables (Pollux's simulator approach); a GPU type with several
    stages per replica reads pipeline tables (see the module docstring)."""

    tables: dict[str, _TypeTables] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._interp: dict[str, Any] = {}
        self._nearest: dict[str, Any] = {}
        self._cached = lru_cache(maxsize=100_000)(self._interpolate)

    def _step_sync(self, gpu_type: str, num_nodes: int, num_replicas: int, local_bsz: float) -> tuple[float, float]:
        """(step, sync) seconds as the tables give them; for a pipeline type, (one micro-batch's forward pass
        through one stage, communication per optimizer step)."""
        return self._cached(gpu_type, int(num_nodes), int(num_replicas) * self.stages(gpu_type), float(local_bsz))

    def _iter_time(self, gpu_type: str, num_nodes: int, num_replicas: int, local_bsz: float, accum_steps: int) -> tuple[float, float]:
        stages = self.stages(gpu_type)
        if stages == 1:
            return super()._iter_time(gpu_type, num_nodes, num_replicas, local_bsz, accum_steps)
        forward, sync = self._step_sync(gpu_type, num_nodes, num_replicas, local_bsz)
        return pipeline_step_time(forward, sync, stages, accum_steps + 1), sync

    def _interpolate(self, gpu_type: str, num_nodes: int, num_gpus: int, local_bsz: float) -> tuple[float, float]:
        tables = self.tables[gpu_type]
        pipeline = tables.fallback is None
        placement = _even_placement(num_nodes, num_gpus)
        key = _canonical_placement(placement)
        if key in tables.by_placement:
            bsz, step, sync = tables.by_placement[key]
            x = min(max(float(local_bsz), bsz[0]), bsz[-1])
            return float(np.interp(x, bsz, step)), float(np.interp(x, bsz, sync))
        point = [[num_nodes, num_gpus, math.log(local_bsz)]]
        interp = self._interp.get(gpu_type)
        if interp is None and len(tables.points) >= 4:
            from scipy.interpolate import LinearNDInterpolator

            try:
                interp = LinearNDInterpolator(tables.points, tables.values)
            except Exception:  # degenerate point sets (all on a plane): use the fallback
                interp = False
            self._interp[gpu_type] = interp
        if interp:
            value = interp(point)[0]
            if np.all(np.isfinite(value)):
                step, sync = float(np.exp(value[0])), float(np.exp(value[1]))
                return (step, sync) if pipeline else (step, min(sync, step))
        if pipeline:  # outside the measured hull: the nearest measurement (a pipeline's times do not follow Pollux's model)
            nearest = self._nearest.get(gpu_type)
            if nearest is None:
                from scipy.interpolate import NearestNDInterpolator

                nearest = self._nearest[gpu_type] = NearestNDInterpolator(tables.points, tables.values)
            value = nearest(point)[0]
            return float(np.exp(value[0])), float(np.exp(value[1]))
        theta = tables.fallback.as_array()
        step = float(_step_time(theta, np.float64(num_nodes), np.float64(num_gpus), np.float64(local_bsz), 0.0))
        return step, max(step - (theta[0] + theta[1] * local_bsz), 0.0)


def pipeline_step_time(forward: Any, sync: Any, num_stages: int, num_microbatches: Any) -> Any:
    """Seconds of one optimizer step of a pipeline: ``3 · (S − 1 + M) · forward + sync``.

    ``forward``: one micro-batch's forward pass through one stage (s); ``sync``: communication per step
    that compute does not hide (s); S stages; M micro-batches. A backward pass costs two forward passes
    and the pipeline fills and drains in S − 1 slots (GPipe's schedule; Sia's goodput model for
    pipeline-parallel jobs, SOSP'23 artifact ``GoodputFunctionPMP``).
    """
    return 3.0 * (num_stages - 1 + np.asarray(num_microbatches, dtype=float)) * forward + sync


def _even_placement(num_nodes: int, num_gpus: int) -> tuple[int, ...]:
    base, extra = divmod(num_gpus, num_nodes)
    return tuple(base + (1 if i < extra else 0) for i in range(num_nodes))


def _canonical_placement(placement: tuple[int, ...]) -> tuple[int, ...]:
    """The lexicographically smallest rotation, as Pollux keys its placement traces."""
    p = tuple(x for x in placement if x)
    return min(p[i:] + p[:i] for i in range(len(p)))


Row = tuple[tuple[int, ...], int, float, float]  # placement (GPUs per node), local batch, step s, sync s


def _type_tables(rows: list[Row], observations: list[Observation] | None) -> _TypeTables:
    """Tables of one type from its rows; ``observations`` (data-parallel tables) give the Pollux fallback fit."""
    groups: dict[tuple[int, ...], dict[int, list[tuple[float, float]]]] = {}
    for placement, bsz, step, sync in rows:
        groups.setdefault(_canonical_placement(placement), {}).setdefault(bsz, []).append((step, sync))
    by_placement = {}
    for key, by_bsz in groups.items():
        sizes = sorted(by_bsz)
        by_placement[key] = (np.array(sizes, dtype=float),
                             np.array([np.mean([r[0] for r in by_bsz[b]]) for b in sizes]),
                             np.array([np.mean([r[1] for r in by_bsz[b]]) for b in sizes]))
    points = np.array([[len(p), sum(p), math.log(b)] for p, b, _, _ in rows])
    values = np.array([[math.log(step), math.log(max(sync, 1e-9))] for _, _, step, sync in rows])
    return _TypeTables(by_placement, points, values, fit_throughput(observations) if observations else None)


class IncompleteModelError(DataFormatError):
    """A folder of the truth directory lacks step-time tables or validation traces (not a model folder)."""


@dataclass
class _ModelData:
    """One model folder, read and checked (no fits yet)."""

    name: str
    rows: dict[str, list[Row]]  # per GPU type
    observations: dict[str, list[Observation]]  # per data-parallel GPU type
    validations: list[tuple[int, Any]]  # (batch size of the run, its rows), by batch size
    restart_cost_s: float | None
    num_stages: Any


def _read_settings(model_dir: Path) -> tuple[float | None, Any]:
    """``(restart_cost_s or None, num_stages)`` from the folder's ``application.json`` (module docstring)."""
    path = model_dir / APPLICATION_FILE
    if not path.exists():
        return None, 1
    data = read_json(path)
    if not isinstance(data, Mapping):
        raise DataFormatError(path, None, "application", type(data).__name__,
                              'expected a JSON object such as {"restart_cost_s": 80, "num_stages": 2}')
    unknown = sorted(set(data) - {"restart_cost_s", "num_stages"})
    if unknown:
        raise DataFormatError(path, None, unknown[0], data[unknown[0]], "unknown key (known: num_stages, restart_cost_s)")
    try:
        cost = check_float("restart_cost_s", data["restart_cost_s"], nonnegative=True) if "restart_cost_s" in data else None
        stages = data.get("num_stages", 1)
        if isinstance(stages, Mapping):
            stages = {gpu_slug(str(k)): v for k, v in stages.items()}
        return cost, check_num_stages(stages)
    except ValidationError as exc:
        raise DataFormatError(path, None, exc.field, exc.value, exc.reason) from None


def _pipeline_rows(path: Path, kind: str, stages: int) -> list[Row]:
    """Rows of a pipeline-parallel table (module docstring), each GPU count checked to be whole pipelines."""
    if kind == "placements":
        schema = {"placement": "placement", "local_bsz": "int+", "step_time": "float+"}
    else:
        schema = {"num_nodes": "int+", "num_replicas": "int+", "local_bsz": "int+", "step_time": "float+"}
    rows: list[Row] = []
    for line_no, row in read_csv_rows(path, schema, {"sync_time": "float0"}):
        if kind == "placements":
            placement, column, value = row["placement"], "placement", "".join(map(str, row["placement"]))
        else:
            if row["num_replicas"] < row["num_nodes"]:
                raise DataFormatError(path, line_no, "num_replicas", row["num_replicas"],
                                      f"fewer GPUs than num_nodes ({row['num_nodes']})")
            placement, column, value = _even_placement(row["num_nodes"], row["num_replicas"]), "num_replicas", row["num_replicas"]
        if sum(placement) % stages:
            raise DataFormatError(path, line_no, column, value, f"{sum(placement)} GPUs are not whole pipelines of "
                                  f"num_stages={stages} GPUs ({APPLICATION_FILE})")
        rows.append((tuple(placement), row["local_bsz"], row["step_time"], row["sync_time"] or 0.0))
    return rows


def _read_model(model_dir: Path, default_gpu_type: str) -> _ModelData:
    """Read and check one model folder; raises :class:`DataFormatError` (one line: file, row, field) on a bad
    table, :class:`IncompleteModelError` for a folder without tables or validation traces."""
    name = model_dir.name
    cost, num_stages = _read_settings(model_dir)
    stages = Stages.parse(num_stages)
    rows: dict[str, list[Row]] = {}
    observations: dict[str, list[Observation]] = {}
    for path, kind, gpu, _typed in table_files(model_dir, default_gpu_type):
        if stages.of(gpu) > 1:
            rows.setdefault(gpu, []).extend(_pipeline_rows(path, kind, stages.of(gpu)))
            continue
        reader = read_placements if kind == "placements" else read_scalability
        try:
            read = reader(path, name, gpu, source=f"{kind}:{path.name}")
        except DataFormatError as exc:
            if exc.field == "sync_time" and "step_time" in exc.reason:  # Sia's pipeline tables look like this
                raise DataFormatError(path, exc.line, exc.field, exc.value,
                                      f"{exc.reason} (a pipeline-parallel table? declare its num_stages in "
                                      f"{model_dir / APPLICATION_FILE})") from None
            raise
        observations.setdefault(gpu, []).extend(read)
        rows.setdefault(gpu, []).extend(
            (o.placement or _even_placement(o.num_nodes, o.num_replicas), o.local_bsz, o.step_time, o.sync_time or 0.0)
            for o in read)
    validations = []
    for path in model_dir.glob("validation-*.csv"):
        batch = path.stem.split("-", 1)[1]
        if not batch.isdigit() or int(batch) < 1:
            raise DataFormatError(path, None, "file name", path.name, "expected validation-<batch size>.csv")
        validations.append((int(batch), read_validation(path)))
    validations.sort(key=lambda item: item[0])
    files = sorted(p.name for p in model_dir.iterdir())[:6]
    if not rows:
        raise IncompleteModelError(model_dir, None, "files", files, "no step-time tables (placements-<gpu_type>.csv "
                                   "or scalability-<gpu_type>.csv)")
    if not validations:
        raise IncompleteModelError(model_dir, None, "files", files, "no validation-<batch>.csv (the work and gradient "
                                   "noise of a training run)")
    for batch, trace in validations:
        if not trace:
            raise DataFormatError(model_dir / f"validation-{batch}.csv", None, "rows", 0, "the trace holds no epoch")
    return _ModelData(name, rows, observations, validations, cost, num_stages)


def _family(data: _ModelData, model_dir: Path, restart_cost_s: float | None) -> MeasuredFamily:
    m0, max_bs = data.validations[0][0], data.validations[-1][0]
    traces = [trace for _, trace in data.validations]
    work = min(t[-1].progress for t in traces)
    noise = {}
    for batch, trace in data.validations:
        kept = [r for r in trace if r.grad_sqr > 0]  # φ is undefined where |g|² vanished
        if kept:
            noise[batch] = tuple((r.progress / trace[-1].progress, m0 * r.grad_var / r.grad_sqr) for r in kept)
    local = sorted({r[1] for rows in data.rows.values() for r in rows})
    try:
        return MeasuredFamily(
            name=data.name,
            init_batch_size=m0,
            max_batch_size=max_bs,
            min_local_bsz=local[0],
            max_local_bsz={g: max(r[1] for r in rows) for g, rows in data.rows.items()},
            work=float(work),
            noise=noise,
            restart_cost_s=restart_cost_s if restart_cost_s is not None else data.restart_cost_s,
            num_stages=data.num_stages,
            tables={g: _type_tables(rows, data.observations.get(g)) for g, rows in data.rows.items()},
        )
    except ValidationError as exc:
        raise DataFormatError(model_dir, None, exc.field, exc.value, exc.reason) from None


def load_measured(directory: str | Path, default_gpu_type: str = "t4", restart_cost_s: float | None = None,
                  applications: Iterable[str] | None = None,
                  skipped: dict[str, str] | None = None) -> dict[str, MeasuredFamily]:
    """Families from ``<dir>/<model>/placements-<gpu_type>.csv`` (+ scalability, validation, application.json).

    The tables are read as the accuracy harness reads them
    (:func:`experiments.datasets.read_model_tables`: the same GPU type names), but strictly: a row
    whose step time is empty, 0 or NaN raises :class:`~goodput.errors.DataFormatError` (one line: file,
    row, field) rather than being left out, since a simulation's ground truth should not lose
    configurations silently.

    Args:
        restart_cost_s: seconds every family loses per reallocation; ``None``: each model's own
            (its ``application.json``, else :func:`restart_cost_of` its name).
        applications: the models to load (a workload's applications); the other folders are not
            loaded, so a bad table there stops nothing. ``None``: every model folder (folders
            without tables or validation traces are passed over).
        skipped: filled with ``{folder: why it was not loaded}``: not used by the workload (and, if
            its tables do not load, why), or not a model folder. Without it the unused folders are
            not read at all.

    Raises:
        DataFormatError: a needed model's table, trace or ``application.json`` is bad, or a needed
            application has no complete folder.
        FileNotFoundError: ``directory`` does not exist or holds no model.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"measured tables directory not found: {directory}")
    folders = {p.name: p for p in sorted(directory.iterdir()) if p.is_dir()}
    wanted = None if applications is None else set(applications)
    if wanted is not None:
        missing = sorted(wanted - set(folders))
        if missing:
            raise DataFormatError(directory, None, "application", missing[0],
                                  f"no such model folder (the directory holds: {', '.join(folders) or 'none'})")
    families = {}
    for name, folder in folders.items():
        if wanted is not None and name not in wanted:
            if skipped is not None:
                try:
                    _read_model(folder, default_gpu_type)
                    skipped[name] = "not used by the workload"
                except IncompleteModelError as exc:
                    skipped[name] = f"not a model folder: {exc}"
                except DataFormatError as exc:
                    skipped[name] = f"not used by the workload, and its tables do not load: {exc}"
            continue
        try:
            data = _read_model(folder, default_gpu_type)
        except IncompleteModelError as exc:
            if wanted is not None:
                raise
            if skipped is not None:
                skipped[name] = f"not a model folder: {exc}"
            continue
        families[name] = _family(data, folder, restart_cost_s)
    if not families:
        raise FileNotFoundError(f"no model folders with placements and validation tables in {directory}")
    return families
