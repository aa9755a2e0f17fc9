"""The policies Sia is compared with, behind the same :func:`goodput.allocate` call.

``"gavel"`` / ``"gavel-throughput"`` — Gavel (Narayanan et al., OSDI'20,
§3–4): each job asks for its requested GPU count (``JobSpec.requested_gpus``;
on a type whose configuration set lacks that count, the next larger
configuration); ``X_jt`` is the fraction of time job j should run on type t,
with ``Σ_t X_jt ≤ 1`` and ``Σ_j X_jt·gpus_jt ≤ C_t``. Effective throughput is
``Σ_t X_jt·thr_jt`` with ``thr`` the table's goodput at the requested count,
normalised by the throughput the job would get from a capacity-proportional
share of every type (Gavel's normalisation by the proportional allocation,
``x_t = C_t / C``). Max-min fairness maximises the smallest normalised
effective throughput (then, among those optima, their sum: one water-filling
step); max-sum-throughput maximises the sum. Both are LPs solved with
:func:`scipy.optimize.linprog` (HiGHS). One round then rounds ``X`` to whole
GPUs the way Gavel's round-based mechanism does: (job, type) pairs in order of
priority ``X_jt / share received so far`` (``JobSpec.attained / age``; new
jobs first), each job placed once while its type has room; pairs with
``X_jt = 0`` come last, so free GPUs are not left idle.

``"unaware"`` — a heterogeneity-unaware goodput policy in Pollux's manner
(Qiao et al., OSDI'21): the job's goodput at each GPU count is the mean of its
normalized goodput over the GPU types (it cannot tell them apart), Sia's
objective is solved over GPU counts with all types pooled into one capacity,
and each job is then put on its current type if its count stays, else on the
type with the most free GPUs that has a configuration of that count (a smaller
count if none has room).

``"fifo"`` — first in, first out with the requested GPUs: running jobs keep
their GPUs (no preemption); waiting jobs in arrival order take the first GPU
type (cluster order) with room for their request; without ``backfill`` a job
that does not fit blocks the jobs behind it.
"""

from __future__ import annotations

import time

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

from ..errors import ValidationError
from .placement import place
from .problem import Prepared, Problem, _prune_dominated, sia_costs
from .result import Allocation, JobAllocation, SolverInfo
from .sia import DEFAULT_EXACT_LIMIT, check_power, check_solver_options, objective_gap, solve

__all__ = ["allocate_gavel", "allocate_unaware", "allocate_fifo", "requested_rows"]


# ---------------------------------------------------------------------------- shared
def _finish(prep: Prepared, assignments: dict[str, tuple[str, int, int]], reasons: dict[str, str],
            info: dict, started: float, rows: dict[str, int] | None = None) -> Allocation:
    """Place the assignments and build the Allocation (failed placements become reasons)."""
    for job, alloc in prep.pinned.items():
        assignments[job] = alloc.configuration
    placed = place(prep.cluster, assignments, prep.current, set(prep.pinned))
    allocations: dict[str, JobAllocation | None] = {}
    unallocated: dict[str, str] = {}
    details: dict[str, dict] = {}
    for job in prep.names:
        if job in placed.placements:
            config = assignments[job]
            allocations[job] = JobAllocation._checked(*config, placed.placements[job])
            old = prep.current.get(job)
            detail = {"changed": old is None or old.configuration != config, "moved": job in placed.moved,
                      "pinned": job in prep.pinned}
            if rows and job in rows:
                detail.update(goodput=float(prep.row_goodput[rows[job]]), normalized_goodput=float(prep.row_norm[rows[job]]))
            details[job] = detail
        else:
            allocations[job] = None
            if job in placed.failed:
                unallocated[job] = f"placement failed: {placed.failed[job]}"
            else:
                unallocated[job] = reasons.get(job) or prep.infeasible.get(job) or "not selected"
    notes = tuple(info.pop("notes", ()))
    solver_info = SolverInfo(wall_time=time.perf_counter() - started, num_jobs=len(prep.names), notes=notes, **info)
    return Allocation(allocations, unallocated, solver_info, details)


def requested_rows(prep: Prepared, i: int) -> tuple[int, dict[int, int]]:
    """The requested GPU count of job ``i`` and, per GPU type, the allowed row that serves it.

    The request is ``requested_gpus``, else ``rigid_gpus``, else the smallest
    allowed count; on each type the row is the allowed configuration with the
    fewest GPUs not below the request.
    """
    spec = prep.specs[i]
    rows = np.arange(prep.starts[i], prep.starts[i + 1])
    rows = rows[prep.allowed[rows]]
    if rows.size == 0:
        return (spec.requested_gpus or spec.rigid_gpus or spec.min_gpus), {}
    gpus = prep.row_gpus[rows]
    request = spec.requested_gpus or spec.rigid_gpus or int(gpus.min())
    out: dict[int, int] = {}
    for t in np.unique(prep.row_type[rows]):
        on = rows[(prep.row_type[rows] == t) & (gpus >= request)]
        if on.size:
            out[int(t)] = int(on[np.lexsort((prep.row_nodes[on], prep.row_gpus[on]))[0]])
    return request, out


# ---------------------------------------------------------------------------- Gavel
def allocate_gavel(prep: Prepared, *, objective: str = "max_min", started: float | None = None) -> Allocation:
    """Gavel's max-min fairness (``"max_min"``) or max-sum-throughput (``"max_sum"``); see the module docstring."""
    started = time.perf_counter() if started is None else started
    policy = "gavel" if objective == "max_min" else "gavel-throughput"
    reasons: dict[str, str] = {}
    pair_job, pair_type, pair_row = [], [], []
    decide = [i for i, name in enumerate(prep.names) if name not in prep.pinned]
    for i in decide:
        request, by_type = requested_rows(prep, i)
        if not by_type:
            reasons[prep.names[i]] = prep.infeasible.get(prep.names[i]) or f"no allowed configuration with >= {request} GPUs"
        for t, row in by_type.items():
            pair_job.append(i)
            pair_type.append(t)
            pair_row.append(row)
    if not pair_job:
        return _finish(prep, {}, reasons, {"policy": policy, "solver": "none", "status": "optimal",
                                           "sense": "maximize"}, started)
    pj, pt, pr = np.array(pair_job), np.array(pair_type), np.array(pair_row)
    thr = prep.row_goodput[pr]
    gpus = prep.row_gpus[pr].astype(float)
    jobs, local = np.unique(pj, return_inverse=True)
    share = prep.capacity / prep.capacity.sum()
    norm = np.bincount(local, weights=thr * share[pt], minlength=jobs.size)
    weight = thr / norm[local]  # normalised throughput per unit of time fraction
    n_pairs, n_jobs, n_types = pj.size, jobs.size, len(prep.gpu_types)
    cols = np.arange(n_pairs)
    one_each = sparse.csr_array((np.ones(n_pairs), (local, cols)), shape=(n_jobs, n_pairs))
    capacity = sparse.csr_array((gpus, (pt, cols)), shape=(n_types, n_pairs))
    throughput = sparse.csr_array((weight, (local, cols)), shape=(n_jobs, n_pairs))
    solve_start = time.perf_counter()
    if objective == "max_min":
        # variables [X, z]: maximise z subject to z <= normalised throughput of every job
        a_ub = sparse.vstack([
            sparse.hstack([-throughput, sparse.csr_array(np.ones((n_jobs, 1)))]),
            sparse.hstack([one_each, sparse.csr_array((n_jobs, 1))]),
            sparse.hstack([capacity, sparse.csr_array((n_types, 1))]),
        ]).tocsr()
        b_ub = np.concatenate([np.zeros(n_jobs), np.ones(n_jobs), prep.free.astype(float)])
        first = linprog(np.r_[np.zeros(n_pairs), -1.0], A_ub=a_ub, b_ub=b_ub,
                        bounds=[(0, 1)] * n_pairs + [(0, None)], method="highs")
        _check_lp(first, policy)
        level = float(first.x[-1])
        # among max-min optimal allocations, the largest total (one water-filling step)
        a2 = sparse.vstack([-throughput, one_each, capacity]).tocsr()
        b2 = np.concatenate([-np.full(n_jobs, level * (1 - 1e-7)), np.ones(n_jobs), prep.free.astype(float)])
        second = linprog(-weight, A_ub=a2, b_ub=b2, bounds=[(0, 1)] * n_pairs, method="highs")
        x = second.x if second.status == 0 else first.x[:-1]
        value = level
    else:
        a_ub = sparse.vstack([one_each, capacity]).tocsr()
        b_ub = np.concatenate([np.ones(n_jobs), prep.free.astype(float)])
        lp = linprog(-weight, A_ub=a_ub, b_ub=b_ub, bounds=[(0, 1)] * n_pairs, method="highs")
        _check_lp(lp, policy)
        x = lp.x
        value = float(-lp.fun)
    solve_seconds = time.perf_counter() - solve_start

    # round: Gavel's priorities X / share received, new jobs first; X = 0 pairs last
    received = np.array([prep.specs[i].received_share for i in pj])
    fraction = np.clip(x, 0.0, 1.0)
    priority = np.where(fraction > 1e-9, fraction / np.maximum(received, 1e-9), 0.0)
    current_type = np.array([_current_type(prep, i) == t for i, t in zip(pj, pt)])
    order = np.lexsort((np.array([prep.names[i] for i in pj]), ~current_type, -fraction, -priority))
    free = prep.free.astype(float).copy()
    assignments: dict[str, tuple[str, int, int]] = {}
    rows: dict[str, int] = {}
    for p in order:
        name = prep.names[pj[p]]
        if name in assignments or gpus[p] > free[pt[p]]:
            continue
        free[pt[p]] -= gpus[p]
        assignments[name] = prep.configuration(int(pr[p]))
        rows[name] = int(pr[p])
    for i in jobs:
        name = prep.names[i]
        if name not in assignments:
            reasons.setdefault(name, "not selected this round: its types are full (Gavel's time share goes to others)")
    info = {"policy": policy, "solver": "linprog", "status": "lp+rounding", "objective": value, "sense": "maximize",
            "solve_time": solve_seconds, "num_variables": int(n_pairs),
            "notes": ("objective: the LP's value over time fractions, before rounding to whole GPUs",)}
    return _finish(prep, assignments, reasons, info, started, rows)


def _check_lp(result, policy: str) -> None:
    if result.status != 0:  # pragma: no cover - the LPs are always feasible (X = 0) and bounded
        raise RuntimeError(f"{policy}: linprog failed: {result.message}")


def _current_type(prep: Prepared, i: int) -> int:
    alloc = prep.current.get(prep.names[i])
    return prep.gpu_types.index(alloc.gpu_type) if alloc is not None else -1


# ---------------------------------------------------------------------------- unaware
def allocate_unaware(
    prep: Prepared,
    p: float = -0.5,
    *,
    lam: float = 1.1,
    solver: str = "auto",
    time_limit: float = 10.0,
    mip_rel_gap: float = 1e-6,
    presolve: bool = False,
    exact_limit: int = DEFAULT_EXACT_LIMIT,
    started: float | None = None,
) -> Allocation:
    """Heterogeneity-unaware goodput allocation (see the module docstring)."""
    started = time.perf_counter() if started is None else started
    p = check_power(p)
    lam, time_limit, mip_rel_gap, presolve, exact_limit = check_solver_options(
        solver, lam=lam, time_limit=time_limit, mip_rel_gap=mip_rel_gap, presolve=presolve, exact_limit=exact_limit)
    names = prep.names
    pinned = np.array([name in prep.pinned for name in names], dtype=bool)
    rows = np.flatnonzero(prep.allowed & ~pinned[prep.row_job])
    job, gpus = prep.row_job[rows], prep.row_gpus[rows]
    span = int(gpus.max()) + 1 if gpus.size else 1
    keys, inverse = np.unique(job * span + gpus, return_inverse=True)
    inverse = inverse.ravel()
    mean_norm = np.bincount(inverse, weights=prep.row_norm[rows]) / np.bincount(inverse)
    key_job, key_gpus = keys // span, keys % span
    cur_gpus = np.array([prep.current[n].num_gpus if n in prep.current else 0 for n in names])
    factor = np.where((cur_gpus[key_job] == key_gpus) | ~prep.has_current[key_job], 1.0, prep.restart[key_job])
    _, cost = sia_costs(mean_norm, factor, p, lam)
    keep = (mean_norm * factor > 0) & (cost < 0)  # as Sia: a configuration worth nothing is no option
    opt_rows, cost = _prune_dominated(np.flatnonzero(keep), cost[keep], key_job[keep], np.zeros(int(keep.sum()), np.int64),
                                      key_gpus[keep], 1)
    decide = np.flatnonzero(~pinned)
    new_index = np.full(len(names), -1, dtype=np.int64)
    new_index[decide] = np.arange(decide.size)
    count = float(decide.size)
    problem = Problem(
        names=[names[i] for i in decide], jobs=decide, gpu_types=["pooled"],
        capacity=np.array([float(prep.free.sum())]), opt_job=new_index[key_job[opt_rows]],
        opt_type=np.zeros(opt_rows.size, dtype=np.int64), opt_gpus=key_gpus[opt_rows], opt_cost=cost, opt_row=opt_rows,
        offset=lam * count if p < 0 else -lam * count, sign=1.0 if p < 0 else -1.0,
        sense="minimize" if p < 0 else "maximize",
    )
    solution, notes = solve(problem, solver=solver, time_limit=time_limit, mip_rel_gap=mip_rel_gap,
                            presolve=presolve, exact_limit=exact_limit)

    # assign pooled GPU counts to real types
    free = prep.free.astype(np.int64).copy()
    wanted = {problem.names[i]: int(problem.opt_gpus[solution.choice[i]]) for i in np.flatnonzero(solution.choice >= 0)}
    options = {}  # job -> {gpus: {type: row}}
    for r in rows:
        options.setdefault(names[prep.row_job[r]], {}).setdefault(int(prep.row_gpus[r]), {})[int(prep.row_type[r])] = int(r)

    def unchanged(name: str) -> bool:
        alloc = prep.current.get(name)
        return alloc is not None and alloc.num_gpus == wanted[name]

    assignments: dict[str, tuple[str, int, int]] = {}
    chosen_rows: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for name in sorted(wanted, key=lambda n: (not unchanged(n), -wanted[n], n)):
        counts = sorted((g for g in options[name] if g <= wanted[name]), reverse=True)
        placed = False
        for g in counts:
            by_type = options[name][g]
            current = prep.current.get(name)
            fits = [t for t in by_type if free[t] >= g]
            if not fits:
                continue
            if current is not None and prep.gpu_types.index(current.gpu_type) in fits and current.num_gpus == g:
                t = prep.gpu_types.index(current.gpu_type)
            else:
                t = max(fits, key=lambda s: (free[s], -s))
            free[t] -= g
            assignments[name] = prep.configuration(by_type[t])
            chosen_rows[name] = by_type[t]
            placed = True
            break
        if not placed:
            reasons[name] = f"GPU types pooled: no single type has {wanted[name]} GPUs free"
    for name in problem.names:
        if name not in wanted:
            reasons.setdefault(name, prep.infeasible.get(name) or "not selected: the optimum gives the GPUs to other jobs")
    info = {"policy": "unaware", "solver": solution.solver, "status": solution.status,
            "objective": problem.objective(solution.total),
            "bound": problem.objective(solution.bound) if solution.bound is not None else None,
            "gap": objective_gap(problem, solution), "sense": problem.sense, "solve_time": solution.seconds,
            "num_variables": problem.num_options,
            "notes": tuple(notes) + ("objective and bound: of the pooled problem, before the GPU-type assignment",)}
    return _finish(prep, assignments, reasons, info, started, chosen_rows)


# ---------------------------------------------------------------------------- FIFO
def allocate_fifo(prep: Prepared, *, backfill: bool = False, started: float | None = None) -> Allocation:
    """First in, first out with the requested GPUs (see the module docstring)."""
    started = time.perf_counter() if started is None else started
    if not isinstance(backfill, bool):
        raise ValidationError("backfill", backfill, "expected True or False")
    free = prep.free.astype(np.int64).copy()
    assignments: dict[str, tuple[str, int, int]] = {}
    reasons: dict[str, str] = {}
    index = prep.index
    order = sorted(range(len(prep.names)), key=lambda i: (prep.specs[i].order_key, prep.names[i]))
    # running jobs keep their GPUs, in arrival order while capacity lasts
    for i in order:
        name = prep.names[i]
        alloc = prep.current.get(name)
        if alloc is None or name in prep.pinned:
            continue
        t = prep.gpu_types.index(alloc.gpu_type)
        if free[t] >= alloc.num_gpus:
            free[t] -= alloc.num_gpus
            assignments[name] = alloc.configuration
    blocked_by = None
    for i in order:
        name = prep.names[i]
        if name in assignments or name in prep.pinned:
            continue
        if blocked_by is not None:
            reasons[name] = f"waiting: behind {blocked_by} in the FIFO queue"
            continue
        request, by_type = requested_rows(prep, index[name])
        fits = [t for t in sorted(by_type) if prep.row_gpus[by_type[t]] <= free[t]]
        if fits:
            t = fits[0]
            free[t] -= prep.row_gpus[by_type[t]]
            assignments[name] = prep.configuration(by_type[t])
            continue
        reasons[name] = prep.infeasible.get(name) or f"waiting: {request} GPUs of an allowed type are not free"
        if not backfill and by_type:
            blocked_by = name
    info = {"policy": "fifo", "solver": "greedy", "status": "rule-based", "sense": "maximize",
            "num_variables": 0, "notes": () if not blocked_by else (f"queue blocked at {blocked_by}",)}
    return _finish(prep, assignments, reasons, info, started)
