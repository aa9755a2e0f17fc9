"""Placing allocations onto nodes, by Sia's rules (SOSP'23 §3.4).

Per GPU type, given each job's configuration (num_nodes, num_gpus):

1. jobs whose configuration did not change keep their GPUs (non-preemptible
   jobs always do; two of them claiming the same GPUs is an error);
2. whole-node allocations (``num_gpus = num_nodes × gpus_per_node``) take
   whole free nodes, counted from the last node down;
3. multi-node allocations that are not whole nodes (only a running FIFO job
   or a non-preemptible one has one; Sia's set has none) take that many nodes
   with the most free GPUs, split as evenly as their free GPUs allow;
4. sub-node allocations go on one node, never split: largest first, each on
   the fullest node that still holds it (best fit), counted from the front;
5. on fragmentation, single-node jobs that kept their GPUs are moved —
   for a whole-node job, every job on the emptiest nodes it needs; for a
   sub-node job, the smallest jobs (each smaller than the one being placed)
   on the node needing the fewest GPUs freed — but only where they all fit
   elsewhere at once (best fit, largest first), and for a whole-node job only
   if enough nodes come free: a running job is never evicted for a newcomer
   only to lose its GPUs.

A job that still cannot be placed is reported as failed, never half-placed.
Every node's capacity is respected by construction.

Hybrid-parallel jobs (pipelines of S GPUs, :mod:`goodput.hybrid`) need no rule
of their own: their configurations are whole pipelines in Sia's shapes
(:meth:`goodput.cluster.NodePool.configurations`), so a sub-node allocation
holds its pipelines on one node and a whole-node one fills its nodes. A
pipeline therefore crosses nodes only when it is longer than a node or when a
node does not hold a whole number of them (3-stage pipelines on 4-GPU nodes).

Example::

    >>> from goodput import Cluster
    >>> result = place(Cluster.parse("t4:2x4"), {"a": ("t4", 1, 2), "b": ("t4", 1, 4)}, {})
    >>> result.placements
    {'b': {'t4-1': 4}, 'a': {'t4-0': 2}}
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..cluster import Cluster, NodePool
from ..errors import ValidationError
from .result import JobAllocation

__all__ = ["PlacementResult", "place"]


@dataclass
class PlacementResult:
    placements: dict[str, dict[str, int]] = field(default_factory=dict)  # job -> {node_id: gpus}
    failed: dict[str, str] = field(default_factory=dict)  # job -> why it could not be placed
    moved: set[str] = field(default_factory=set)  # unchanged configuration, but evicted to other GPUs


def place(
    cluster: Cluster,
    assignments: Mapping[str, tuple[str, int, int]],
    current: Mapping[str, JobAllocation],
    pinned: frozenset[str] | set[str] = frozenset(),
) -> PlacementResult:
    """Place ``{job: (gpu_type, num_nodes, num_gpus)}`` onto the cluster's nodes.

    Args:
        cluster: the cluster.
        assignments: each job's configuration this round (capacity per type
            already respected, e.g. by the allocator).
        current: last round's allocations; a job whose configuration is the
            same and whose placement is valid keeps its GPUs.
        pinned: non-preemptible jobs: kept even if their placement breaks the
            shape rules, never evicted.

    Raises:
        ValidationError: two pinned jobs claim more GPUs of a node than it has.
    """
    result = PlacementResult()
    by_type: dict[str, list[tuple[str, int, int]]] = {}
    for job, (gpu_type, nodes, gpus) in assignments.items():
        by_type.setdefault(gpu_type, []).append((job, nodes, gpus))
    for gpu_type, jobs in by_type.items():
        _place_pool(cluster.pool(gpu_type), jobs, current, pinned, result)
    return result


class _Free:
    """Free GPUs per node, with heaps that find the fullest node holding g GPUs and the last empty nodes
    in O(gpus_per_node · log nodes) (entries go stale when a node changes and are skipped)."""

    def __init__(self, count: int, gpn: int) -> None:
        self.gpn = gpn
        self.free = [gpn] * count
        self.by_free: list[list[int]] = [[] for _ in range(gpn + 1)]  # min-heaps of node indices
        self.by_free[gpn] = list(range(count))
        self.empty_desc = [-n for n in range(count)]  # max-heap (negated) of empty nodes
        heapq.heapify(self.empty_desc)
        self.n_empty = count

    def change(self, node: int, delta: int) -> None:
        before = self.free[node]
        after = before + delta
        self.free[node] = after
        heapq.heappush(self.by_free[after], node)
        if after == self.gpn:
            heapq.heappush(self.empty_desc, -node)
        self.n_empty += (after == self.gpn) - (before == self.gpn)

    def best_fit(self, gpus: int) -> int | None:
        """The node with the fewest free GPUs that still holds ``gpus`` (lowest index on ties)."""
        for f in range(gpus, self.gpn + 1):
            heap = self.by_free[f]
            while heap and self.free[heap[0]] != f:
                heapq.heappop(heap)
            if heap:
                return heap[0]
        return None

    def last_empty(self, count: int) -> list[int]:
        """The ``count`` highest-numbered empty nodes (the caller fills them)."""
        out: list[int] = []
        seen: set[int] = set()
        heap = self.empty_desc
        while heap and len(out) < count:
            node = -heapq.heappop(heap)
            if self.free[node] == self.gpn and node not in seen:
                seen.add(node)
                out.append(node)
        return out


def _place_pool(pool: NodePool, jobs: list[tuple[str, int, int]], current: Mapping[str, JobAllocation],
                pinned, result: PlacementResult) -> None:
    gpn, count = pool.gpus_per_node, pool.nodes
    ids = pool.node_ids()
    node_of = {name: i for i, name in enumerate(ids)}
    nodes_free = _Free(count, gpn)
    free = nodes_free.free  # read-only view; changes go through nodes_free.change
    occupants: list[dict[str, int]] = [dict() for _ in range(count)]  # node -> {job: gpus}
    size = {job: gpus for job, _, gpus in jobs}
    evictable: set[str] = set()  # kept single-node jobs that may be moved on fragmentation
    kept: set[str] = set()

    def occupy(job: str, layout: dict[int, int]) -> None:
        for node, gpus in layout.items():
            nodes_free.change(node, -gpus)
            occupants[node][job] = gpus
        result.placements[job] = {ids[n]: g for n, g in layout.items()}

    def release(job: str) -> None:
        layout = result.placements.pop(job)
        for name, gpus in layout.items():
            node = node_of[name]
            nodes_free.change(node, gpus)
            del occupants[node][job]

    # 1. unchanged configurations keep their GPUs (pinned ones first, and always)
    whole, spread, sub = [], [], []
    order = sorted(jobs, key=lambda item: (item[0] not in pinned, item[0]))
    for job, nodes, gpus in order:
        old = current.get(job)
        if old is not None and old.configuration == (pool.gpu_type, nodes, gpus) and old.placement:
            layout = {node_of[n]: g for n, g in old.placement.items()}
            # a layout of the same configuration has its shape (prepare checks it against the nodes)
            shape_ok = len(layout) == nodes and all(g <= gpn for g in layout.values())
            fits = all(free[n] >= g for n, g in layout.items())
            if job in pinned:
                if not fits:
                    node = next(n for n, g in layout.items() if free[n] < g)
                    raise ValidationError(f"current[{job}].placement", old.placement,
                                          f"node {ids[node]} is over capacity with the other non-preemptible jobs")
                occupy(job, layout)
                kept.add(job)
                continue
            if shape_ok and fits:
                occupy(job, layout)
                kept.add(job)
                if nodes == 1 and gpus < gpn:
                    evictable.add(job)
                continue
            result.moved.add(job)  # same configuration, but its old GPUs are not available
        if gpus == nodes * gpn:
            whole.append((job, nodes, gpus))
        else:
            (sub if nodes == 1 else spread).append((job, nodes, gpus))

    # sub-node jobs wait in a heap: largest first, then by name
    queue = [(-gpus, job) for job, _nodes, gpus in sub]
    heapq.heapify(queue)

    def rehome(victims: list[str], trial: list[int]) -> bool:
        """Move ``victims`` (kept sub-node jobs) to nodes of their own, given the free GPUs ``trial`` once the
        job they make room for is placed; False (nothing moved) where they would not all fit: a running
        job is not evicted for a newcomer only to lose its GPUs."""
        homes = _best_fit_all([size[v] for v in victims], trial)
        if homes is None:
            return False
        for victim in victims:
            release(victim)
        for victim, home in zip(victims, homes):
            occupy(victim, {home: size[victim]})
            evictable.discard(victim)  # moved once this round
            result.moved.add(victim)
        return True

    # 2. whole-node allocations take whole free nodes, from the last node down; kept sub-node jobs move off
    #    the nodes needed (the fullest first) where they fit elsewhere, and only if enough nodes come free
    for job, nodes, _gpus in sorted(whole, key=lambda item: (-item[2], item[0])):
        need = nodes - nodes_free.n_empty
        if need > 0:
            candidates = sorted((n for n in range(count) if free[n] < gpn and occupants[n]
                                 and all(o in evictable for o in occupants[n])), key=lambda n: (free[n], n), reverse=True)
            if len(candidates) >= need:
                emptied = set(candidates[:need]) | {n for n in range(count) if free[n] == gpn}
                victims = sorted((o for n in candidates[:need] for o in occupants[n]), key=lambda o: (-size[o], o))
                rehome(victims, [0 if n in emptied else free[n] for n in range(count)])
        if nodes_free.n_empty < nodes:
            result.failed[job] = f"fragmentation: {nodes} whole {pool.gpu_type} nodes are not free"
            continue
        occupy(job, {n: gpn for n in sorted(nodes_free.last_empty(nodes))})

    # 3. multi-node allocations that are not whole nodes: over the nodes with the most free GPUs
    for job, nodes, gpus in sorted(spread, key=lambda item: (-item[2], item[0])):
        layout = _spread(free, nodes, gpus)
        if layout is None:
            result.failed[job] = f"fragmentation: no {nodes} {pool.gpu_type} nodes have {gpus} free GPUs between them"
            continue
        occupy(job, layout)

    # 4. sub-node allocations: largest first, best fit on one node; evict smaller kept jobs if needed
    budget = 4 * (len(jobs) + 1) ** 2
    while queue:
        negative, job = heapq.heappop(queue)
        gpus = -negative
        budget -= 1
        node = nodes_free.best_fit(gpus)
        if node is None and budget > 0:
            best = None
            for n in range(count):
                smaller = sorted((g, o) for o, g in occupants[n].items() if o in evictable and g < gpus)
                if free[n] + sum(g for g, _ in smaller) >= gpus:
                    deficit = gpus - free[n]
                    if best is None or deficit < best[0]:
                        best = (deficit, n, smaller)
            if best is not None:
                _, target, smaller = best
                victims, room = [], free[target]
                for g, other in smaller:
                    if room >= gpus:
                        break
                    victims.append(other)
                    room += g
                trial = list(free)
                trial[target] = room - gpus
                if rehome(sorted(victims, key=lambda o: (-size[o], o)), trial):
                    node = nodes_free.best_fit(gpus)
        if node is None:
            result.failed[job] = f"fragmentation: no {pool.gpu_type} node has {gpus} free GPUs"
            continue
        occupy(job, {node: gpus})
        if job in kept:
            evictable.add(job)
    result.moved -= {job for job in result.moved if job not in result.placements}


def _best_fit_all(sizes: list[int], free: list[int]) -> list[int] | None:
    """A node for each of ``sizes`` (largest first, each on the node with the fewest free GPUs that holds it,
    the lowest index on ties), or ``None`` if they do not all fit in ``free``."""
    left = list(free)
    homes: list[int] = []
    for gpus in sizes:
        fitting = [n for n in range(len(left)) if left[n] >= gpus]
        if not fitting:
            return None
        node = min(fitting, key=lambda n: (left[n], n))
        left[node] -= gpus
        homes.append(node)
    return homes


def _spread(free: list[int], nodes: int, gpus: int) -> dict[int, int] | None:
    """``gpus`` GPUs on ``nodes`` distinct nodes (at least one each), or ``None`` if they do not fit.

    Takes the nodes with the most free GPUs (the last on ties) and splits as
    evenly as their free GPUs allow: the fullest of them first, each taking
    its share of what is left or all it has.
    """
    chosen = sorted(range(len(free)), key=lambda n: (-free[n], -n))[:nodes]
    if len(chosen) < nodes or free[chosen[-1]] < 1 or sum(free[n] for n in chosen) < gpus:
        return None
    layout: dict[int, int] = {}
    left = gpus
    for k, node in enumerate(reversed(chosen)):  # fewest free first
        take = min(free[node], -(-left // (nodes - k)))
        layout[node] = take
        left -= take
    return dict(sorted(layout.items()))
