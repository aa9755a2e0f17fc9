"""From goodput tables to an allocation problem: validation, feasible options, Sia's costs.

:func:`prepare` validates what a caller hands :func:`goodput.allocate`
(tables, cluster, current allocations, job specs) and flattens every job's
table into row arrays, marking which rows are *allowed*: positive goodput, a
GPU type the job accepts, a shape the cluster's nodes can hold (at most one
node, or whole nodes), a GPU count its options allow, and no more GPUs than
are free once non-preemptible jobs keep theirs. Jobs left with no allowed row
get a reason; nothing is dropped silently.

:func:`sia_problem` turns the allowed rows into Sia's options (SOSP'23 §3.3):
normalized goodput ``G`` (goodput over the job's smallest positive goodput,
:meth:`goodput.table.GoodputTable.normalized`), times the restart factor ``r``
for every configuration but the job's current one, raised to the fairness
power ``p``: utility ``U = (r·G)^p``. Sia minimises ``Σ U + λ·(#unallocated)``
for ``p < 0`` and maximises ``Σ U − λ·(#unallocated)`` for ``p > 0``; both are
written here as minimising a sum of per-option *costs* ``c = U − λ``
(``p < 0``) or ``c = −(U + λ)`` (``p > 0``) with "no allocation" costing 0,
plus a constant. A configuration whose effective goodput ``r·G`` is 0 (a job
restarted so often that ``r = 0``) is not offered: Sia clips its utility to a
huge value so it is never chosen. Options that can never beat "no allocation" (``c ≥ 0``) and
options dominated by a cheaper one of the same type with fewer GPUs are
pruned; neither can change the optimum.

Everything after the per-table extraction is vectorised over all rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..cluster import Cluster
from ..errors import UnknownGPUTypeError, ValidationError
from ..table import GoodputTable
from .result import JobAllocation
from .spec import DEFAULT_SPEC, JobSpec, coerce_spec

__all__ = ["Prepared", "Problem", "prepare", "sia_problem"]


@dataclass
class Prepared:
    """Validated inputs of one round, with every table's rows flattened (R rows, N jobs, T types)."""

    cluster: Cluster
    gpu_types: list[str]
    gpus_per_node: np.ndarray  # (T,)
    pool_nodes: np.ndarray  # (T,)
    capacity: np.ndarray  # (T,) GPUs per type
    free: np.ndarray  # (T,) GPUs per type once pinned jobs hold theirs
    names: list[str]  # (N,) jobs in table order
    specs: list[JobSpec]  # (N,)
    current: dict[str, JobAllocation]  # running jobs (those with tables)
    pinned: dict[str, JobAllocation]  # non-preemptible running jobs: kept as they are
    starts: np.ndarray  # (N+1,) row range of each job
    row_job: np.ndarray  # (R,)
    row_type: np.ndarray  # (R,) index into gpu_types
    row_nodes: np.ndarray  # (R,)
    row_gpus: np.ndarray  # (R,)
    row_goodput: np.ndarray  # (R,) samples/s × efficiency
    row_norm: np.ndarray  # (R,) normalized goodput (0 where goodput is 0)
    allowed: np.ndarray  # (R,) bool, see the module docstring
    is_current: np.ndarray  # (R,) bool: the row is its job's current configuration
    has_current: np.ndarray  # (N,) bool
    restart: np.ndarray  # (N,) Sia's restart factor
    infeasible: dict[str, str] = field(default_factory=dict)  # job -> why no row is allowed

    @property
    def index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.names)}

    def rows_of(self, job: int) -> slice:
        return slice(int(self.starts[job]), int(self.starts[job + 1]))

    def configuration(self, row: int) -> tuple[str, int, int]:
        return (self.gpu_types[int(self.row_type[row])], int(self.row_nodes[row]), int(self.row_gpus[row]))


@dataclass
class Problem:
    """Sia's choice problem: each job picks at most one option; GPUs per type within ``capacity``.

    Options are sorted by job. The policy objective of a choice is
    ``offset + sign · Σ cost[chosen]``.
    """

    names: list[str]  # (N,) jobs being decided (pinned ones excluded)
    jobs: np.ndarray  # (N,) index of each into Prepared.names
    gpu_types: list[str]
    capacity: np.ndarray  # (T,) float
    opt_job: np.ndarray  # (M,) index into names
    opt_type: np.ndarray  # (M,)
    opt_gpus: np.ndarray  # (M,)
    opt_cost: np.ndarray  # (M,)
    opt_row: np.ndarray  # (M,) index into Prepared rows
    offset: float
    sign: float
    sense: str

    @property
    def num_options(self) -> int:
        return int(self.opt_cost.size)

    def objective(self, total_cost: float) -> float:
        return self.offset + self.sign * total_cost

    def without(self, options: np.ndarray) -> Problem:
        """The same problem with some options (indices) removed."""
        keep = np.ones(self.num_options, dtype=bool)
        keep[options] = False
        return Problem(self.names, self.jobs, self.gpu_types, self.capacity, self.opt_job[keep], self.opt_type[keep],
                       self.opt_gpus[keep], self.opt_cost[keep], self.opt_row[keep], self.offset, self.sign, self.sense)


# ---------------------------------------------------------------------------- validation
# A GoodputTable never changes after construction: its columns are read from
# GoodputTable.column_arrays, computed once per table.

def _table_columns(name: str, table: Any) -> tuple[np.ndarray, ...]:
    if not isinstance(table, GoodputTable):
        raise ValidationError(f"tables[{name}]", type(table).__name__, "expected a GoodputTable")
    if table.job != name:
        raise ValidationError(f"tables[{name}]", table.job, "the key differs from the table's job name")
    arrays = table.column_arrays()
    return (arrays["gpu_type"], arrays["num_nodes"], arrays["num_gpus"], arrays["goodput"].astype(float, copy=False),
            arrays.get("batch_size"), arrays.get("accum_steps"))


def _coerce_current(job: str, value: Any, cluster: Cluster, known_nodes: Mapping[str, frozenset[str]],
                    pools: Mapping[str, Any]) -> JobAllocation:
    if isinstance(value, JobAllocation):
        alloc = value
    else:
        try:
            alloc = JobAllocation.from_dict(value)
        except ValidationError as exc:
            raise ValidationError(f"current[{job}].{exc.field}", exc.value, exc.reason) from None
    pool = pools.get(alloc.gpu_type)
    if pool is None:
        raise UnknownGPUTypeError(alloc.gpu_type, cluster.gpu_types, field=f"current[{job}].gpu_type")
    if alloc.num_gpus > pool.gpus or alloc.num_nodes > pool.nodes:
        raise ValidationError(f"current[{job}]", alloc.configuration, f"larger than the {pool.gpu_type} pool ({pool.nodes}x{pool.gpus_per_node})")
    if alloc.num_gpus > alloc.num_nodes * pool.gpus_per_node:
        raise ValidationError(f"current[{job}]", alloc.configuration,
                              f"{alloc.num_gpus} GPUs do not fit on {alloc.num_nodes} {pool.gpu_type} node(s) "
                              f"of {pool.gpus_per_node} GPUs")
    known = known_nodes[alloc.gpu_type]
    for node, gpus in alloc.placement.items():
        if node not in known:
            raise ValidationError(f"current[{job}].placement", node, f"no such {pool.gpu_type} node (have {pool.node_ids()[0]}…)")
        if gpus > pool.gpus_per_node:
            raise ValidationError(f"current[{job}].placement[{node}]", gpus, f"exceeds {pool.gpus_per_node} GPUs per node")
    return alloc


def prepare(
    tables: Mapping[str, GoodputTable],
    cluster: Cluster,
    current: Mapping[str, Any] | None = None,
    jobs: Mapping[str, Any] | None = None,
) -> Prepared:
    """Validate a round's inputs and flatten the tables (see the module docstring).

    Raises:
        ValidationError: naming the job, for a non-table value, NaN or negative
            goodput, a GPU type the cluster lacks (:class:`UnknownGPUTypeError`),
            a bad spec, a current allocation that does not fit the cluster, or
            non-preemptible allocations beyond a type's capacity.

    Entries of ``current`` for jobs without a table are ignored (finished jobs
    release their GPUs); entries of ``jobs`` without a table are an error
    (likely a misspelt name).
    """
    if not isinstance(cluster, Cluster):
        raise ValidationError("cluster", cluster, "expected a Cluster (e.g. Cluster.parse('t4:6x4,a100:2x8'))")
    if not isinstance(tables, Mapping):
        raise ValidationError("tables", type(tables).__name__, "expected {job: GoodputTable}")
    gpu_types = cluster.gpu_types
    type_index = {t: i for i, t in enumerate(gpu_types)}
    gpn = np.array([p.gpus_per_node for p in cluster.pools], dtype=np.int64)
    pool_nodes = np.array([p.nodes for p in cluster.pools], dtype=np.int64)
    capacity = gpn * pool_nodes

    names = [str(k) for k in tables]
    index = {n: i for i, n in enumerate(names)}
    columns = [_table_columns(name, table) for name, table in tables.items()]
    lengths = np.array([c[0].size for c in columns], dtype=np.int64)
    starts = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    n_jobs = len(names)
    row_job = np.repeat(np.arange(n_jobs, dtype=np.int64), lengths)

    def owner(row: int) -> str:
        return names[int(row_job[row])]

    if columns and starts[-1] > 0:
        type_names = np.concatenate([c[0] for c in columns])
        row_nodes = np.concatenate([c[1] for c in columns]).astype(np.int64)
        row_gpus = np.concatenate([c[2] for c in columns]).astype(np.int64)
        row_goodput = np.concatenate([c[3] for c in columns])
        codes, uniq = pd.factorize(type_names)
        lookup = np.empty(len(uniq), dtype=np.int64)
        for i, name in enumerate(uniq):
            if name not in type_index:
                row = int(np.flatnonzero(codes == i)[0])
                raise UnknownGPUTypeError(name, gpu_types, field=f"{owner(row)}: gpu_type")
            lookup[i] = type_index[name]
        row_type = lookup[codes]
    else:
        row_nodes = row_gpus = row_type = np.zeros(0, dtype=np.int64)
        row_goodput = np.zeros(0)
    bad = ~np.isfinite(row_goodput) | (row_goodput < 0)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValidationError(f"{owner(row)}: goodput", float(row_goodput[row]), "must be a finite number >= 0")

    # ---------------------------------------------------------------- specs and current allocations
    specs_in = jobs or {}
    if not isinstance(specs_in, Mapping):
        raise ValidationError("jobs", type(specs_in).__name__, "expected {job: JobSpec or dict}")
    for key in specs_in:
        if key not in index:
            raise ValidationError(f"jobs[{key}]", specs_in[key], "no goodput table for this job")
    specs = [coerce_spec(name, specs_in[name]) if name in specs_in else DEFAULT_SPEC for name in names]
    allowed_types = np.ones((n_jobs, len(gpu_types)), dtype=bool)
    for i, spec in enumerate(specs):
        if spec.gpu_types is not None:
            for t in spec.gpu_types:
                if t not in type_index:
                    raise UnknownGPUTypeError(t, gpu_types, field=f"jobs[{names[i]}].gpu_types")
            allowed_types[i] = [t in spec.gpu_types for t in gpu_types]
        if not isinstance(spec.granularity, int):  # as with gpu_types: a name the cluster lacks is a typo's
            for t in spec.granularity:
                if t not in type_index:
                    raise UnknownGPUTypeError(t, gpu_types, field=f"jobs[{names[i]}].granularity")

    if current is not None and not isinstance(current, Mapping):
        raise ValidationError("current", type(current).__name__, "expected {job: JobAllocation or None}")
    running: dict[str, JobAllocation] = {}
    known_nodes = {pool.gpu_type: frozenset(pool.node_ids()) for pool in cluster.pools}
    pools = {pool.gpu_type: pool for pool in cluster.pools}
    for job, value in (current or {}).items():
        if job in index and value is not None:
            running[job] = _coerce_current(job, value, cluster, known_nodes, pools)

    pinned: dict[str, JobAllocation] = {}
    used = np.zeros(len(gpu_types), dtype=np.int64)
    for job, alloc in running.items():
        if not specs[index[job]].preemptible:
            t = type_index[alloc.gpu_type]
            used[t] += alloc.num_gpus
            if used[t] > capacity[t]:
                raise ValidationError(
                    f"jobs[{job}].preemptible", False,
                    f"non-preemptible allocations need {used[t]} {alloc.gpu_type} GPUs; the cluster has {capacity[t]}")
            pinned[job] = alloc
    free = capacity - used

    # ---------------------------------------------------------------- per-row feasibility (vectorised)
    min_g = np.ones(n_jobs, dtype=np.int64)
    max_g = np.full(n_jobs, np.iinfo(np.int64).max, dtype=np.int64)
    gran = np.ones((n_jobs, len(gpu_types)), dtype=np.int64)  # GPUs per replica, per job and type
    min_r = np.ones(n_jobs, dtype=np.int64)
    rigid = np.full(n_jobs, -1, dtype=np.int64)
    fixed = np.full(n_jobs, -1, dtype=np.int64)
    for key in specs_in:  # only jobs with a spec differ from the defaults
        i, spec = index[key], specs[index[key]]
        min_g[i], min_r[i] = spec.min_gpus, spec.min_replicas
        gran[i] = [spec.granularity_of(t) for t in gpu_types]
        if spec.max_gpus is not None:
            max_g[i] = spec.max_gpus
        if spec.rigid_gpus is not None:
            rigid[i] = spec.rigid_gpus
        if spec.fixed_batch_size is not None:
            fixed[i] = spec.fixed_batch_size
    _check_fixed_batches(names, specs, columns, starts, fixed)

    j = row_job
    positive = row_goodput > 0
    every = np.ones(row_job.size, dtype=bool)
    type_ok = allowed_types[j, row_type] if row_job.size and not allowed_types.all() else every
    node_gpus = gpn[row_type]
    shape_ok = (((row_nodes == 1) & (row_gpus <= node_gpus)) | (row_gpus == row_nodes * node_gpus)) & (
        row_nodes <= pool_nodes[row_type])
    if (min_g > 1).any() or (max_g < np.iinfo(np.int64).max).any() or (gran > 1).any() or (min_r > 1).any() or (
            rigid >= 0).any() or (fixed >= 0).any():
        row_gran = gran[j, row_type] if row_job.size else np.ones(0, dtype=np.int64)
        count_ok = (row_gpus >= min_g[j]) & (row_gpus <= max_g[j]) & (row_gpus % row_gran == 0)
        count_ok &= row_gpus >= min_r[j] * row_gran
        count_ok &= (rigid[j] < 0) | (row_gpus == rigid[j])
        count_ok &= (fixed[j] < 0) | (row_gpus // row_gran <= fixed[j])
    else:  # no job restricts its GPU count (the usual case): every count is allowed
        count_ok = every
    fits = row_gpus <= free[row_type]
    allowed = positive & type_ok & shape_ok & count_ok & fits

    cur_type = np.full(n_jobs, -1, dtype=np.int64)
    cur_nodes = np.zeros(n_jobs, dtype=np.int64)
    cur_gpus = np.zeros(n_jobs, dtype=np.int64)
    for job, alloc in running.items():
        i = index[job]
        cur_type[i], cur_nodes[i], cur_gpus[i] = type_index[alloc.gpu_type], alloc.num_nodes, alloc.num_gpus
    has_current = cur_type >= 0
    is_current = has_current[j] & (row_type == cur_type[j]) & (row_nodes == cur_nodes[j]) & (row_gpus == cur_gpus[j])
    restart = np.ones(n_jobs)
    with_spec = np.array([index[key] for key in specs_in if has_current[index[key]]], dtype=np.int64)
    if with_spec.size:  # Sia's restart factor (spec.restart_factor), for all running jobs with a spec at once
        age = np.array([specs[i].age for i in with_spec])
        restarts = np.array([specs[i].restarts for i in with_spec], dtype=float)
        cost = np.array([specs[i].restart_cost for i in with_spec])
        with np.errstate(invalid="ignore", divide="ignore"):
            factor = np.maximum(age - restarts * cost, 0.0) / (age + cost)
        restart[with_spec] = np.where((age < cost) | (age + cost == 0.0), 1.0, factor)

    row_norm = np.zeros_like(row_goodput)
    if row_goodput.size:
        masked = np.where(positive, row_goodput, np.inf)
        nonempty = lengths > 0
        minima = np.full(n_jobs, np.inf)
        minima[nonempty] = np.minimum.reduceat(masked, starts[:-1][nonempty])
        row_norm = np.where(positive, row_goodput / minima[j], 0.0)

    prepared = Prepared(
        cluster=cluster, gpu_types=gpu_types, gpus_per_node=gpn, pool_nodes=pool_nodes, capacity=capacity,
        free=free, names=names, specs=specs, current=running, pinned=pinned, starts=starts, row_job=row_job,
        row_type=row_type, row_nodes=row_nodes, row_gpus=row_gpus, row_goodput=row_goodput, row_norm=row_norm,
        allowed=allowed, is_current=is_current, has_current=has_current, restart=restart,
    )
    counts = np.bincount(row_job[allowed], minlength=n_jobs)
    stages = (positive, type_ok, shape_ok, count_ok, fits)
    for i in np.flatnonzero(counts == 0):
        if names[i] not in pinned:
            prepared.infeasible[names[i]] = _why(prepared, int(i), stages)
    return prepared


def _check_fixed_batches(names, specs, columns, starts, fixed) -> None:
    """A strong-scaling job's table must hold goodput at its fixed batch (see :mod:`.spec`)."""
    for i in np.flatnonzero(fixed > 0):
        batch, accum = columns[i][4], columns[i][5]
        if batch is None:
            continue
        gpus = columns[i][2].astype(np.int64)
        goodput = columns[i][3]
        steps = gpus * (1 + (accum.astype(np.int64) if accum is not None else 0))
        m = fixed[i]
        bad = (goodput > 0) & ((batch < m) | (batch >= m + steps))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise ValidationError(
                f"{names[i]}: batch_size[{row}]", int(batch[row]),
                f"a strong-scaling job (fixed_batch_size={m}) needs a table computed at that batch: "
                f"JobModel(..., init_batch_size={m}, max_batch_size={m}).table(cluster)")


def _why(prep: Prepared, i: int, stages: tuple[np.ndarray, ...]) -> str:
    rows = prep.rows_of(i)
    if rows.stop == rows.start:
        return "no feasible configuration: the goodput table is empty"
    spec = prep.specs[i]
    messages = (
        "no configuration with positive goodput (no batch fits)",
        f"no configuration on the allowed GPU types {list(spec.gpu_types or [])}",
        "no configuration fits the cluster's nodes (sub-node on one node, or whole nodes)",
        f"no configuration with an allowed GPU count (rigid={spec.rigid_gpus}, min={spec.min_gpus}, "
        f"max={spec.max_gpus}, granularity={spec.granularity}, min_replicas={spec.min_replicas}, "
        f"fixed_batch_size={spec.fixed_batch_size})",
        "every allowed configuration needs more GPUs than are free (non-preemptible jobs hold the rest)",
    )
    ok = np.ones(rows.stop - rows.start, dtype=bool)
    for stage, message in zip(stages, messages):
        ok &= stage[rows]
        if not ok.any():
            return f"no feasible configuration: {message}"
    return "no feasible configuration"  # pragma: no cover - the stages above cover every mask


# ---------------------------------------------------------------------------- Sia's options
def sia_costs(norm: np.ndarray, factor: np.ndarray, p: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Utility ``U = (factor·norm)^p`` and the cost to minimise (see the module docstring)."""
    effective = norm * factor
    with np.errstate(divide="ignore", over="ignore"):
        utility = np.where(effective > 0, np.power(np.where(effective > 0, effective, 1.0), p), np.inf if p < 0 else 0.0)
    if not np.all(np.isfinite(utility[effective > 0])):  # the costs and their pruning would be meaningless
        raise ValidationError("p", p, "the utilities (normalized goodput)^p overflow a float: use a p of smaller magnitude")
    cost = utility - lam if p < 0 else -(utility + lam)
    return utility, cost


def sia_problem(prep: Prepared, p: float, lam: float) -> Problem:
    """Sia's options and costs for the jobs that are not pinned (see the module docstring)."""
    n_jobs = len(prep.names)
    pinned = np.zeros(n_jobs, dtype=bool)
    index = prep.index
    for job in prep.pinned:
        pinned[index[job]] = True
    decide = np.flatnonzero(~pinned)
    new_index = np.full(n_jobs, -1, dtype=np.int64)
    new_index[decide] = np.arange(decide.size)

    rows = np.flatnonzero(prep.allowed & ~pinned[prep.row_job])
    job = prep.row_job[rows]
    factor = np.where(prep.is_current[rows], 1.0, prep.restart[job])
    effective = prep.row_norm[rows] * factor
    _, cost = sia_costs(prep.row_norm[rows], factor, p, lam)
    keep = (effective > 0) & (cost < 0)
    rows, cost = rows[keep], cost[keep]
    rows, cost = _prune_dominated(rows, cost, prep.row_job[rows], prep.row_type[rows], prep.row_gpus[rows],
                                  len(prep.gpu_types))
    count = float(decide.size)
    if p < 0:
        offset, sign, sense = lam * count, 1.0, "minimize"
    else:
        offset, sign, sense = -lam * count, -1.0, "maximize"
    return Problem(
        names=[prep.names[i] for i in decide], jobs=decide, gpu_types=prep.gpu_types,
        capacity=prep.free.astype(float), opt_job=new_index[prep.row_job[rows]], opt_type=prep.row_type[rows],
        opt_gpus=prep.row_gpus[rows], opt_cost=cost, opt_row=rows, offset=offset, sign=sign, sense=sense,
    )


def _prune_dominated(rows, cost, job, gpu_type, gpus, n_types) -> tuple[np.ndarray, np.ndarray]:
    """Drop options with no lower cost than a same-type option of the job with fewer GPUs.

    Returns the kept rows sorted by (job, type, GPUs). A segmented running
    minimum (each group shifted below the previous one) does it without a
    Python loop; costs closer than ~1e-10 count as equal.
    """
    if rows.size == 0:
        return rows, cost
    group = job * n_types + gpu_type
    key = group * (int(gpus.max()) + 1) + gpus
    if np.any(key[1:] <= key[:-1]):  # tables usually come sorted; sort only if not
        order = np.argsort(key, kind="stable")
        rows, cost, group = rows[order], cost[order], group[order]
    span = float(cost.max() - cost.min()) + 1.0
    value = cost - group * span  # later groups sit lower, so the running minimum restarts at each group
    running = np.minimum.accumulate(value)
    first = np.ones(rows.size, dtype=bool)
    first[1:] = group[1:] != group[:-1]
    previous = np.empty_like(running)
    previous[0] = running[0]
    previous[1:] = running[:-1]
    keep = first | (value < previous - 1e-10 * span)
    return rows[keep], cost[keep]
