"""Ground truth for simulation: how fast each job family really runs, and how much work it has.

Two sources share one interface, :class:`Family`:

* :func:`load_catalog` — the built-in catalog (``catalog.json``, derived by
  :mod:`experiments.simulator.build_catalog` from public measurements): Pollux's
  throughput model per GPU type and a gradient-noise trajectory per family.
* :func:`load_measured` — a directory of measured tables, one folder per model
  with ``placements-<gpu_type>.csv``, ``scalability-<gpu_type>.csv`` and
  ``validation-<batch>.csv`` (Pollux's formats; a plain ``placements.csv`` /
  ``scalability.csv`` is read as ``default_gpu_type``). Step times are
  interpolated across batch sizes within a measured placement and, for
  placements never measured, across (nodes, replicas, local batch) — as
  Pollux's simulator does — with a Pollux fit as the fallback outside the data.

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from experiments.datasets import read_model_tables, read_validation
from goodput.errors import DataFormatError, ValidationError
from goodput.io import read_json
from goodput.observations import Observation, by_gpu_type
from goodput.optimize import BatchLimits, GoodputCandidates, best_goodput, goodput_candidates
from goodput.throughput import ThroughputParams, _step_time, fit_throughput

__all__ = ["Family", "ParametricFamily", "MeasuredFamily", "check_cluster_types", "load_catalog", "load_measured",
           "CATALOG_PATH"]

CATALOG_PATH = Path(__file__).with_name("catalog.json")


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
        restart_cost_s: seconds lost on every reallocation.
    """

    name: str
    init_batch_size: int
    max_batch_size: int
    min_local_bsz: int
    max_local_bsz: dict[str, int]
    work: float
    noise: Any
    restart_cost_s: float = 30.0
    _noise_runs: list[tuple[float, np.ndarray, np.ndarray]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
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

    @property
    def gpu_types(self) -> list[str]:
        return list(self.max_local_bsz)

    def supports(self, gpu_type: str) -> bool:
        return gpu_type in self.max_local_bsz

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
    def step_sync(self, gpu_type: str, num_nodes: int, num_replicas: int, local_bsz: float) -> tuple[float, float]:
        """(step seconds, sync seconds) of one synchronised step without accumulation."""

    def iter_time(self, gpu_type: str, num_nodes: int, num_replicas: int, local_bsz: float, accum_steps: int) -> tuple[float, float]:
        """(seconds of one optimizer step T_iter, sync seconds): accumulation adds compute-only micro-batches."""
        step, sync = self.step_sync(gpu_type, num_nodes, num_replicas, local_bsz)
        return step + accum_steps * (step - sync), sync

    def rate(self, gpu_type: str, num_nodes: int, num_replicas: int, local_bsz: int, accum_steps: int, progress: float) -> float:
        """Progress per second, E(M) · M / M0 / T_iter."""
        t_iter, _ = self.iter_time(gpu_type, num_nodes, num_replicas, local_bsz, accum_steps)
        batch = num_replicas * local_bsz * (accum_steps + 1)
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

    def candidates(self, gpu_type: str, num_nodes: Any, num_replicas: Any, fixed_batch: int | None = None) -> GoodputCandidates:
        """The batch candidates of allocations and their true step times (:func:`goodput.optimize.goodput_candidates`):
        everything of :meth:`best_config` that does not move with progress."""

        def step_fn(n: np.ndarray, r: np.ndarray, b: np.ndarray, a: np.ndarray) -> np.ndarray:
            return self._vector_iter_time(gpu_type, n, r, b, a)

        return goodput_candidates(step_fn, num_nodes, num_replicas, self.limits(gpu_type, fixed_batch))

    def best_config(self, gpu_type: str, num_nodes: Any, num_replicas: Any, progress: float, fixed_batch: int | None = None,
                    candidates: GoodputCandidates | None = None):
        """The true goodput-optimal batch configurations (an oracle's view) as :class:`GoodputChoices`.

        ``candidates``: :meth:`candidates` of the same allocations, kept by the caller (the answer is the same).
        """
        if candidates is None:
            candidates = self.candidates(gpu_type, num_nodes, num_replicas, fixed_batch)
        return best_goodput(candidates, lambda m: self.efficiency(progress, m))

    def _vector_iter_time(self, gpu_type: str, n: np.ndarray, r: np.ndarray, b: np.ndarray, a: np.ndarray) -> np.ndarray:
        out = np.empty(np.broadcast(n, r, b, a).shape)
        flat = [np.broadcast_to(x, out.shape).ravel() for x in (n, r, b, a)]
        for i, (ni, ri, bi, ai) in enumerate(zip(*flat)):
            out.flat[i] = self.iter_time(gpu_type, int(ni), int(ri), float(bi), int(ai))[0]
        return out


@dataclass(eq=False)
class ParametricFamily(Family):
    """Truth given by Pollux's throughput model per GPU type (the built-in catalog)."""

    params: dict[str, ThroughputParams] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._theta = {g: p.as_array() for g, p in self.params.items()}
        self._floats = {g: tuple(float(v) for v in theta) for g, theta in self._theta.items()}

    def step_sync(self, gpu_type: str, num_nodes: int, num_replicas: int, local_bsz: float) -> tuple[float, float]:
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


def check_cluster_types(families: Mapping[str, Family], cluster: Any) -> None:
    """Raise :class:`~goodput.errors.ValidationError` naming the cluster's GPU types that no family of the
    ground truth has data for (their GPUs could never run a job, yet would count in the cluster's capacity
    and utilisation)."""
    known = {g for family in families.values() for g in family.gpu_types}
    missing = [g for g in cluster.gpu_types if g not in known]
    if missing:
        raise ValidationError("cluster", ",".join(missing), f"no ground truth for GPU type(s) {', '.join(missing)} "
                              f"(the truth covers {', '.join(sorted(known)) or 'none'}); remove them from the cluster")


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
        restart_cost_s=float(entry.get("restart_cost_s", 30.0)),
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
    """One GPU type's measurements of one model, prepared for interpolation."""

    by_placement: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]]  # bsz, step, sync
    points: np.ndarray  # (k, 3): nodes, replicas, log bsz
    values: np.ndarray  # (k, 2): log step, log sync (+ tiny)
    fallback: ThroughputParams


@dataclass(eq=False)
class MeasuredFamily(Family):
    """Truth interpolated from measured tables (Pollux's simulator approach)."""

    tables: dict[str, _TypeTables] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._interp: dict[str, Any] = {}
        self._cached = lru_cache(maxsize=100_000)(self._interpolate)

    def step_sync(self, gpu_type: str, num_nodes: int, num_replicas: int, local_bsz: float) -> tuple[float, float]:
        return self._cached(gpu_type, int(num_nodes), int(num_replicas), float(local_bsz))

    def _interpolate(self, gpu_type: str, num_nodes: int, num_replicas: int, local_bsz: float) -> tuple[float, float]:
        tables = self.tables[gpu_type]
        placement = _even_placement(num_nodes, num_replicas)
        key = _canonical_placement(placement)
        if key in tables.by_placement:
            bsz, step, sync = tables.by_placement[key]
            x = min(max(float(local_bsz), bsz[0]), bsz[-1])
            return float(np.interp(x, bsz, step)), float(np.interp(x, bsz, sync))
        interp = self._interp.get(gpu_type)
        if interp is None and len(tables.points) >= 4:
            from scipy.interpolate import LinearNDInterpolator

            try:
                interp = LinearNDInterpolator(tables.points, tables.values)
            except Exception:  # degenerate point sets (all on a plane): use the fallback fit
                interp = False
            self._interp[gpu_type] = interp
        if interp:
            value = interp([[num_nodes, num_replicas, math.log(local_bsz)]])[0]
            if np.all(np.isfinite(value)):
                step, sync = float(np.exp(value[0])), float(np.exp(value[1]))
                return step, min(sync, step)
        theta = tables.fallback.as_array()
        step = float(_step_time(theta, np.float64(num_nodes), np.float64(num_replicas), np.float64(local_bsz), 0.0))
        return step, max(step - (theta[0] + theta[1] * local_bsz), 0.0)


def _even_placement(num_nodes: int, num_replicas: int) -> tuple[int, ...]:
    base, extra = divmod(num_replicas, num_nodes)
    return tuple(base + (1 if i < extra else 0) for i in range(num_nodes))


def _canonical_placement(placement: tuple[int, ...]) -> tuple[int, ...]:
    """The lexicographically smallest rotation, as Pollux keys its placement traces."""
    p = tuple(x for x in placement if x)
    return min(p[i:] + p[:i] for i in range(len(p)))


def _type_tables(observations: list[Observation]) -> _TypeTables:
    groups: dict[tuple[int, ...], list[Observation]] = {}
    for obs in observations:
        placement = obs.placement or _even_placement(obs.num_nodes, obs.num_replicas)
        groups.setdefault(_canonical_placement(placement), []).append(obs)
    by_placement = {}
    for key, obs in groups.items():
        rows: dict[int, list[tuple[float, float]]] = {}
        for o in obs:
            rows.setdefault(o.local_bsz, []).append((o.step_time, o.sync_time or 0.0))
        bsz = np.array(sorted(rows), dtype=float)
        step = np.array([np.mean([r[0] for r in rows[b]]) for b in sorted(rows)])
        sync = np.array([np.mean([r[1] for r in rows[b]]) for b in sorted(rows)])
        by_placement[key] = (bsz, step, sync)
    points = np.array([[o.num_nodes, o.num_replicas, math.log(o.local_bsz)] for o in observations])
    values = np.array([[math.log(o.step_time), math.log(max(o.sync_time or 0.0, 1e-9))] for o in observations])
    return _TypeTables(by_placement, points, values, fit_throughput(observations))


def load_measured(directory: str | Path, default_gpu_type: str = "t4", restart_cost_s: float = 30.0) -> dict[str, MeasuredFamily]:
    """Families from ``<dir>/<model>/placements-<gpu_type>.csv`` (+ scalability, validation) tables.

    The tables are read as the accuracy harness reads them
    (:func:`experiments.datasets.read_model_tables`: the same GPU type names), but strictly: a row
    whose step time is empty, 0 or NaN raises :class:`~goodput.errors.DataFormatError` rather than
    being left out, since a simulation's ground truth should not lose configurations silently.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"measured tables directory not found: {directory}")
    families = {}
    for model_dir in sorted(p for p in directory.iterdir() if p.is_dir()):
        per_type = by_gpu_type(read_model_tables(model_dir, model_dir.name, default_gpu_type, strict=True))
        validations = sorted(model_dir.glob("validation-*.csv"), key=lambda p: int(p.stem.split("-")[1]))
        if not per_type or not validations:
            continue
        m0 = int(validations[0].stem.split("-")[1])
        max_bs = int(validations[-1].stem.split("-")[1])
        traces = [read_validation(p) for p in validations]
        work = min(t[-1].progress for t in traces)
        noise = {}
        for path, trace in zip(validations, traces):
            rows = [r for r in trace if r.grad_sqr > 0]  # φ is undefined where |g|² vanished
            if rows:
                noise[int(path.stem.split("-")[1])] = tuple((r.progress / trace[-1].progress, m0 * r.grad_var / r.grad_sqr)
                                                            for r in rows)
        local = sorted({o.local_bsz for obs in per_type.values() for o in obs})
        families[model_dir.name] = MeasuredFamily(
            name=model_dir.name,
            init_batch_size=m0,
            max_batch_size=max_bs,
            min_local_bsz=local[0],
            max_local_bsz={g: max(o.local_bsz for o in obs) for g, obs in per_type.items()},
            work=float(work),
            noise=noise,
            restart_cost_s=restart_cost_s,
            tables={g: _type_tables(obs) for g, obs in per_type.items()},
        )
    if not families:
        raise FileNotFoundError(f"no model folders with placements and validation tables in {directory}")
    return families
