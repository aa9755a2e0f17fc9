"""The fast path: Lagrangian relaxation of the few capacity rows, then a greedy repair.

Sia's problem (see :mod:`goodput.allocator.problem`) is a multiple-choice
knapsack with one capacity row per GPU type: minimise ``Σ_i c_i(k_i)`` over
one option ``k_i`` (or none, cost 0) per job, subject to
``Σ_i gpus_i(k_i)·[type_i(k_i) = t] ≤ C_t``. Pricing GPUs of type ``t`` at
``μ_t ≥ 0`` removes the coupling:

    L(μ) = Σ_i min(0, min_k c_ik + μ_{t(k)}·g_ik) − Σ_t μ_t·C_t  ≤  optimum

for every ``μ ≥ 0`` (weak duality), and each job then picks its cheapest
option alone. ``L`` is concave and piecewise linear in only T variables; its
maximum equals the LP relaxation's value (the one-choice rows make the
subproblem's polytope integral), so at most T jobs are split in the LP
optimum and rounding loses little. The prices are found by coordinate
ascent: for each type in turn, bisection on μ_t finds the lowest price at
which that type's demand fits its capacity (demand only falls as μ_t rises;
GPU types are substitutes, so the prices rise monotonically to the clearing
point). The jobs' choices at those prices are then made feasible (cheapest
downgrades per GPU freed while a type is over capacity) and improved
(best-gain upgrades into the GPUs still free). The result reports the best
``L(μ)`` as a proven lower bound, so the duality gap certifies the answer.

Cost: O(N·K) numpy work per price evaluation (N jobs, K options per job and
type), about a thousand evaluations in all (each bisection step touches one
type's options only).

Example::

    sol = solve_lagrangian(problem)        # problem from sia_problem(...)
    sol.choice                             # option index per job, -1 for none
    sol.total, sol.bound                   # Σ cost and a lower bound on its minimum
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .problem import Problem

__all__ = ["Solution", "solve_lagrangian"]


@dataclass
class Solution:
    """A solver's answer in the problem's minimisation form."""

    choice: np.ndarray  # (N,) option index per job, -1 = no allocation
    total: float  # Σ cost of the chosen options
    bound: float | None  # proven lower bound on the minimum of Σ cost
    solver: str
    status: str
    iterations: int
    seconds: float
    prices: np.ndarray | None = None  # μ per GPU type (Lagrangian only)

    @property
    def gap(self) -> float | None:
        if self.bound is None:
            return None
        return max(self.total - self.bound, 0.0) / max(abs(self.total), 1e-9)


class _Dense:
    """Options of one GPU type as an (N, K_t) matrix padded with +inf costs."""

    def __init__(self, problem: Problem, t: int, n_jobs: int) -> None:
        sel = np.flatnonzero(problem.opt_type == t)
        jobs = problem.opt_job[sel]
        counts = np.bincount(jobs, minlength=n_jobs)
        width = int(counts.max()) if sel.size else 0
        starts = np.zeros(n_jobs + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        pos = np.arange(sel.size) - starts[jobs]  # options are sorted by job
        self.cost = np.full((n_jobs, max(width, 1)), np.inf)
        self.gpus = np.zeros((n_jobs, max(width, 1)))
        self.index = np.full((n_jobs, max(width, 1)), -1, dtype=np.int64)
        self.cost[jobs, pos] = problem.opt_cost[sel]
        self.gpus[jobs, pos] = problem.opt_gpus[sel]
        self.index[jobs, pos] = sel
        self.rows = np.arange(n_jobs)
        self.empty = sel.size == 0
        # the price above which no job buys this type at all
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(np.isfinite(self.cost), -self.cost / np.maximum(self.gpus, 1.0), 0.0)
        self.max_price = float(ratio.max()) if sel.size else 0.0

    def best(self, price: float) -> tuple[np.ndarray, np.ndarray]:
        """Each job's cheapest reduced cost on this type and its column."""
        reduced = self.cost + price * self.gpus
        column = np.argmin(reduced, axis=1)
        return reduced[self.rows, column], column


def _choose(dense: list[_Dense], prices: np.ndarray, n_jobs: int):
    """Every job's best option at ``prices``: (value, type, column); type -1 = none (ties go to none)."""
    values = np.zeros(n_jobs)
    types = np.full(n_jobs, -1, dtype=np.int64)
    columns = np.zeros(n_jobs, dtype=np.int64)
    for t, d in enumerate(dense):
        if d.empty:
            continue
        value, column = d.best(prices[t])
        better = value < values
        values = np.where(better, value, values)
        types = np.where(better, t, types)
        columns = np.where(better, column, columns)
    return values, types, columns


def _demand(dense: list[_Dense], types: np.ndarray, columns: np.ndarray, n_types: int) -> np.ndarray:
    demand = np.zeros(n_types)
    for t, d in enumerate(dense):
        on = types == t
        demand[t] = d.gpus[on, columns[on]].sum()
    return demand


def solve_lagrangian(problem: Problem, *, max_sweeps: int = 25, rtol: float = 1e-6, max_exchanges: int = 64,
                     extrapolate: tuple[float, ...] = (1.0, 3.0)) -> Solution:
    """Solve Sia's problem approximately with a certified bound (see the module docstring).

    Args:
        problem: from :func:`goodput.allocator.problem.sia_problem`.
        max_sweeps: passes of coordinate ascent over the GPU types.
        rtol: relative precision of each price's bisection.
        extrapolate: after each sweep, the prices ``μ + f·(μ − μ_before)``
            for each factor f are tried and the best bound kept (speeds
            up the slow, monotone rise of coupled prices).
        max_exchanges: improving two-job exchanges tried after the greedy
            repair (stops early once the gap closes or none improves).
    """
    start = time.perf_counter()
    n_jobs, n_types = len(problem.names), len(problem.gpu_types)
    capacity = problem.capacity.astype(float)
    if problem.num_options == 0 or n_jobs == 0:
        return Solution(np.full(n_jobs, -1, dtype=np.int64), 0.0, 0.0, "lagrangian", "optimal", 0,
                        time.perf_counter() - start, np.zeros(n_types))
    dense = [_Dense(problem, t, n_jobs) for t in range(n_types)]
    prices = np.zeros(n_types)
    evaluations = 0
    best_bound = -np.inf

    def bound_at(values: np.ndarray) -> float:
        return float(values.sum() - prices @ capacity)

    values, types, columns = _choose(dense, prices, n_jobs)
    best_bound = bound_at(values)
    best_prices = prices.copy()
    evaluations += 1
    previous = prices.copy()
    stalled = 0
    for sweep in range(max_sweeps):
        bound_before = best_bound
        if sweep >= 1:
            # prices of substitutes rise together: try extrapolating the last sweep's step
            step = prices - previous
            for factor in extrapolate:
                trial = np.maximum(prices + factor * step, 0.0)
                trial_values = _choose(dense, trial, n_jobs)[0]
                evaluations += 1
                trial_bound = float(trial_values.sum() - trial @ capacity)
                if trial_bound > best_bound:
                    best_bound, best_prices = trial_bound, trial
            prices = best_prices.copy()
        previous = prices.copy()
        for t, d in enumerate(dense):
            if d.empty:
                continue
            # the best value each job gets elsewhere (other types or none) while μ_t moves
            outside = np.zeros(n_jobs)
            for s, other in enumerate(dense):
                if s != t and not other.empty:
                    outside = np.minimum(outside, other.best(prices[s])[0])

            def demand_at(price: float) -> float:
                value, column = d.best(price)
                take = value < outside
                return float(d.gpus[d.rows[take], column[take]].sum())

            evaluations += 1
            if demand_at(0.0) <= capacity[t]:
                new = 0.0
            else:
                low, high = 0.0, d.max_price * (1 + 1e-12) + 1e-12
                old = prices[t]
                if 0.0 < old < high:  # warm start: bracket around the last price
                    evaluations += 1
                    if demand_at(old) <= capacity[t]:
                        high = old
                    else:
                        low = old
                while high - low > rtol * max(high, 1e-12):
                    mid = 0.5 * (low + high)
                    evaluations += 1
                    if demand_at(mid) <= capacity[t]:
                        high = mid
                    else:
                        low = mid
                new = high
            prices[t] = new
            values = _choose(dense, prices, n_jobs)[0]
            evaluations += 1
            value = bound_at(values)
            if value > best_bound:
                best_bound, best_prices = value, prices.copy()
        if best_bound - bound_before <= 1e-12 * max(abs(best_bound), 1.0):
            stalled += 1
            if stalled >= 2:
                break
        else:
            stalled = 0

    prices = best_prices
    values, types, columns = _choose(dense, prices, n_jobs)
    choice = np.where(types >= 0, _flat(dense, types, columns), -1)
    choice = _repair(problem, choice, capacity)
    choice = _improve(problem, choice, capacity)
    total = float(problem.opt_cost[choice[choice >= 0]].sum())
    for _ in range(max_exchanges):
        if total - best_bound <= 1e-12 * max(abs(total), 1.0):
            break
        moved = _exchange(problem, choice, capacity)
        if moved is None:
            break
        choice = _improve(problem, moved, capacity)
        total = float(problem.opt_cost[choice[choice >= 0]].sum())
    bound = min(best_bound, total)
    gap = max(total - bound, 0.0) / max(abs(total), 1e-9)
    status = "optimal" if gap <= 1e-12 else "heuristic"
    return Solution(choice, total, bound, "lagrangian", status, evaluations, time.perf_counter() - start, prices)


def _flat(dense: list[_Dense], types: np.ndarray, columns: np.ndarray) -> np.ndarray:
    out = np.full(types.size, -1, dtype=np.int64)
    for t, d in enumerate(dense):
        on = np.flatnonzero(types == t)
        out[on] = d.index[on, columns[on]]
    return out


def _usage(problem: Problem, choice: np.ndarray) -> np.ndarray:
    chosen = choice[choice >= 0]
    return np.bincount(problem.opt_type[chosen], weights=problem.opt_gpus[chosen], minlength=len(problem.gpu_types))


def _current(problem: Problem, choice: np.ndarray):
    """Per job: cost, type and GPUs of its chosen option (0, -1, 0 for none)."""
    has = choice >= 0
    safe = np.where(has, choice, 0)
    cost = np.where(has, problem.opt_cost[safe], 0.0)
    typ = np.where(has, problem.opt_type[safe], -1)
    gpus = np.where(has, problem.opt_gpus[safe], 0)
    return cost, typ, gpus


def _best_per_job(jobs: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Indices of the smallest key per job, ordered by that key."""
    order = np.lexsort((keys, jobs))
    first = np.ones(order.size, dtype=bool)
    first[1:] = jobs[order][1:] != jobs[order][:-1]
    picked = order[first]
    return picked[np.argsort(keys[picked], kind="stable")]


def _repair(problem: Problem, choice: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """While a type is over capacity, make the moves that cost least per GPU of it freed.

    Each job's cheapest move (another option that fits, or none) is found at
    once; the moves are then applied in order of cost per GPU freed until the
    type fits, skipping those whose target no longer has room.
    """
    choice = choice.copy()
    j, alt_t, alt_g, alt_c = problem.opt_job, problem.opt_type, problem.opt_gpus, problem.opt_cost
    while True:
        used = _usage(problem, choice)
        over = used - capacity
        if np.all(over <= 1e-9):
            return choice
        t = int(np.argmax(over))
        cost, typ, gpus = _current(problem, choice)
        residual = capacity - used
        freed = np.where(alt_t == t, gpus[j] - alt_g, gpus[j])
        fits = (alt_t == t) | (alt_g <= residual[alt_t] + 1e-9)
        sel = np.flatnonzero((typ[j] == t) & (freed > 0) & fits)
        on_t = np.flatnonzero(typ == t)
        # candidates: (job, option or -1 for none, score = cost per GPU freed, GPUs freed)
        cand_job = np.concatenate([j[sel], on_t])
        cand_opt = np.concatenate([sel, np.full(on_t.size, -1)])
        cand_freed = np.concatenate([freed[sel], gpus[on_t]]).astype(float)
        cand_score = np.concatenate([alt_c[sel] - cost[j[sel]], -cost[on_t]]) / np.maximum(cand_freed, 1.0)
        excess = float(over[t])
        for k in _best_per_job(cand_job, cand_score):
            if excess <= 1e-9:
                break
            option = int(cand_opt[k])
            if option >= 0 and alt_t[option] != t:
                if alt_g[option] > residual[alt_t[option]] + 1e-9:
                    continue  # an earlier move took the room; reconsidered next round
                residual[alt_t[option]] -= alt_g[option]
            choice[cand_job[k]] = option
            excess -= cand_freed[k]


def _improve(problem: Problem, choice: np.ndarray, capacity: np.ndarray, max_rounds: int = 64) -> np.ndarray:
    """Apply the changes of largest gain that still fit (one per job per round) until none helps."""
    choice = choice.copy()
    j, alt_t, alt_g, alt_c = problem.opt_job, problem.opt_type, problem.opt_gpus, problem.opt_cost
    for _ in range(max_rounds):
        residual = capacity - _usage(problem, choice)
        cost, typ, gpus = _current(problem, choice)
        same = typ[j] == alt_t
        room = residual[alt_t] + np.where(same, gpus[j], 0)
        gain = alt_c - cost[j]
        sel = np.flatnonzero((alt_g <= room + 1e-9) & (gain < -1e-12))
        if sel.size == 0:
            break
        applied = 0
        for k in _best_per_job(j[sel], gain[sel]):
            option = int(sel[k])
            job = int(j[option])
            t, now_t, now_g = int(alt_t[option]), int(typ[job]), int(gpus[job])
            need = alt_g[option] - (now_g if now_t == t else 0)
            if need > residual[t] + 1e-9:
                continue
            residual[t] -= need
            if now_t >= 0 and now_t != t:
                residual[now_t] += now_g
            choice[job] = option
            applied += 1
        if applied == 0:
            break
    return choice


def _exchange(problem: Problem, choice: np.ndarray, capacity: np.ndarray) -> np.ndarray | None:
    """The best improving pair move, or ``None``: job a takes an option that does not fit
    because type t lacks ``d`` GPUs, and another job b on t frees at least ``d`` of them
    at the least cost (any of its options that fits, or none)."""
    n_types = len(problem.gpu_types)
    cost, typ, gpus = _current(problem, choice)
    residual = capacity - _usage(problem, choice)
    j, alt_t, alt_g, alt_c = problem.opt_job, problem.opt_type, problem.opt_gpus, problem.opt_cost
    width = int(alt_g.max()) + 1
    # what each job b on type t gives up to free f GPUs of t: cheapest alternative per f
    same = alt_t == typ[j]
    freed = np.where(same, gpus[j] - alt_g, gpus[j])
    fits = same | (alt_g <= residual[alt_t] + 1e-9)
    usable = (typ[j] >= 0) & (freed > 0) & fits
    best_move = None
    for t in range(n_types):
        on_t = np.flatnonzero(typ == t)
        if on_t.size == 0:
            continue
        slot = np.full(typ.size, -1, dtype=np.int64)
        slot[on_t] = np.arange(on_t.size)
        price = np.full((on_t.size, width + 1), np.inf)
        which = np.full((on_t.size, width + 1), -2, dtype=np.int64)  # option index, -1 = drop the job
        # dropping the job frees all its GPUs of t
        price[np.arange(on_t.size), gpus[on_t]] = -cost[on_t]
        which[np.arange(on_t.size), gpus[on_t]] = -1
        sel = np.flatnonzero(usable & (typ[j] == t))
        if sel.size:
            rows, cols, delta = slot[j[sel]], freed[sel], alt_c[sel] - cost[j[sel]]
            order = np.argsort(-delta)  # later writes win: keep the cheapest per (row, freed)
            better = delta[order] < price[rows[order], cols[order]]
            pick = order[better]
            price[rows[pick], cols[pick]] = delta[pick]
            which[rows[pick], cols[pick]] = sel[pick]
        # at least x freed: suffix minimum over x
        for x in range(width - 1, 0, -1):
            take = price[:, x + 1] < price[:, x]
            price[take, x] = price[take, x + 1]
            which[take, x] = which[take, x + 1]
        # upgrades of some job a onto t that lack d GPUs of t
        room = residual[t] + np.where(typ[j] == t, gpus[j], 0)
        deficit = np.ceil(alt_g - room - 1e-9).astype(np.int64)
        gain = alt_c - cost[j]
        cand = np.flatnonzero((alt_t == t) & (deficit > 0) & (deficit <= width) & (gain < 0))
        if cand.size == 0:
            continue
        d = np.minimum(deficit[cand], width)
        # the cheapest freer per deficit, and the runner-up in case it is job a itself
        first = np.argmin(price, axis=0)
        masked = price.copy()
        masked[first, np.arange(width + 1)] = np.inf
        second = np.argmin(masked, axis=0)
        b = np.where(on_t[first[d]] == j[cand], second[d], first[d])
        total = gain[cand] + price[b, d]
        k = int(np.argmin(total))
        if total[k] < -1e-12 and (best_move is None or total[k] < best_move[0]):
            best_move = (float(total[k]), int(cand[k]), int(on_t[b[k]]), int(which[b[k], d[k]]))
    if best_move is None:
        return None
    _, option, other, alt = best_move
    out = choice.copy()
    out[j[option]] = option
    out[other] = alt
    if np.any(_usage(problem, out) > capacity + 1e-9):  # pragma: no cover - guarded by construction
        return None
    return out
