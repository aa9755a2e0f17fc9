"""The cluster's shape of inter-node synchronisation, learned from its jobs.

Pollux's throughput model (Qiao et al., OSDI'21, §3.2) prices inter-node
gradient synchronisation as ``α_n + β_n · (num_replicas − 2)``: it depends on
the number of replicas, not on how they are spread over nodes. On a real
cluster the spread matters, and it matters the same way for every job, since
it is the network's: on Pollux's T4 traces (4 GPUs per node) 8
replicas on 2 nodes wait 1.4–2.4× longer on sync than 8 replicas on 4 nodes,
in each of the six models (measured ``sync_time``, median over batch sizes),
and the steps of "44" placements take 14–58% longer than Pollux's fit to the
job's own data predicts, those of one GPU per node 7–27% less.

:class:`SyncShape` is that shape: a factor φ(num_nodes, num_replicas) on the
inter-node sync of Pollux's form, per GPU type, learned by
:func:`learn_sync_shape` jointly with each job's own parameters (each job
keeps its own α_n, β_n: the shape only says how the cluster bends them).
A job's model uses the shape of its :class:`~goodput.hierarchy.ClusterPrior`,
so a new job predicts placements it has not run from what the cluster's other
jobs showed. Configurations on one node, and (nodes, replicas) cells that
fewer than :data:`SHAPE_MIN_JOBS` of the jobs ran, keep φ = 1 (Pollux's form).

Example::

    >>> shape = SyncShape({(2, 8): 1.4, (4, 8): 0.9})
    >>> shape(np.array([1.0, 2.0, 4.0, 3.0]), np.array([4.0, 8.0, 8.0, 6.0])).tolist()
    [1.0, 1.4, 0.9, 1.0]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ValidationError
from .observations import Observation
from .throughput import ThroughputParams, _step_time, fit_throughput, throughput_arrays
from .validation import check_float, check_int

__all__ = ["SyncShape", "learn_sync_shape", "SHAPE_MIN_JOBS", "SHAPE_LOG_STD"]

SHAPE_MIN_JOBS = 2  # jobs that must have run a (nodes, replicas) cell for it to get a factor
SHAPE_LOG_STD = 0.5  # prior std of log φ (a factor of 1.65): a cell few observations cover stays near 1
SHAPE_ROUNDS = 3  # alternations between the jobs' fits and the cells' factors
SHAPE_RESID_FLOOR = 0.02  # smallest RMS log residual a job's fit is credited with (its observations' weight)
_FACTOR_RANGE = (0.1, 10.0)
# A shape is a dense grid up to its largest cell, so a cell beyond these is a corrupt record, not a
# learned one: no job runs on more replicas, and no legitimate shape needs a larger grid (128 MiB).
_MAX_REPLICAS = 2**17
_MAX_GRID_CELLS = 2**24


@dataclass(frozen=True)
class SyncShape:
    """Factor on inter-node synchronisation per (num_nodes, num_replicas); 1 for other configurations.

    Attributes:
        factors: ``{(num_nodes, num_replicas): φ}`` for multi-node cells (num_nodes ≥ 2).
        jobs: how many jobs it was learned from (information only).
    """

    factors: Mapping[tuple[int, int], float]
    jobs: int = 0
    _grid: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        clean: dict[tuple[int, int], float] = {}
        for key, value in dict(self.factors).items():
            nodes, replicas = _check_cell(key)
            factor = check_float(f"factors[{key!r}]", value, positive=True)
            low, high = _FACTOR_RANGE
            if not low <= factor <= high:
                raise ValidationError(f"factors[{key!r}]", factor, f"must lie in [{low}, {high}]")
            clean[(nodes, replicas)] = factor
        object.__setattr__(self, "factors", clean)
        object.__setattr__(self, "jobs", check_int("jobs", self.jobs, minimum=0))
        size_n = max((n for n, _ in clean), default=1) + 1
        size_r = max((r for _, r in clean), default=1) + 1
        if size_n * size_r > _MAX_GRID_CELLS:
            raise ValidationError("factors", (size_n - 1, size_r - 1),
                                  f"a lookup grid this large takes more than {_MAX_GRID_CELLS} cells")
        grid = np.ones((size_n, size_r))
        for (n, r), factor in clean.items():
            grid[n, r] = factor
        object.__setattr__(self, "_grid", grid)

    def __call__(self, num_nodes: Any, num_replicas: Any) -> np.ndarray:
        """φ of each configuration (broadcast arrays); 1 on one node and in cells without a factor."""
        n, r = np.broadcast_arrays(np.rint(num_nodes).astype(int), np.rint(num_replicas).astype(int))
        size_n, size_r = self._grid.shape
        # indices outside the grid point at its corner [0, 0], which holds 1 (no cell has fewer than 2 nodes)
        inside = (n >= 0) & (n < size_n) & (r >= 0) & (r < size_r)
        return self._grid[np.where(inside, n, 0), np.where(inside, r, 0)]

    def __bool__(self) -> bool:
        return bool(self.factors)

    def to_dict(self) -> dict[str, Any]:
        return {"jobs": self.jobs, "factors": [[n, r, f] for (n, r), f in sorted(self.factors.items())]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SyncShape:
        """A saved shape (:meth:`to_dict`), checked as the constructor checks a new one: a corrupt record raises."""
        if not isinstance(data, Mapping) or not isinstance(data.get("factors"), list):
            raise ValidationError("sync_shape", data, "expected {'factors': [[num_nodes, num_replicas, factor], ...]}")
        factors = {}
        for item in data["factors"]:
            if not (isinstance(item, (list, tuple)) and len(item) == 3):
                raise ValidationError("sync_shape.factors", item, "expected [num_nodes, num_replicas, factor]")
            factors[_check_cell(tuple(item[:2]), field="sync_shape.factors")] = item[2]
        return cls(factors, jobs=check_int("sync_shape.jobs", data.get("jobs", 0), minimum=0))


def _check_cell(key: Any, field: str = "factors") -> tuple[int, int]:
    """A ``(num_nodes, num_replicas)`` cell as ints: 2 <= num_nodes <= num_replicas <= :data:`_MAX_REPLICAS`."""
    if not (isinstance(key, tuple) and len(key) == 2):
        raise ValidationError(field, key, "keys must be (num_nodes, num_replicas) pairs")
    try:
        nodes, replicas = (check_int(field, k) for k in key)
    except ValidationError:
        raise ValidationError(field, key, "num_nodes and num_replicas must be integers") from None
    if nodes < 2 or replicas < nodes:
        raise ValidationError(field, key, "cells need num_nodes >= 2 and num_replicas >= num_nodes")
    if replicas > _MAX_REPLICAS:
        raise ValidationError(field, key, f"num_replicas must be <= {_MAX_REPLICAS}")
    return nodes, replicas


def learn_sync_shape(jobs: Iterable[Sequence[Observation]], *, rounds: int = SHAPE_ROUNDS) -> SyncShape | None:
    """The inter-node sync shape that one GPU type's jobs share, or ``None`` when they cannot teach one.

    ``jobs``: each job's observations on the type. Jobs without multi-node observations do not
    take part; with fewer than :data:`SHAPE_MIN_JOBS` that have them, there is no shape.

    Maximum a posteriori, by alternation (``rounds`` times): each job's Pollux fit with the
    current shape (:func:`~goodput.throughput.fit_throughput`), then each cell's log φ by
    Gauss–Newton on the log residuals of step time of the jobs' observations in it, each job
    weighing the same in total (a job with more observations does not own the shape) and each
    observation weighted by its job's fit precision (1 / RMS residual²), under a N(0,
    :data:`SHAPE_LOG_STD`²) prior on log φ, which also settles what each job's α_n, β_n could
    absorb alike. Cells fewer than :data:`SHAPE_MIN_JOBS` jobs ran keep φ = 1.
    """
    groups = [list(obs) for obs in jobs]
    groups = [g for g in groups if any(o.num_nodes > 1 for o in g)]
    if len(groups) < SHAPE_MIN_JOBS:
        return None
    cols = [throughput_arrays(g) for g in groups]
    # each observation's (nodes, replicas) cell, None on one node
    cells_of = [[(int(n), int(r)) if n > 1 else None for n, r in zip(c["num_nodes"], c["num_replicas"])] for c in cols]
    seen: dict[tuple[int, int], int] = {}
    for cells in cells_of:
        for key in set(cells) - {None}:
            seen[key] = seen.get(key, 0) + 1
    keys = sorted(k for k, count in seen.items() if count >= SHAPE_MIN_JOBS)
    if not keys:
        return None
    index = {k: i for i, k in enumerate(keys)}
    cell_of = [np.array([index.get(key, -1) if key else -1 for key in cells]) for cells in cells_of]
    counts = [max(int(np.sum(cells >= 0)), 1) for cells in cell_of]
    mean_count = float(np.mean(counts))
    log_phi = np.zeros(len(keys))
    fits: list[ThroughputParams | None] = [None] * len(groups)
    for _ in range(max(int(rounds), 1)):
        shape = SyncShape(dict(zip(keys, np.exp(log_phi))))
        # the prior's pull, then each job's observations: a Gauss–Newton step in log φ with each
        # job's θ held (given θ the cells are independent, so the step is per cell)
        grad = log_phi / SHAPE_LOG_STD**2
        hess = np.full(len(keys), 1.0 / SHAPE_LOG_STD**2)
        for j, (group, c, cells) in enumerate(zip(groups, cols, cell_of)):
            fits[j] = fit_throughput(group, sync_shape=shape, initial=fits[j])
            resid, slope = _residual_and_slope(fits[j], c, shape)
            rms = max(math.sqrt(float(np.mean(resid**2))), SHAPE_RESID_FLOOR)
            weight = mean_count / counts[j] / rms**2
            mask = cells >= 0
            grad += weight * np.bincount(cells[mask], resid[mask] * slope[mask], minlength=len(keys))
            hess += weight * np.bincount(cells[mask], slope[mask] ** 2, minlength=len(keys))
        log_phi = np.clip(log_phi - grad / hess, math.log(_FACTOR_RANGE[0]), math.log(_FACTOR_RANGE[1]))
    return SyncShape(dict(zip(keys, np.exp(log_phi).tolist())), jobs=len(groups))


def _residual_and_slope(params: ThroughputParams, cols: Mapping[str, np.ndarray], shape: SyncShape) -> tuple[np.ndarray, np.ndarray]:
    """Log residuals of step time and ∂ log T / ∂ log φ (the share of the step that the sync drives)."""
    theta = params.as_array()
    nodes, replicas, bsz, accum = cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"]
    step = _step_time(theta, nodes, replicas, bsz, accum, shape)
    resid = np.log(step) - np.log(cols["step_time"])
    bumped = _step_time(theta, nodes, replicas, bsz, accum, lambda n, r: shape(n, r) * math.exp(1e-4))
    slope = (np.log(bumped) - np.log(step)) / 1e-4
    return resid, slope
