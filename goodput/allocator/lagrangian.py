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
optimum and rounding loses little when jobs are many and each is small
against a type's capacity. With few jobs it can lose much (4 jobs on 7
GPUs: 43% below the optimum, one job left waiting), which the reported
bound and gap show; ``solver="auto"`` then solves the MILP (up to
``exact_limit`` options).

The prices come from two steps. First a smoothed dual: replacing each job's
``min`` (over its options and "none") by the soft minimum
``−τ·log Σ exp(−reduced cost/τ)`` makes ``L`` smooth and strictly concave in
μ, with a gradient (expected GPUs bought − capacity) and a T×T Hessian that
cost O(M) numpy work; projected Newton steps with a backtracking line search
maximise it for τ shrinking fourfold over eleven stages from 10% of the cost
scale, a few steps each, each stage warm-started from the last (a
path-following scheme on the entropy-smoothed dual; Nesterov, "Smooth
minimization of non-smooth functions", Math. Programming 103, 2005).
Its maximiser tends to a maximiser of ``L`` as τ → 0; the exact ``L`` is
evaluated at each stage's prices and the best kept. Then coordinate ascent
polishes them: for each type in turn, bisection on μ_t finds the lowest price
at which that type's demand fits its capacity (demand only falls as μ_t
rises). Coordinate ascent alone stalls at the kinks where jobs are
indifferent between types (its prices crept within 0.3% of the optimum in 25
sweeps at 2048 GPUs × 1024 jobs); the smoothed Newton steps reach the LP
optimum's value in about 60 cheap evaluations. The jobs' choices at the best
prices are then made feasible (cheapest downgrades per GPU freed while a type
is over capacity) and improved (best-gain upgrades into the GPUs still free,
then improving two-job exchanges). The result reports the best ``L(μ)`` as a
proven lower bound, so the duality gap certifies the answer; when every job's
cheapest option fits (``μ = 0``) the answer is optimal at once.

Cost: O(M) numpy work per smoothed evaluation (M options), a few dozen of
them, then O(N·K) per price evaluation of the polish (N jobs, K options per
job and type).

Example::

    sol = solve_lagrangian(problem)        # problem from sia_problem(...)
    sol.choice                             # option index per job, -1 for none
    sol.total, sol.bound                   # Σ cost and a lower bound on its minimum
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .problem import Problem

__all__ = ["Reduced", "Solution", "fix_by_reduced_costs", "solve_lagrangian", "unconstrained"]


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


def _smoothed_prices(problem: Problem, capacity: np.ndarray, caps: np.ndarray, *, start: np.ndarray | None = None,
                     first_tau: float = 0.1, stages: int = 11, shrink: float = 4.0,
                     newton_steps: int = 4) -> tuple[np.ndarray, float, int]:
    """Prices maximising the entropy-smoothed dual for τ shrinking by ``shrink`` over ``stages`` stages, from ``start`` (0).

    Returns the prices with the best *exact* ``L`` seen, that ``L``, and the
    number of evaluations (each O(M)). Options must be sorted by job (they are).
    """
    cost = problem.opt_cost
    gpus = problem.opt_gpus.astype(float)
    typ = problem.opt_type
    new_job = np.ones(cost.size, dtype=bool)
    new_job[1:] = problem.opt_job[1:] != problem.opt_job[:-1]
    first = np.flatnonzero(new_job)  # each job's first option
    segment = np.cumsum(new_job) - 1  # per option: its job's position among jobs with options
    n_types = capacity.size
    cell = segment * n_types + typ
    cells = first.size * n_types
    scale = float(np.max(np.abs(cost)))

    def evaluate(mu: np.ndarray, tau: float, derivatives: bool = True):
        reduced = cost + mu[typ] * gpus
        hard = np.minimum(np.minimum.reduceat(reduced, first), 0.0)  # each job's best value ("none" costs 0)
        weight = np.exp((hard[segment] - reduced) / tau)  # ≤ 1: no overflow
        z = np.add.reduceat(weight, first) + np.exp(hard / tau)  # the "none" option's weight
        exact = float(hard.sum() - mu @ capacity)
        smooth = float((hard - tau * np.log(z)).sum() - mu @ capacity)
        if not derivatives:
            return smooth, exact, None, None
        share = weight * gpus / z[segment]  # expected GPUs of each option
        per = np.bincount(cell, weights=share, minlength=cells).reshape(first.size, n_types)
        grad = per.sum(axis=0) - capacity
        # Hessian: −(1/τ)·Σ_i covariance of the job's GPUs per type under its soft choice
        hess = (per.T @ per - np.diag(np.bincount(typ, weights=share * gpus, minlength=n_types))) / tau
        return smooth, exact, grad, hess

    mu = np.zeros(n_types) if start is None else np.clip(np.asarray(start, dtype=float), 0.0, caps)
    best_mu, best = mu.copy(), -np.inf
    evaluations = 0
    tau = first_tau * scale
    value, exact, grad, hess = evaluate(mu, tau)
    evaluations += 1
    for _ in range(stages):
        before = best
        if exact > best:
            best, best_mu = exact, mu.copy()
        for _ in range(newton_steps):
            free = (mu > 0) | (grad > 0)  # a type at price 0 with spare capacity stays there
            if not free.any():
                break
            h = -hess[np.ix_(free, free)]
            h = h + np.eye(h.shape[0]) * (1e-12 * float(np.trace(h)) + 1e-300)
            direction = np.zeros(n_types)
            try:
                direction[free] = np.linalg.solve(h, grad[free])
            except np.linalg.LinAlgError:
                break
            step, accepted = 1.0, False
            while step > 1e-10:  # backtracking (Armijo); the full step is evaluated with its derivatives
                trial = np.clip(mu + step * direction, 0.0, caps)
                t_value, t_exact, t_grad, t_hess = evaluate(trial, tau, derivatives=step == 1.0)
                evaluations += 1
                if t_exact > best:
                    best, best_mu = t_exact, trial.copy()
                if np.isfinite(t_value) and t_value >= value + 1e-4 * float(grad @ (trial - mu)):
                    accepted = True
                    break
                step *= 0.25
            if not accepted:
                break
            moved = float(np.max(np.abs(trial - mu)))
            mu, value, exact = trial, t_value, t_exact
            if t_grad is None:
                value, exact, grad, hess = evaluate(mu, tau)
                evaluations += 1
            else:
                grad, hess = t_grad, t_hess
            if moved <= 1e-9 * max(float(mu.max()), 1e-300):  # converged for this τ (quadratically, near it)
                break
        if best <= before + 1e-13 * abs(best) and before > -np.inf and tau < 1e-4 * scale:
            break  # a fine stage without a better exact bound: the smoothing has nothing left to give
        tau /= shrink
        value, exact, grad, hess = evaluate(mu, tau)
        evaluations += 1
    return best_mu, best, evaluations


def solve_lagrangian(problem: Problem, *, max_sweeps: int = 25, rtol: float = 1e-6, max_exchanges: int = 64,
                     extrapolate: tuple[float, ...] = (1.0, 3.0), smoothing: bool = True,
                     warm_sweeps: int = 2, start_prices: np.ndarray | None = None) -> Solution:
    """Solve Sia's problem approximately with a certified bound (see the module docstring).

    Args:
        problem: from :func:`goodput.allocator.problem.sia_problem`.
        smoothing: when ``warm_sweeps`` of coordinate ascent from 0 have not
            converged, continue from the smoothed dual's prices (started at
            theirs), then polish (``False``: coordinate ascent alone, the
            method before the smoothed dual).
        warm_sweeps: coordinate-ascent sweeps before the smoothed dual.
        start_prices: prices per GPU type to start from (e.g. the last round's,
            :attr:`SolverInfo.prices`): no coordinate-ascent sweeps first, and the
            smoothing starts 100 times finer. Only the time (and, among
            equally good answers, which one) depends on them.
        max_sweeps: passes of coordinate ascent over the GPU types.
        rtol: relative precision of each price's bisection.
        extrapolate: after each sweep, the prices ``μ + f·(μ − μ_before)``
            for each factor f are tried and the best bound kept (speeds
            up the slow, monotone rise of coupled prices).
        max_exchanges: improving two-job exchanges tried after the greedy
            repair (stops early once the gap is within 1e-9 or none improves).
    """
    start = time.perf_counter()
    n_jobs, n_types = len(problem.names), len(problem.gpu_types)
    capacity = problem.capacity.astype(float)
    if problem.num_options == 0 or n_jobs == 0:
        return Solution(np.full(n_jobs, -1, dtype=np.int64), 0.0, 0.0, "lagrangian", "optimal", 0,
                        time.perf_counter() - start, np.zeros(n_types))
    dense = [_Dense(problem, t, n_jobs) for t in range(n_types)]
    prices = np.zeros(n_types)
    values, types, columns = _choose(dense, prices, n_jobs)
    best = _Best(float(values.sum()), prices.copy(), 1)
    if np.all(_demand(dense, types, columns, n_types) <= capacity + 1e-9):
        # every job's cheapest option fits: that choice is optimal (its cost equals the bound L(0))
        choice = np.where(types >= 0, _flat(dense, types, columns), -1)
        total = float(problem.opt_cost[choice[choice >= 0]].sum())
        return Solution(choice, total, min(best.bound, total), "lagrangian", "optimal", best.evaluations,
                        time.perf_counter() - start, prices)
    ascend = {"capacity": capacity, "rtol": rtol, "extrapolate": extrapolate}
    caps = np.array([max(d.max_price, 0.0) * (1 + 1e-9) + 1e-12 for d in dense])
    warm = start_prices is not None and smoothing and np.shape(start_prices) == (n_types,)
    if warm:
        begin = np.clip(np.nan_to_num(np.asarray(start_prices, dtype=float)), 0.0, caps)
        values = _choose(dense, begin, n_jobs)[0]
        best.evaluations += 1
        value = float(values.sum() - begin @ capacity)
        if value > best.bound:
            best.bound, best.prices = value, begin
    if not smoothing:
        _ascend(dense, best, max_sweeps=max_sweeps, patience=2, **ascend)
    elif warm or not _ascend(dense, best, max_sweeps=warm_sweeps, patience=2, **ascend):
        if warm:
            # near the last round's prices only options close to their job's best matter to the smoothed dual:
            # it runs on those (~10% at 2000 jobs), and L is evaluated on every option at its prices
            near = _near_options(problem, best.prices)
            smoothed, _, count = _smoothed_prices(near, capacity, caps, start=best.prices, first_tau=1e-3, stages=8)
            values = _choose(dense, smoothed, n_jobs)[0]
            count += 1
            value = float(values.sum() - smoothed @ capacity)
        else:
            smoothed, value, count = _smoothed_prices(problem, capacity, caps, start=best.prices)
        best.evaluations += count
        if value > best.bound:
            best.bound, best.prices = value, smoothed
        _ascend(dense, best, max_sweeps=max_sweeps, patience=1, **ascend)

    prices = best.prices
    # two roundings of the dual: the jobs' choices at the bound's prices, and at prices lowered on the types
    # those choices leave part-empty (to just where their demand overfills them: the repair then packs them)
    choice, total = None, np.inf
    for candidate in (prices, _filled_prices(dense, prices, capacity)):
        if candidate is None:
            continue
        _, types, columns = _choose(dense, candidate, n_jobs)
        option = np.where(types >= 0, _flat(dense, types, columns), -1)
        option = _improve(problem, _repair(problem, option, capacity), capacity)
        value = float(problem.opt_cost[option[option >= 0]].sum())
        if value < total:
            choice, total = option, value
    for _ in range(max_exchanges):
        if total - best.bound <= 1e-9 * max(abs(total), 1.0):
            break  # within 1e-9 of the bound: what more exchanges could gain is negligible (mip_rel_gap is 1e-6)
        moved = _exchange(problem, choice, capacity)
        if moved is None:
            break
        choice = _improve(problem, moved, capacity)
        total = float(problem.opt_cost[choice[choice >= 0]].sum())
    bound = min(best.bound, total)
    gap = max(total - bound, 0.0) / max(abs(total), 1e-9)
    status = "optimal" if gap <= 1e-12 else "heuristic"
    return Solution(choice, total, bound, "lagrangian", status, best.evaluations, time.perf_counter() - start, prices)


def _near_options(problem: Problem, prices: np.ndarray, window: float = 0.03, drift: float = 0.05) -> Problem:
    """The options whose reduced cost at ``prices`` is within ``window`` × the cost scale of their job's best
    (or "none"), plus ``drift`` × their GPUs' price (prices move between rounds, most for large options)."""
    reduced = problem.opt_cost + prices[problem.opt_type] * problem.opt_gpus
    new_job = np.ones(reduced.size, dtype=bool)
    new_job[1:] = problem.opt_job[1:] != problem.opt_job[:-1]
    first = np.flatnonzero(new_job)
    best = np.minimum(np.minimum.reduceat(reduced, first), 0.0)
    segment = np.cumsum(new_job) - 1
    scale = float(np.max(np.abs(problem.opt_cost)))
    keep = np.flatnonzero(reduced - best[segment] <= window * scale + drift * prices[problem.opt_type] * problem.opt_gpus)
    return Problem(problem.names, problem.jobs, problem.gpu_types, problem.capacity, problem.opt_job[keep],
                   problem.opt_type[keep], problem.opt_gpus[keep], problem.opt_cost[keep], problem.opt_row[keep],
                   problem.offset, problem.sign, problem.sense)


def _type_demand(dense: list[_Dense], t: int, prices: np.ndarray, n_jobs: int) -> Callable[[float], float]:
    """Type ``t``'s GPU demand as a function of its price, the other types' prices fixed: a job takes its best
    option on ``t`` when that beats the best value it gets elsewhere (other types or none)."""
    outside = np.zeros(n_jobs)
    for s, other in enumerate(dense):
        if s != t and not other.empty:
            outside = np.minimum(outside, other.best(prices[s])[0])
    d = dense[t]

    def demand_at(price: float) -> float:
        value, column = d.best(price)
        take = value < outside
        return float(d.gpus[d.rows[take], column[take]].sum())

    return demand_at


def _filled_prices(dense: list[_Dense], prices: np.ndarray, capacity: np.ndarray, rtol: float = 1e-9) -> np.ndarray | None:
    """``prices`` with each type whose demand at them leaves GPUs idle lowered, type by type, to just above the
    price at which its demand (the others' prices fixed) exceeds its capacity; ``None`` if none is."""
    n_jobs = dense[0].rows.size
    prices = prices.copy()
    changed = False
    for t, d in enumerate(dense):
        if d.empty or prices[t] <= 0:
            continue
        demand_at = _type_demand(dense, t, prices, n_jobs)
        if demand_at(prices[t]) >= capacity[t] or demand_at(0.0) <= capacity[t]:
            continue  # full already, or not fillable at any price
        low, high = 0.0, float(prices[t])  # demand(low) > capacity >= demand(high)
        while high - low > rtol * high:
            mid = 0.5 * (low + high)
            if demand_at(mid) > capacity[t]:
                low = mid
            else:
                high = mid
        prices[t] = low
        changed = True
    return prices if changed else None


@dataclass
class _Best:
    """The best bound L(μ) found so far, its prices, and the price evaluations spent."""

    bound: float
    prices: np.ndarray
    evaluations: int


def _ascend(dense: list[_Dense], best: _Best, *, capacity: np.ndarray, max_sweeps: int, patience: int, rtol: float,
            extrapolate: tuple[float, ...]) -> bool:
    """Coordinate ascent from ``best.prices``, updating ``best``; True when it stopped for lack of progress
    (``patience`` sweeps without a better bound), False when it ran out of sweeps."""
    n_jobs = dense[0].rows.size
    prices = best.prices.copy()
    previous = prices.copy()
    stalled = 0
    for sweep in range(max_sweeps):
        bound_before = best.bound
        if sweep >= 1:
            # prices of substitutes rise together: try extrapolating the last sweep's step
            step = prices - previous
            for factor in extrapolate:
                trial = np.maximum(prices + factor * step, 0.0)
                trial_values = _choose(dense, trial, n_jobs)[0]
                best.evaluations += 1
                trial_bound = float(trial_values.sum() - trial @ capacity)
                if trial_bound > best.bound:
                    best.bound, best.prices = trial_bound, trial
            prices = best.prices.copy()
        previous = prices.copy()
        for t, d in enumerate(dense):
            if d.empty:
                continue
            demand_at = _type_demand(dense, t, prices, n_jobs)
            best.evaluations += 1
            if demand_at(0.0) <= capacity[t]:
                new = 0.0
            else:
                low, high = 0.0, d.max_price * (1 + 1e-12) + 1e-12
                old = prices[t]
                if 0.0 < old < high:  # warm start: bracket around the last price
                    best.evaluations += 1
                    if demand_at(old) <= capacity[t]:
                        high = old
                    else:
                        low = old
                while high - low > rtol * max(high, 1e-12):
                    mid = 0.5 * (low + high)
                    best.evaluations += 1
                    if demand_at(mid) <= capacity[t]:
                        high = mid
                    else:
                        low = mid
                new = high
            prices[t] = new
            values = _choose(dense, prices, n_jobs)[0]
            best.evaluations += 1
            value = float(values.sum() - prices @ capacity)
            if value > best.bound:
                best.bound, best.prices = value, prices.copy()
        if best.bound - bound_before <= 1e-12 * max(abs(best.bound), 1.0):
            stalled += 1
            if stalled >= patience:
                return True
        else:
            stalled = 0
    return False


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
        sel = np.flatnonzero(usable & (typ[j] == t))
        # GPUs a move can free, as columns (few distinct counts): price[b, v] = cheapest way for job b to free
        # exactly values[v] GPUs of t (an option that fits, or dropping the job: its cost rises by -cost)
        values = np.unique(np.concatenate([gpus[on_t], freed[sel]]))
        rows_all = np.arange(on_t.size)
        price = np.full((on_t.size, values.size), np.inf)
        which = np.full((on_t.size, values.size), -2, dtype=np.int64)  # option index, -1 = drop the job
        drop = np.searchsorted(values, gpus[on_t])
        price[rows_all, drop] = -cost[on_t]
        which[rows_all, drop] = -1
        if sel.size:
            rows, cols, delta = slot[j[sel]], np.searchsorted(values, freed[sel]), alt_c[sel] - cost[j[sel]]
            order = np.argsort(-delta)  # later writes win: keep the cheapest per (row, freed)
            better = delta[order] < price[rows[order], cols[order]]
            pick = order[better]
            price[rows[pick], cols[pick]] = delta[pick]
            which[rows[pick], cols[pick]] = sel[pick]
        # at least values[v] freed: suffix minimum over v (ties keep the fewest GPUs freed)
        for v in range(values.size - 2, -1, -1):
            take = price[:, v + 1] < price[:, v]
            price[take, v] = price[take, v + 1]
            which[take, v] = which[take, v + 1]
        # upgrades of some job a onto t that lack d GPUs of t
        room = residual[t] + np.where(typ[j] == t, gpus[j], 0)
        deficit = np.ceil(alt_g - room - 1e-9).astype(np.int64)
        gain = alt_c - cost[j]
        cand = np.flatnonzero((alt_t == t) & (deficit > 0) & (deficit <= width) & (gain < 0))
        if cand.size == 0:
            continue
        column = np.searchsorted(values, deficit[cand])  # the fewest GPUs freed that cover the deficit
        cand, column = cand[column < values.size], column[column < values.size]
        if cand.size == 0:
            continue
        # the cheapest freer per column, and the runner-up in case it is job a itself
        first = np.argmin(price, axis=0)
        masked = price.copy()
        masked[first, np.arange(values.size)] = np.inf
        second = np.argmin(masked, axis=0)
        b = np.where(on_t[first[column]] == j[cand], second[column], first[column])
        total = gain[cand] + price[b, column]
        k = int(np.argmin(total))
        if total[k] < -1e-12 and (best_move is None or total[k] < best_move[0]):
            best_move = (float(total[k]), int(cand[k]), int(on_t[b[k]]), int(which[b[k], column[k]]))
    if best_move is None:
        return None
    _, option, other, alt = best_move
    out = choice.copy()
    out[j[option]] = option
    out[other] = alt
    if np.any(_usage(problem, out) > capacity + 1e-9):  # pragma: no cover - guarded by construction
        return None
    return out


def unconstrained(problem: Problem) -> Solution | None:
    """Every job's cheapest option (none when nothing costs below 0), if together they fit: then optimal.

    With the capacity rows dropped the problem splits by job; its optimum is a
    lower bound, so a choice that also fits is optimal (ties go to the option
    listed first, i.e. the fewest GPUs of the lowest type). ``None`` when it
    does not fit.
    """
    start = time.perf_counter()
    n_jobs, n_types = len(problem.names), len(problem.gpu_types)
    choice = np.full(n_jobs, -1, dtype=np.int64)
    if problem.num_options:
        new_job = np.ones(problem.num_options, dtype=bool)
        new_job[1:] = problem.opt_job[1:] != problem.opt_job[:-1]
        first = np.flatnonzero(new_job)
        segment = np.cumsum(new_job) - 1
        lowest = np.minimum.reduceat(problem.opt_cost, first)
        hit = np.flatnonzero(problem.opt_cost == lowest[segment])
        hit = hit[np.r_[True, segment[hit][1:] != segment[hit][:-1]]]  # the first cheapest per job
        hit = hit[problem.opt_cost[hit] < 0]
        choice[problem.opt_job[hit]] = hit
        used = np.bincount(problem.opt_type[hit], weights=problem.opt_gpus[hit], minlength=n_types)
        if np.any(used > problem.capacity + 1e-9):
            return None
    total = float(problem.opt_cost[choice[choice >= 0]].sum())
    return Solution(choice, total, total, "unconstrained", "optimal", 1, time.perf_counter() - start,
                    np.zeros(n_types))


@dataclass
class Reduced:
    """What reduced-cost fixing leaves to decide (see :func:`fix_by_reduced_costs`)."""

    problem: Problem  # the open jobs and their surviving options, capacity less the fixed jobs' GPUs
    open_jobs: np.ndarray  # (n,) index of each open job into the full problem's jobs
    choice: np.ndarray  # full problem: the fixed jobs' options (-1: none), -1 for open jobs
    fixed_total: float  # Σ cost of the fixed jobs' options
    kept: int  # surviving options (binaries before fixing whole jobs)


def fix_by_reduced_costs(problem: Problem, prices: np.ndarray, incumbent: float) -> Reduced:
    """Drop every option that cannot be in a solution better than ``incumbent`` (Σ cost), and fix the jobs left with one.

    At prices ``μ ≥ 0`` with reduced costs ``r = c + μ_t·g``, any feasible
    choice ``x`` costs ``Σ_i c(x_i) ≥ L(μ) + Σ_i (r(x_i) − min(0, min_k r_ik))``
    (its GPUs fit the capacity, priced at μ), so an option whose excess
    reduced cost exceeds ``incumbent − L(μ)`` is in no better solution
    (reduced-cost fixing; Nemhauser & Wolsey, *Integer and Combinatorial
    Optimization*, 1988, §II.2.1). A job whose only survivor is one option (or none) is fixed there.
    """
    n_jobs = len(problem.names)
    cost, gpus, typ = problem.opt_cost, problem.opt_gpus, problem.opt_type
    reduced = cost + prices[typ] * gpus
    best = np.zeros(n_jobs)  # "none" costs 0
    if reduced.size:
        new_job = np.ones(reduced.size, dtype=bool)
        new_job[1:] = problem.opt_job[1:] != problem.opt_job[:-1]
        first = np.flatnonzero(new_job)
        best[problem.opt_job[first]] = np.minimum(np.minimum.reduceat(reduced, first), 0.0)
    bound = float(best.sum() - prices @ problem.capacity)
    slack = incumbent - bound + 1e-9 * max(abs(incumbent), 1.0)  # rounding: keep borderline options
    survive = reduced - best[problem.opt_job] <= slack
    none_survives = -best <= slack
    count = np.bincount(problem.opt_job[survive], minlength=n_jobs) + none_survives
    open_job = count > 1
    choice = np.full(n_jobs, -1, dtype=np.int64)
    lone = survive & ~open_job[problem.opt_job]
    choice[problem.opt_job[lone]] = np.flatnonzero(lone)
    used = np.bincount(typ[lone], weights=gpus[lone], minlength=len(problem.gpu_types))
    keep = np.flatnonzero(survive & open_job[problem.opt_job])
    open_jobs = np.flatnonzero(open_job)
    position = np.full(n_jobs, -1, dtype=np.int64)
    position[open_jobs] = np.arange(open_jobs.size)
    sub = Problem([problem.names[i] for i in open_jobs], problem.jobs[open_jobs], problem.gpu_types,
                  problem.capacity - used, position[problem.opt_job[keep]], typ[keep], gpus[keep], cost[keep],
                  keep, 0.0, problem.sign, problem.sense)  # opt_row: index into the full problem's options
    return Reduced(sub, open_jobs, choice, float(cost[lone].sum()), int(survive.sum()))
