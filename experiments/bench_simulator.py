"""Simulator speed and policy quality on Sia's 64-GPU three-type cluster (issue: experiments).

For each seed: a 160-job synthetic Philly-like workload on ``t4:6x4,a100:2x8,rtx2080ti:3x8``
with the built-in catalog as ground truth; every policy is simulated on one
core (model updates included for ``sia`` and ``unaware``). Reports wall seconds
per simulation (target: < 30 s for a 160-job workload) and mean JCT per policy
with ``sia``'s reduction against ``unaware`` (target ≥ 35%) and ``gavel``
(target ≥ 60%), and its gap to ``sia-oracle`` (target ≤ 10%).

Run: ``python -m experiments.bench_simulator [--quick] [--seeds 3] [--jobs 160]``.
"""

from __future__ import annotations

import statistics
import sys

from experiments.benchutil import parser, report
from experiments.simulator.engine import SimConfig, Simulator
from experiments.simulator.policies import POLICY_NAMES, make_policy
from experiments.simulator.runner import DEFAULT_CLUSTER
from experiments.simulator.truth import catalog_workload_stats, load_catalog
from experiments.simulator.workload import synthetic_workload
from goodput.cluster import Cluster


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_simulator", __doc__)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=160)
    p.add_argument("--hours", type=float, default=8.0)
    p.add_argument("--policies", default=",".join(POLICY_NAMES))
    args = p.parse_args(argv)
    seeds = 1 if args.quick else args.seeds
    jobs_count = 24 if args.quick else args.jobs
    hours = 2.0 if args.quick else args.hours
    cluster = Cluster.parse(DEFAULT_CLUSTER)
    families = load_catalog(gpu_types=cluster.gpu_types)
    policies = [x.strip() for x in args.policies.split(",")]
    jct: dict[str, list[float]] = {p: [] for p in policies}
    wall: dict[str, list[float]] = {p: [] for p in policies}
    rows = []
    for seed in range(seeds):
        workload = synthetic_workload(catalog_workload_stats(), families, num_jobs=jobs_count, hours=hours, seed=seed)
        for name in policies:
            result = Simulator(workload, families, SimConfig(cluster=cluster, seed=seed), make_policy(name)).run()
            jct[name].append(result.summary["avg_jct_s"])
            wall[name].append(result.summary["wall_seconds"])
            rows.append({"what": f"{name} seed {seed}", "jobs": jobs_count, "avg_jct_s": result.summary["avg_jct_s"],
                         "makespan_s": result.summary.get("makespan_s"), "restarts_per_job": result.summary["restarts_per_job"],
                         "contention_mean": result.summary.get("contention_mean"), "wall_s": result.summary["wall_seconds"]})
            print(f"  seed {seed} {name:10s} avg JCT {result.summary['avg_jct_s']:8.0f} s  wall {result.summary['wall_seconds']:.1f} s",
                  flush=True)
    summary = {}
    for name in policies:
        summary[name] = {"avg_jct_s": statistics.mean(jct[name]), "wall_s_max": max(wall[name])}
        rows.append({"what": f"{name} mean over seeds", "jobs": jobs_count, "avg_jct_s": summary[name]["avg_jct_s"],
                     "wall_s": statistics.mean(wall[name]), "wall_s_max": max(wall[name])})
    if "sia" in summary:
        sia = summary["sia"]["avg_jct_s"]
        for other, target in (("unaware", 0.35), ("gavel", 0.60)):
            if other in summary:
                cut = 1.0 - sia / summary[other]["avg_jct_s"]
                rows.append({"what": f"sia JCT reduction vs {other}", "value": cut, "target": target, "meets_target": cut >= target})
        if "sia-oracle" in summary:
            gap = sia / summary["sia-oracle"]["avg_jct_s"] - 1.0
            rows.append({"what": "sia JCT above sia-oracle", "value": gap, "target": 0.10, "meets_target": gap <= 0.10})
        rows.append({"what": "sia wall seconds, worst seed", "value": summary["sia"]["wall_s_max"], "target": 30.0,
                     "meets_target": summary["sia"]["wall_s_max"] <= 30.0})
    report("bench_simulator", rows, args, extra={"cluster": str(cluster), "hours": hours})
    return 0


if __name__ == "__main__":
    sys.exit(main())
