"""Instances for the allocator tests: goodput tables and an independent Sia objective."""

from __future__ import annotations

import itertools

import numpy as np

from goodput import Cluster, GoodputTable
from goodput.allocator import JobSpec


def table(job: str, rows: dict[tuple[str, int, int], float]) -> GoodputTable:
    """A table from ``{(gpu_type, num_nodes, num_gpus): goodput}``."""
    return GoodputTable(job, [{"gpu_type": t, "num_nodes": n, "num_gpus": g, "goodput": v} for (t, n, g), v in rows.items()])


def scaling_table(job: str, cluster: Cluster, speed: dict[str, float], exponent: float = 0.8,
                  base: float = 100.0, max_gpus: int | None = None) -> GoodputTable:
    """goodput = base · speed[type] · gpus^exponent on the cluster's configurations (0.95 per extra node)."""
    rows = {}
    for t, n, g in cluster.configurations():
        if max_gpus is None or g <= max_gpus:
            rows[(t, n, g)] = base * speed[t] * g**exponent * 0.95 ** (n - 1)
    return table(job, rows)


def random_tables(cluster: Cluster, n_jobs: int, rng: np.random.Generator, max_gpus: int = 64,
                  drop: float = 0.0) -> dict[str, GoodputTable]:
    """Random but plausible tables: per-type speed, sub-linear scaling, noise; ``drop`` = share of rows left out."""
    speeds = {t: rng.uniform(0.5, 3.0) for t in cluster.gpu_types}
    out = {}
    for j in range(n_jobs):
        exponent, base = rng.uniform(0.3, 0.98), rng.uniform(20, 500)
        rows = {}
        for t, n, g in cluster.configurations():
            if g > max_gpus or rng.random() < drop:
                continue
            rows[(t, n, g)] = base * speeds[t] * rng.uniform(0.6, 1.4) * g**exponent / (1 + 0.05 * (n - 1))
        if not rows:  # keep at least one row
            t, n, g = cluster.configurations()[0]
            rows[(t, n, g)] = base
        out[f"job{j}"] = table(f"job{j}", rows)
    return out


def sia_objective(tables, allocation, p=-0.5, lam=1.1, current=None, jobs=None) -> float:
    """Sia's objective of an allocation, computed from scratch (SOSP'23 §3.3)."""
    total = 0.0
    for job, tab in tables.items():
        chosen = allocation[job]
        if chosen is None:
            total += lam if p < 0 else -lam
            continue
        row = tab.lookup(*chosen.configuration)
        spec = (jobs or {}).get(job) or JobSpec()
        old = (current or {}).get(job)
        factor = 1.0 if old is None or old.configuration == chosen.configuration else spec.restart_factor
        total += (factor * row["normalized_goodput"]) ** p
    return total


def brute_force(tables, cluster: Cluster, p=-0.5, lam=1.1, current=None, jobs=None):
    """The best Sia objective over every combination of configurations (None = unallocated)."""
    names = list(tables)
    unallocated = lam if p < 0 else -lam
    choices = []  # per job: [(configuration or None, value)]
    for job in names:
        spec = (jobs or {}).get(job) or JobSpec()
        old = (current or {}).get(job)
        frame = tables[job].frame
        options = [(None, unallocated)]
        for row in frame.to_dict("records"):
            t, n, g = row["gpu_type"], row["num_nodes"], row["num_gpus"]
            pool = cluster.pool(t)
            shape_ok = (n == 1 and g <= pool.gpus_per_node) or g == n * pool.gpus_per_node
            if row["goodput"] > 0 and shape_ok and n <= pool.nodes and spec.allows(g, t) and (
                    spec.gpu_types is None or t in spec.gpu_types):
                factor = 1.0 if old is None or old.configuration == (t, n, g) else spec.restart_factor
                if factor > 0:
                    options.append(((t, n, g), (factor * row["normalized_goodput"]) ** p))
        choices.append(options)
    capacity = {t: cluster.capacity(t) for t in cluster.gpu_types}
    best, best_combo = None, None
    sense = 1 if p < 0 else -1
    for combo in itertools.product(*choices):
        used = dict.fromkeys(capacity, 0)
        for config, _ in combo:
            if config is not None:
                used[config[0]] += config[2]
        if any(used[t] > capacity[t] for t in used):
            continue
        value = sum(v for _, v in combo)
        if best is None or sense * value < sense * best:
            best, best_combo = value, {job: c for job, (c, _) in zip(names, combo)}
    return best, best_combo


def check_invariants(allocation, tables, cluster: Cluster) -> None:
    """Capacity, one configuration per job, placement rules, a reason for every unallocated job."""
    assert set(allocation) == set(tables)
    used: dict[str, int] = {}
    per_node: dict[str, int] = {}
    for job, chosen in allocation.items():
        if chosen is None:
            assert allocation.unallocated.get(job), f"{job} unallocated without a reason"
            continue
        assert job not in allocation.unallocated
        pool = cluster.pool(chosen.gpu_type)
        row = tables[job].lookup(*chosen.configuration)
        assert row is not None and row["goodput"] > 0, f"{job}: {chosen.configuration} not a feasible row"
        used[chosen.gpu_type] = used.get(chosen.gpu_type, 0) + chosen.num_gpus
        assert len(chosen.placement) == chosen.num_nodes and sum(chosen.placement.values()) == chosen.num_gpus
        for node, gpus in chosen.placement.items():
            assert node in pool.node_ids()
            per_node[node] = per_node.get(node, 0) + gpus
        if chosen.num_gpus < pool.gpus_per_node:
            assert chosen.num_nodes == 1  # sub-node allocations are never split
        else:
            assert chosen.num_gpus == chosen.num_nodes * pool.gpus_per_node
            assert all(g == pool.gpus_per_node for g in chosen.placement.values())  # whole nodes
    for t, count in used.items():
        assert count <= cluster.capacity(t)
    for node, count in per_node.items():
        gpu_type = node.rsplit("-", 1)[0]
        assert count <= cluster.pool(gpu_type).gpus_per_node, f"node {node} over capacity"
