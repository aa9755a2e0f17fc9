"""Choose the batch size, local batch and accumulation that maximise goodput.

For an allocation (num_nodes, num_replicas), Pollux (OSDI'21, §4.1) evaluates
goodput = throughput × statistical efficiency over candidate total batch sizes
spaced geometrically between the smallest allowed and ``max_batch_size``, turns
each into a per-replica micro-batch and a number of accumulation steps that
respect the memory limit ``max_local_bsz``, and keeps the best. Everything here
is vectorised over (candidates × allocations): one numpy expression evaluates
them all.

Example::

    from goodput.throughput import ThroughputParams, predict_step_time
    params = ThroughputParams(0.02, 0.001, 0.2, 0.01, 0.05, 0.005, 1.5)
    limits = BatchLimits(init_batch_size=128, max_batch_size=4096, max_local_bsz=256)
    best = optimize_goodput(lambda n, r, b, a: predict_step_time(params, n, r, b, a),
                            lambda m: efficiency(1.0, 2.0, 128, m),
                            num_nodes=[1, 1, 2], num_replicas=[1, 4, 8], limits=limits)
    best.goodput, best.batch_size, best.local_bsz, best.accum_steps
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ValidationError
from .validation import check_allocations, check_int

__all__ = ["BatchLimits", "GoodputCandidates", "GoodputChoices", "best_goodput", "best_goodput_each", "candidate_batches",
           "goodput_candidates", "optimize_goodput"]

_EPS = 1e-8  # tolerance of ceil() on ratios that should be integral
EDGE_COUNTS = 32  # numbers of micro-batches per step tried at both ends of the micro-batch: each up to this, as many more geometric


@dataclass(frozen=True)
class BatchLimits:
    """What a job allows its batch to be, in samples.

    Attributes:
        init_batch_size: the reference batch M0; the smallest total batch.
        max_batch_size: the largest total batch (``None``: M0, i.e. strong scaling). Where no batch in
            [M0, max_batch_size] splits evenly into ``num_replicas × (accum_steps + 1)`` micro-batches
            (M0 = 128 on 3 GPUs), the micro-batch is rounded up as Pollux does (129): the batch then
            exceeds the maximum by fewer samples than that product, and the allocation stays usable.
        min_local_bsz: smallest per-replica micro-batch.
        max_local_bsz: largest per-replica micro-batch (memory); ``None``: no limit.
        accumulation: whether gradient accumulation may stretch the batch
            beyond ``num_replicas * max_local_bsz``.
    """

    init_batch_size: int
    max_batch_size: int | None = None
    min_local_bsz: int = 1
    max_local_bsz: int | None = None
    accumulation: bool = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        m0 = check_int("init_batch_size", self.init_batch_size, minimum=1)
        set_(self, "init_batch_size", m0)
        max_bs = m0 if self.max_batch_size is None else check_int("max_batch_size", self.max_batch_size, minimum=1)
        if max_bs < m0:
            raise ValidationError("max_batch_size", max_bs, f"must be >= init_batch_size ({m0})")
        set_(self, "max_batch_size", max_bs)
        set_(self, "min_local_bsz", check_int("min_local_bsz", self.min_local_bsz, minimum=1))
        if self.max_local_bsz is not None:
            high = check_int("max_local_bsz", self.max_local_bsz, minimum=1)
            if high < self.min_local_bsz:
                raise ValidationError("max_local_bsz", high, f"must be >= min_local_bsz ({self.min_local_bsz})")
            set_(self, "max_local_bsz", high)
        if not isinstance(self.accumulation, bool):
            raise ValidationError("accumulation", self.accumulation, "expected True or False")


@dataclass(frozen=True)
class GoodputChoices:
    """The best configuration for each allocation (arrays of one shape).

    ``goodput`` is 0 (and the sizes 0) where no batch within the limits fits: micro-batches within
    [min_local_bsz, max_local_bsz], a total batch from M0 up to ``max_batch_size`` (rounded up to whole
    micro-batches where none splits evenly: :class:`BatchLimits`).
    """

    goodput: np.ndarray  # samples/s × efficiency
    throughput: np.ndarray  # samples/s
    efficiency: np.ndarray  # in (0, 1]
    step_time: np.ndarray  # seconds of one optimizer step
    batch_size: np.ndarray  # samples per optimizer step
    local_bsz: np.ndarray  # samples per micro-batch per replica
    accum_steps: np.ndarray  # extra micro-batches per step

    @property
    def feasible(self) -> np.ndarray:
        return self.goodput > 0


def candidate_batches(
    num_replicas: np.ndarray, limits: BatchLimits, num_candidates: int = 50
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Candidate (batch_size, local_bsz, accum_steps, valid) arrays of shape (C, K).

    ``num_replicas`` has shape (K,). Each column spans total batch sizes from
    ``max(M0, num_replicas * min_local_bsz)`` to ``max_batch_size``
    geometrically (``num_candidates`` of them), then, under a memory limit,
    the largest micro-batch within the limits and the smallest that reaches
    M0 at each of up to 2 × :data:`EDGE_COUNTS` numbers of micro-batches per
    step (C grows by twice their number); a column whose lower end exceeds the upper one is invalid.
    A batch exceeds ``max_batch_size`` only when no (micro-batch,
    accumulation) pair of the column lies within the limits.

    Raises:
        ValidationError: ``num_candidates`` is not an integer >= 1.
    """
    num_candidates = check_int("num_candidates", num_candidates, minimum=1)
    replicas = np.asarray(num_replicas, dtype=float)
    m0, max_bs = float(limits.init_batch_size), float(limits.max_batch_size)
    low = np.maximum(m0, replicas * limits.min_local_bsz)
    count = 1 if max_bs == m0 else num_candidates
    fractions = np.linspace(0.0, 1.0, count)[:, None]
    high = np.maximum(low, max_bs)
    target = np.exp(np.log(low) + fractions * (np.log(high) - np.log(low)))
    local = target / replicas
    max_local = float(limits.max_local_bsz) if limits.max_local_bsz is not None else np.inf
    if limits.accumulation and np.isfinite(max_local):
        accum = np.maximum(np.ceil(local / max_local - _EPS) - 1.0, 0.0)
    else:
        accum = np.zeros_like(local)
    # Round the micro-batch up (Pollux), unless that overshoots max_batch_size
    # and rounding down still reaches M0. When neither lies in [M0,
    # max_batch_size] (no multiple of num_replicas * (accum_steps + 1) does),
    # the candidate takes the column's largest in-limit batch from
    # _in_limit_batches, which may need more accumulation steps (e.g. M0 = 168
    # on 4 replicas with micro-batches of at most 9: 4 × 6 × 7); only a column
    # with no in-limit configuration at all keeps a batch above the maximum.
    steps = replicas * (accum + 1.0)
    micro_up = np.ceil(local / (accum + 1.0) - _EPS)
    micro_down = np.floor(local / (accum + 1.0) + _EPS)
    use_down = (steps * micro_up > max_bs) & (steps * micro_down >= m0) & (micro_down >= limits.min_local_bsz)
    micro = np.where(use_down, micro_down, micro_up)
    batch = steps * micro
    valid = (micro >= limits.min_local_bsz) & (micro <= max_local) & (low <= max_bs)
    over = valid & (batch > max_bs)
    cols = np.flatnonzero(over.any(axis=0))
    if cols.size:
        found, fit_micro, fit_accum = _in_limit_batches(np.broadcast_to(replicas, batch.shape[1:])[cols], limits)
        replace = over[:, cols] & found
        for values, fallback in ((micro, fit_micro), (accum, fit_accum)):
            sub = values[:, cols]
            values[:, cols] = np.where(replace, fallback, sub)
        batch = replicas * micro * (accum + 1.0)
    if np.isfinite(max_local) and max_local >= limits.min_local_bsz:
        # For each number of micro-batches per step n, both ends of the micro-batch within the limits: the largest
        # (memory's, or max_batch_size's share), where goodput often peaks (the cheapest samples before one more
        # micro-batch), and the smallest that reaches M0 (efficiency's end: M0 100 on one replica of at most 48, with
        # a small noise scale, is best as 4 micro-batches of 25, not 3 of 34). The geometric grid rounds past them or
        # misses the count (t4:4x4, micro-batches of at most 48: 1.6-2.2% below the best), or finds no in-limit
        # micro-batch at its counts at all (M0 168 to 184 on 8 replicas of at most 4: the largest in-limit batch, 23
        # micro-batches of 1, 2.3 times slower than 7 of 3). The counts: every one up to EDGE_COUNTS, as many more
        # spaced geometrically up to the most that fit, and each column's where max_batch_size starts to bind.
        most = np.floor(max_bs / (replicas * limits.min_local_bsz) + _EPS) if limits.accumulation else np.ones_like(replicas)
        top = max(float(np.max(most, initial=1.0)), 1.0)
        counts = np.unique(np.concatenate([np.arange(1.0, min(top, EDGE_COUNTS) + 1.0),
                                           np.round(np.geomspace(1.0, top, EDGE_COUNTS))]))[:, None]
        full = np.maximum(np.floor(max_bs / (replicas * max_local) + _EPS), 1.0)
        counts = np.concatenate([np.broadcast_to(counts, (counts.shape[0], replicas.size)), np.stack([full, full + 1.0])])
        for edge_micro in (np.minimum(max_local, np.floor(max_bs / (replicas * counts) + _EPS)),
                           np.maximum(limits.min_local_bsz, np.ceil(m0 / (replicas * counts) - _EPS))):
            edge_batch = replicas * edge_micro * counts
            edge_valid = ((counts <= most) & (edge_micro >= limits.min_local_bsz) & (edge_micro <= max_local)
                          & (edge_batch >= m0) & (edge_batch <= max_bs))
            used = edge_valid.any(axis=1)  # counts no allocation can use are not evaluated
            edge_micro = np.where(edge_valid, edge_micro, float(limits.min_local_bsz))  # a real batch where unused
            edge_batch = replicas * edge_micro * counts
            batch = np.concatenate([batch, edge_batch[used]])
            micro = np.concatenate([micro, edge_micro[used]])
            accum = np.concatenate([accum, np.broadcast_to(counts - 1.0, edge_batch.shape)[used]])
            valid = np.concatenate([valid, edge_valid[used]])
    return batch, micro, accum, valid


def _in_limit_batches(replicas: np.ndarray, limits: BatchLimits) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per column, the largest batch ``replicas · micro · steps`` within every limit (then the fewest steps).

    Returns (found, micro, accum_steps) of shape (K,). A batch ``r·m·s`` has
    ``min(m, s) <= sqrt(max_batch_size / r)``, so trying each d up to that
    bound once as the number of micro-batches s (with the largest micro-batch
    that fits) and once as the micro-batch m (with the most steps that fit)
    finds the largest batch among all pairs, in one (D, K) array expression.
    """
    m0, max_bs = float(limits.init_batch_size), float(limits.max_batch_size)
    min_local = float(limits.min_local_bsz)
    max_local = float(limits.max_local_bsz) if limits.max_local_bsz is not None else np.inf
    max_steps = np.inf if limits.accumulation else 1.0
    bound = np.floor(np.sqrt(max_bs / replicas)) + 1.0
    d = np.arange(1.0, float(bound.max()) + 1.0)[:, None]
    per_step = replicas * d
    # d micro-batches per step, each as large as fits
    micro_a = np.minimum(max_local, np.floor(max_bs / per_step + _EPS))
    ok_a = (micro_a >= np.maximum(min_local, np.ceil(m0 / per_step - _EPS))) & (d <= max_steps)
    # micro-batches of d samples, as many steps as fit
    steps_b = np.minimum(max_steps, np.floor(max_bs / per_step + _EPS))
    ok_b = (steps_b >= np.maximum(1.0, np.ceil(m0 / per_step - _EPS))) & (d >= min_local) & (d <= max_local)
    micro = np.concatenate([micro_a, np.broadcast_to(d, micro_a.shape)])
    steps = np.concatenate([np.broadcast_to(d, micro_a.shape), steps_b])
    ok = np.concatenate([ok_a, ok_b])
    batch = np.where(ok, replicas * micro * steps, -1.0)
    # the largest batch, then the fewest micro-batches (the largest micro-batch)
    best = np.argmin(np.where(batch == batch.max(axis=0), steps, np.inf), axis=0)
    cols = np.arange(replicas.size)
    return ok[best, cols], micro[best, cols], steps[best, cols] - 1.0


@dataclass(frozen=True)
class GoodputCandidates:
    """Candidate batch configurations of some allocations with their step times: all of goodput but
    statistical efficiency, arrays of shape (C, K) (C candidates, K allocations).

    The throughput side depends only on the job's step times and batch limits;
    a scheduler that re-reads goodput as a job's gradient noise changes (its
    efficiency) can keep these and call :func:`best_goodput` with the new
    efficiency (:func:`optimize_goodput` is both steps at once).
    """

    batch: np.ndarray
    micro: np.ndarray
    accum: np.ndarray
    valid: np.ndarray
    times: np.ndarray
    throughput: np.ndarray
    init_batch_size: int

    def column(self, k: int) -> GoodputCandidates:
        """The candidates of allocation ``k`` alone (shape (C, 1))."""
        cut = slice(k, k + 1)
        return GoodputCandidates(self.batch[:, cut], self.micro[:, cut], self.accum[:, cut], self.valid[:, cut],
                                 self.times[:, cut], self.throughput[:, cut], self.init_batch_size)


def goodput_candidates(
    step_time: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray],
    num_nodes: Any,
    num_replicas: Any,
    limits: BatchLimits,
    num_candidates: int = 50,
    num_stages: int = 1,
) -> GoodputCandidates:
    """The candidates of :func:`optimize_goodput` and their step times and throughputs (see :class:`GoodputCandidates`)."""
    nodes = np.atleast_1d(np.asarray(num_nodes, dtype=float))
    replicas = np.atleast_1d(np.asarray(num_replicas, dtype=float))
    nodes, replicas = np.broadcast_arrays(nodes, replicas)
    check_allocations(nodes, replicas, num_stages, num_nodes, num_replicas)
    batch, micro, accum, valid = candidate_batches(replicas, limits, num_candidates)
    shape = batch.shape
    times = np.asarray(
        step_time(np.broadcast_to(nodes, shape), np.broadcast_to(replicas, shape), micro, accum), dtype=float
    )
    return GoodputCandidates(batch, micro, accum, valid, times, batch / times, limits.init_batch_size)


def best_goodput(candidates: GoodputCandidates, efficiency: Callable[[np.ndarray], np.ndarray]) -> GoodputChoices:
    """The goodput-maximising candidate of each allocation, given the job's statistical efficiency."""
    c = candidates
    shape = c.batch.shape
    eff = np.asarray(efficiency(np.maximum(c.batch, c.init_batch_size)), dtype=float)
    throughput = c.throughput
    goodput = np.where(c.valid & np.isfinite(throughput), throughput * eff, 0.0)
    best = np.argmax(goodput, axis=0)
    cols = np.arange(shape[1])
    chosen = goodput[best, cols]
    ok = chosen > 0

    def pick(values: np.ndarray) -> np.ndarray:
        return np.where(ok, values[best, cols], 0.0)

    return GoodputChoices(
        goodput=chosen,
        throughput=pick(throughput),
        efficiency=pick(np.broadcast_to(eff, shape)),
        step_time=pick(c.times),
        batch_size=pick(c.batch).astype(int),
        local_bsz=pick(c.micro).astype(int),
        accum_steps=pick(c.accum).astype(int),
    )


def best_goodput_each(candidates: GoodputCandidates, efficiencies: np.ndarray) -> dict[str, np.ndarray]:
    """:func:`best_goodput` for K jobs sharing ``candidates`` (same step times and limits, e.g. one job
    family), each with its own efficiency: ``efficiencies`` of shape (K, C, n), evaluated at
    ``max(candidates.batch, init_batch_size)``. Returns ``goodput``, ``batch_size``, ``local_bsz`` and
    ``accum_steps`` arrays of shape (K, n), row k equal to :func:`best_goodput` with job k's efficiency."""
    c = candidates
    eff = np.asarray(efficiencies, dtype=float)
    goodput = np.where(c.valid & np.isfinite(c.throughput), c.throughput * eff, 0.0)
    best = np.argmax(goodput, axis=1)[:, None, :]
    chosen = np.take_along_axis(goodput, best, axis=1)[:, 0, :]
    ok = chosen > 0

    def pick(values: np.ndarray) -> np.ndarray:
        return np.where(ok, np.take_along_axis(np.broadcast_to(values, goodput.shape), best, axis=1)[:, 0, :], 0.0)

    return {"goodput": chosen, "batch_size": pick(c.batch).astype(int), "local_bsz": pick(c.micro).astype(int),
            "accum_steps": pick(c.accum).astype(int)}


def optimize_goodput(
    step_time: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray],
    efficiency: Callable[[np.ndarray], np.ndarray],
    num_nodes: Any,
    num_replicas: Any,
    limits: BatchLimits,
    num_candidates: int = 50,
    num_stages: int = 1,
) -> GoodputChoices:
    """Maximise goodput over batch configurations for each allocation.

    Args:
        step_time: vectorised ``(num_nodes, num_replicas, local_bsz,
            accum_steps) -> seconds`` (arrays of shape (C, K)), e.g. a fitted
            Pollux model or a :class:`~goodput.model.JobModel`'s mean.
        efficiency: vectorised ``batch_size -> E`` (Pollux's statistical efficiency).
        num_nodes, num_replicas: allocations, broadcast to shape (K,).
        limits: the job's :class:`BatchLimits`.
        num_candidates: total batch sizes tried per allocation.
        num_stages: GPUs per replica (:mod:`goodput.hybrid`): a replica's pipeline may span nodes.

    Returns:
        :class:`GoodputChoices` with one entry per allocation.
    """
    return best_goodput(goodput_candidates(step_time, num_nodes, num_replicas, limits, num_candidates, num_stages),
                        efficiency)
