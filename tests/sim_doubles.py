"""Test doubles for simulator tests: policies whose decisions the test controls exactly."""

from __future__ import annotations

from experiments.simulator.engine import Assignment


class FixedPolicy:
    """Gives every active job the same configuration (first free nodes), or alternates between two."""

    name = "fixed"
    adaptive_batch = True

    def __init__(self, gpu_type: str, num_gpus: int, *, oracle: bool = True, alternate: str | None = None,
                 round_s: float = 60.0) -> None:
        self.gpu_type, self.num_gpus, self.oracle, self.alternate, self.round_s = gpu_type, num_gpus, oracle, alternate, round_s
        self.calls = 0

    def decide(self, now, cluster, jobs):
        self.calls += 1
        gpu_type = self.alternate if self.alternate and self.calls % 2 == 0 else self.gpu_type
        pool = cluster.pool(gpu_type)
        free = {n: pool.gpus_per_node for n in pool.node_ids()}
        out = {}
        for job in jobs:
            node = next((n for n, f in free.items() if f >= self.num_gpus), None)
            if node is None:
                out[job.name] = None
                continue
            free[node] -= self.num_gpus
            out[job.name] = Assignment(gpu_type, 1, self.num_gpus, ((node, self.num_gpus),))
        return out
