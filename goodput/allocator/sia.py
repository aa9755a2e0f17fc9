"""Sia's policy: the goodput ILP (SOSP'23 §3.3), solved exactly or by the fast path, then placed.

The formulation (Jayaram Subramanya et al., "Sia: Heterogeneity-aware,
goodput-optimized ML-cluster scheduling", SOSP'23, §3.3): binary ``x_ik`` =
job ``i`` runs in configuration ``k``;

    p < 0:  minimise  Σ_ik x_ik·U_ik + λ·Σ_i (1 − Σ_k x_ik)
    p > 0:  maximise  Σ_ik x_ik·U_ik − λ·Σ_i (1 − Σ_k x_ik)
    s.t.    Σ_k x_ik ≤ 1                     (at most one configuration per job)
            Σ_ik x_ik·gpus_k·[type_k = t] ≤ C_t   (GPUs per type)

with ``U_ik = (r_ik·G_ik)^p``: ``G`` the normalized goodput, ``r_ik`` the
restart factor for every configuration other than the job's current one
(:func:`goodput.allocator.spec.restart_factor`), ``λ`` the penalty for
leaving a job without GPUs (Sia's default 1.1: with p < 0 every unpenalised
utility is at most 1 < λ, so any configuration beats none for that job, but
the GPUs may still lower the objective more by growing another job — e.g.
1 → 2 GPUs at near-linear scaling saves 1 − 2^p ≈ 0.29 > λ − 1 = 0.1).
Non-preemptible running jobs are fixed to their allocation before solving
(their GPUs leave ``C_t``); ``p = 0`` is not allowed, as in Sia.

Solvers: ``"milp"`` is :func:`scipy.optimize.milp` (HiGHS branch and bound)
with presolve off by default — on this structure HiGHS's presolve costs more
than it saves (``experiments/bench_allocator.py``, 1024 GPUs, 2560 jobs, 51k
binaries, on a loaded 2-core machine: 0.8–1.0 s without, 2.4–4.1 s with, in
two runs);
``"lagrangian"`` is :mod:`goodput.allocator.lagrangian`; ``"auto"`` first
checks whether every job's cheapest option fits (then that choice is
optimal and no solver runs: an uncontended round), then runs the MILP alone
up to 2,000 binaries (after pruning), and beyond that the fast path, whose
answer is kept when its certified gap is within ``mip_rel_gap`` or the
problem has more than ``exact_limit`` binaries; otherwise its prices fix
every option that cannot be in a better solution (reduced-cost fixing) and
the MILP solves what is left, exact like the full MILP at a fraction of its
size (e.g. 192 of 20,808 binaries at 2048 GPUs × 1024 jobs, p = 0.5). A MILP that
hits its time limit is compared with the fast path and the better answer
kept. If a chosen configuration cannot be placed (fragmentation), it is
excluded and the problem solved again (up to ``placement_retries`` times).
"""

from __future__ import annotations

import time
import warnings

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from ..errors import ValidationError
from ..io import native_stdout_to_stderr
from ..validation import check_float, check_int
from .lagrangian import Solution, fix_by_reduced_costs, solve_lagrangian, unconstrained
from .placement import place
from .problem import Prepared, Problem, sia_problem
from .result import Allocation, JobAllocation, SolverInfo

__all__ = ["solve", "solve_milp", "allocate_sia", "SOLVERS", "DEFAULT_EXACT_LIMIT"]

SOLVERS = ("auto", "milp", "lagrangian")
#: binaries (after pruning) up to which ``solver="auto"`` makes the fast path's answer exact with the MILP
DEFAULT_EXACT_LIMIT = 20_000
#: binaries up to which ``solver="auto"`` runs the MILP directly (it beats the fast path there)
MILP_FIRST = 2_000


def solve_milp(problem: Problem, *, time_limit: float = 10.0, mip_rel_gap: float = 1e-6,
               presolve: bool = False) -> Solution | None:
    """The exact MILP with HiGHS; ``None`` if it found no solution within the limit."""
    start = time.perf_counter()
    n_jobs, n_types, m = len(problem.names), len(problem.gpu_types), problem.num_options
    if m == 0:
        return Solution(np.full(n_jobs, -1, dtype=np.int64), 0.0, 0.0, "milp", "optimal", 0,
                        time.perf_counter() - start)
    # column k has two entries: 1 in its job's row (one option per job) and its GPUs in its type's row (capacity);
    # built as CSC directly, the form HiGHS takes
    rows = np.stack([problem.opt_job, n_jobs + problem.opt_type], axis=1).ravel()
    values = np.stack([np.ones(m), problem.opt_gpus.astype(float)], axis=1).ravel()
    matrix = sparse.csc_array((values, rows, np.arange(0, 2 * m + 1, 2)), shape=(n_jobs + n_types, m))
    constraints = LinearConstraint(matrix, -np.inf, np.concatenate([np.ones(n_jobs), problem.capacity]))
    # HiGHS's feasibility-jump heuristic looks for a first feasible point, which this problem always has
    # (nothing allocated): on the simulator's small rounds it took two thirds of the solve. scipy passes the
    # option through verbatim and warns that it does not know it.
    options = {"presolve": presolve, "time_limit": time_limit, "mip_rel_gap": mip_rel_gap,
               "mip_heuristic_run_feasibility_jump": False}
    with native_stdout_to_stderr(), warnings.catch_warnings():  # HiGHS may print a debug line to stdout
        warnings.filterwarnings("ignore", message="Unrecognized options", category=RuntimeWarning)
        result = milp(problem.opt_cost, constraints=constraints, integrality=np.ones(m), bounds=Bounds(0, 1),
                      options=options)
    seconds = time.perf_counter() - start
    if result.x is None:
        return None
    chosen = np.flatnonzero(result.x > 0.5)
    choice = np.full(n_jobs, -1, dtype=np.int64)
    choice[problem.opt_job[chosen]] = chosen
    total = float(problem.opt_cost[chosen].sum())
    bound = getattr(result, "mip_dual_bound", None)
    bound = float(min(bound, total)) if bound is not None and np.isfinite(bound) else None
    status = "optimal" if result.status == 0 else ("time_limit" if result.status == 1 else f"status {result.status}")
    return Solution(choice, total, bound, "milp", status, int(getattr(result, "mip_node_count", 0) or 0), seconds)


def objective_gap(problem: Problem, solution: Solution) -> float | None:
    """Relative gap of a solution in the policy objective's terms (0: proven optimal)."""
    if solution.bound is None:
        return None
    objective = problem.objective(solution.total)
    return abs(objective - problem.objective(solution.bound)) / max(abs(objective), 1e-9)


def solve(problem: Problem, *, solver: str = "auto", time_limit: float = 10.0, mip_rel_gap: float = 1e-6,
          presolve: bool = False, exact_limit: int = DEFAULT_EXACT_LIMIT,
          milp_first: int = MILP_FIRST, start_prices: np.ndarray | None = None) -> tuple[Solution, list[str]]:
    """Solve with the chosen solver; returns the solution and notes on fallbacks.

    ``"auto"``: when every job's cheapest option fits, that choice (optimal,
    no solver run); else up to ``milp_first`` binaries the MILP alone
    (fastest there); beyond, the fast path first, accepted when its certified
    gap is within ``mip_rel_gap``, else reduced-cost fixing at its prices
    (:func:`~goodput.allocator.lagrangian.fix_by_reduced_costs`) and the MILP
    over the options left, for problems of at most ``exact_limit`` binaries:
    exact, as the full MILP, at a fraction of its cost. ``start_prices``: the fast path's
    starting prices per type (the last round's).
    """
    notes: list[str] = []
    fast = None
    if solver == "lagrangian":
        return solve_lagrangian(problem, start_prices=start_prices), notes
    if solver == "auto":
        free = unconstrained(problem)
        if free is not None:
            return free, notes
        if problem.num_options > milp_first:
            fast = solve_lagrangian(problem, start_prices=start_prices)
            gap = objective_gap(problem, fast)
            if (gap is not None and gap <= mip_rel_gap) or problem.num_options > exact_limit:
                return fast, notes
            return _reduced_milp(problem, fast, gap, time_limit=time_limit, mip_rel_gap=mip_rel_gap,
                                 presolve=presolve, exact_limit=exact_limit)
    exact = solve_milp(problem, time_limit=time_limit, mip_rel_gap=mip_rel_gap, presolve=presolve)
    if exact is not None and exact.status == "optimal":
        return exact, notes
    fast = solve_lagrangian(problem)
    if exact is None:
        notes.append(f"MILP found no solution within {time_limit} s; used the Lagrangian fast path")
        fast.seconds += time_limit
        return fast, notes
    notes.append(f"MILP stopped ({exact.status}) after {exact.seconds:.2f} s; kept the better of it and the fast path")
    best = exact if exact.total <= fast.total else fast
    bounds = [b for b in (exact.bound, fast.bound) if b is not None]
    best.bound = min(max(bounds), best.total) if bounds else None
    best.seconds = exact.seconds + fast.seconds
    return best, notes


def _reduced_milp(problem: Problem, fast: Solution, gap: float | None, *, time_limit: float, mip_rel_gap: float,
                  presolve: bool, exact_limit: int) -> tuple[Solution, list[str]]:
    """The fast path's answer made exact: the MILP over the options reduced-cost fixing leaves (see :func:`solve`)."""
    start = time.perf_counter()
    notes = [f"fast path gap {gap:.2e} > mip_rel_gap" if gap is not None else "fast path without a bound"]
    if fast.prices is None or fast.bound is None:
        return fast, notes
    reduced = fix_by_reduced_costs(problem, fast.prices, fast.total)
    sub = reduced.problem
    found = f"reduced-cost fixing left {sub.num_options} of {problem.num_options} binaries ({len(sub.names)} open jobs)"
    if np.any(sub.capacity < -1e-9):  # the fixed jobs alone overfill a type: nothing beats the fast path's answer
        fast.bound, fast.status = fast.total, "optimal"
        notes.append(found + "; no better solution exists")
        fast.seconds += time.perf_counter() - start
        return fast, notes
    exact = solve_milp(sub, time_limit=time_limit, mip_rel_gap=mip_rel_gap, presolve=presolve)
    seconds = fast.seconds + time.perf_counter() - start
    if exact is None:
        notes.append(found + f"; their MILP found no solution within {time_limit} s; kept the fast path's answer")
        fast.seconds = seconds
        return fast, notes
    choice = reduced.choice.copy()
    chosen = exact.choice >= 0
    choice[reduced.open_jobs[chosen]] = sub.opt_row[exact.choice[chosen]]
    total = reduced.fixed_total + exact.total
    # every solution better than the fast path's lies within the options kept: the bound holds for the full problem
    bound = None if exact.bound is None else min(fast.total, reduced.fixed_total + exact.bound)
    notes.append(found + f"; solved them by MILP ({exact.status})")
    if total > fast.total:  # the MILP stopped early at a worse answer: keep the fast path's
        return Solution(fast.choice, fast.total, bound, "lagrangian+milp", exact.status, exact.iterations, seconds,
                        fast.prices), notes
    return Solution(choice, total, bound, "lagrangian+milp", exact.status, exact.iterations, seconds, fast.prices), notes


def check_power(p: float) -> float:
    """Sia's fairness power ``p``: a finite non-zero number (-0.5 by default)."""
    p = check_float("p", p)
    if p == 0.0:
        raise ValidationError("p", p, "must be non-zero (Sia's fairness power; -0.5 by default)")
    return p


def check_solver_options(solver: str, *, lam: float, time_limit: float, mip_rel_gap: float, presolve: bool,
                         exact_limit: int) -> tuple[float, float, float, bool, int]:
    """The options shared by the goodput MILP policies (``sia``, ``unaware``), validated."""
    if solver not in SOLVERS:
        raise ValidationError("solver", solver, f"expected one of {SOLVERS}")
    if not isinstance(presolve, bool):
        raise ValidationError("presolve", presolve, "expected True or False")
    return (check_float("lam", lam, nonnegative=True), check_float("time_limit", time_limit, positive=True),
            check_float("mip_rel_gap", mip_rel_gap, nonnegative=True), presolve,
            check_int("exact_limit", exact_limit, minimum=0))


def allocate_sia(
    prep: Prepared,
    p: float = -0.5,
    *,
    lam: float = 1.1,
    solver: str = "auto",
    time_limit: float = 10.0,
    mip_rel_gap: float = 1e-6,
    presolve: bool = False,
    exact_limit: int = DEFAULT_EXACT_LIMIT,
    placement_retries: int = 2,
    started: float | None = None,
    start_prices: dict[str, float] | None = None,
) -> Allocation:
    """Sia's policy on validated inputs (see :func:`goodput.allocate` for the options); ``start_prices``:
    the fast path's prices per GPU type to start from (:attr:`SolverInfo.prices` of the last round)."""
    started = time.perf_counter() if started is None else started
    p = check_power(p)
    lam, time_limit, mip_rel_gap, presolve, exact_limit = check_solver_options(
        solver, lam=lam, time_limit=time_limit, mip_rel_gap=mip_rel_gap, presolve=presolve, exact_limit=exact_limit)
    placement_retries = check_int("placement_retries", placement_retries, minimum=0)

    problem = sia_problem(prep, p, lam)
    start = None
    if start_prices:
        start = np.array([float(start_prices.get(t, np.nan)) for t in problem.gpu_types])
        start = start if np.all(np.isfinite(start) & (start >= 0)) else None
    with_options = {problem.names[int(j)] for j in np.unique(problem.opt_job)}  # before retries exclude any
    notes: list[str] = []
    solve_seconds = 0.0
    attempts = 0
    pinned = set(prep.pinned)
    while True:
        attempts += 1
        # the placement retries share the time limit: each solve gets what the ones before left
        solution, more = solve(problem, solver=solver, time_limit=max(time_limit - solve_seconds, 1e-3),
                               mip_rel_gap=mip_rel_gap, presolve=presolve, exact_limit=exact_limit, start_prices=start)
        notes.extend(more)
        solve_seconds += solution.seconds
        if attempts == 1:
            # A retry solves a smaller problem (options excluded), whose bound does not bound the first's
            # optimum: the first solve's bound is the one that holds for every placeable answer.
            first_bound = solution.bound
        assignments = {job: alloc.configuration for job, alloc in prep.pinned.items()}
        option_of: dict[str, int] = {}
        for i in np.flatnonzero(solution.choice >= 0):
            option = int(solution.choice[i])
            option_of[problem.names[i]] = option
            assignments[problem.names[i]] = prep.configuration(int(problem.opt_row[option]))
        placed = place(prep.cluster, assignments, prep.current, pinned)
        retry = [option_of[job] for job in placed.failed if job in option_of]
        if not retry or attempts > placement_retries:
            break
        if solve_seconds >= time_limit:
            notes.append(f"placement failed for {sorted(placed.failed)}; no time left to solve again")
            break
        notes.append(f"placement failed for {sorted(placed.failed)}; excluded those configurations and solved again")
        problem = problem.without(np.array(retry, dtype=np.int64))

    allocations: dict[str, JobAllocation | None] = {}
    unallocated: dict[str, str] = {}
    details: dict[str, dict] = {}
    total = 0.0
    for job in prep.names:
        if job in placed.placements:
            gpu_type, nodes, gpus = assignments[job]
            allocations[job] = JobAllocation._checked(gpu_type, nodes, gpus, placed.placements[job])
            old = prep.current.get(job)
            detail = {"changed": old is None or old.configuration != (gpu_type, nodes, gpus),
                      "moved": job in placed.moved, "pinned": job in pinned}
            if job in option_of:
                row = int(problem.opt_row[option_of[job]])
                total += float(problem.opt_cost[option_of[job]])
                detail.update(goodput=float(prep.row_goodput[row]), normalized_goodput=float(prep.row_norm[row]))
            details[job] = detail
        else:
            allocations[job] = None
            if job in placed.failed:
                unallocated[job] = f"placement failed: {placed.failed[job]}"
            elif job in prep.infeasible:
                unallocated[job] = prep.infeasible[job]
            elif job not in with_options:
                unallocated[job] = ("no configuration worth running: its goodput times the restart factor gives "
                                    "no utility above the penalty λ for waiting")
            else:
                unallocated[job] = "not selected: the optimum gives the GPUs to other jobs"
    objective = problem.objective(total)
    bound = problem.objective(first_bound) if first_bound is not None else None
    if bound is not None and not placed.failed:
        gap = abs(objective - bound) / max(abs(objective), 1e-9)
    else:
        gap = None
        if placed.failed:
            notes.append("a placement failure left jobs unallocated; the bound no longer applies")
    status = solution.status if not placed.failed else "placement_failed"
    if status == "optimal" and attempts > 1 and (gap is None or gap > 1e-9):
        status = "heuristic"  # the exclusions may have dropped an option that a placeable optimum uses
    info = SolverInfo(
        policy="sia", solver=solution.solver, status=status, objective=objective, bound=bound, gap=gap,
        sense=problem.sense, wall_time=time.perf_counter() - started, solve_time=solve_seconds,
        num_jobs=len(prep.names), num_variables=problem.num_options, attempts=attempts, notes=tuple(notes),
        prices=None if solution.prices is None else {t: float(v) for t, v in zip(problem.gpu_types, solution.prices)},
    )
    return Allocation(allocations, unallocated, info, details)
