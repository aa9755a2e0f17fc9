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


def pipeline_forward(gpu_type: str, local_bsz: int) -> float:
    """The synthetic pipeline job's forward seconds of one micro-batch through one stage."""
    return (0.02 + 0.01 * local_bsz) * (1.0 if gpu_type == "a100" else 2.5)


def pipeline_sync(num_nodes: int, replicas: int) -> float:
    """Its communication seconds per optimizer step: more across nodes, growing with the replicas."""
    return 0.2 + 0.05 * (replicas - 1) if num_nodes > 1 else 0.05 + 0.02 * (replicas - 1)


def write_pipeline_model(root, name: str = "pipe", stages=None, pools=None, settings=None, work_per_epoch: float = 400.0):
    """A measured pipeline-parallel model in Sia's table format (truth.py's docstring) whose times are known:
    ``pipeline_forward`` and ``pipeline_sync``; ``stages`` per GPU type (default a100: 2, t4: 4), ``pools`` the
    (GPUs per node, nodes) each type's placements cover; ``settings`` the application.json (None: derived)."""
    import json

    stages = stages or {"a100": 2, "t4": 4}
    pools = pools or {"a100": (8, 2), "t4": (4, 4)}
    folder = root / name
    folder.mkdir(parents=True)
    for gpu, per_replica in stages.items():
        gpn, nodes_max = pools[gpu]
        lines = ["placement,local_bsz,step_time,sync_time"]
        for k in range(1, 64):
            gpus = k * per_replica
            if gpus <= gpn:
                placement = str(gpus)
            elif gpus % gpn == 0 and gpus // gpn <= nodes_max:
                placement = str(gpn) * (gpus // gpn)
            else:
                continue
            for bsz in (1, 2, 4):
                lines.append(f"{placement},{bsz},{pipeline_forward(gpu, bsz)!r},{pipeline_sync(len(placement), k)!r}")
        (folder / f"placements-{gpu}.csv").write_text("\n".join(lines) + "\n")
    (folder / "application.json").write_text(json.dumps(settings if settings is not None else
                                                        {"restart_cost_s": 60, "num_stages": stages}))
    for batch in (16, 32, 64, 128):
        rows = ["progress,iteration,metric,grad_sqr,grad_var"]
        rows += [f"{work_per_epoch * e},{e * 100},{1.0 / e},1.0,{0.5 * e * (batch / 16) ** 0.3}" for e in range(1, 11)]
        (folder / f"validation-{batch}.csv").write_text("\n".join(rows) + "\n")
    return folder
