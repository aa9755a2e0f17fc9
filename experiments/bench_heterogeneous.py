"""Sia, a heterogeneity-unaware policy and Gavel on Sia's three-type cluster, per-application restart costs on.

Workloads: the 8 Philly-derived 160-job workloads of Pollux's artifact
(``pollux/workloads``, Philly hours 3–10) when ``../shared/data`` is present,
else synthetic Philly-like ones (``--seeds``); cluster
``t4:6x4,a100:2x8,rtx2080ti:3x8`` (Sia's 64-GPU setup); ground truth: the
built-in catalog (``--truth`` for a measured-tables directory). Every job
loses its application's restart cost per (re)allocation (Sia's measured
figures, :data:`experiments.simulator.truth.RESTART_COST_S`), unless
``--restart-cost S`` charges every job S seconds.

Reports per policy, as means over the workloads: mean and p99 JCT, makespan,
GPU-hours (per job and per workload) and restarts per job; each workload's
figures; the wall seconds of the simulations; the load average around the run
(the host is shared: timings depend on it).

Run: ``python -m experiments.bench_heterogeneous [--quick] [--policies sia,unaware,gavel] [--processes 2]
[--restart-cost S]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from experiments.benchutil import parser, report
from experiments.datasets import default_data_dir
from experiments.simulator.runner import DEFAULT_CLUSTER, Task, check_task, load_truth, run_sweep
from experiments.simulator.truth import catalog_workload_stats
from experiments.simulator.workload import read_workload, synthetic_workload
from goodput.cluster import Cluster
from goodput.errors import ValidationError

FIGURES = (("avg_jct_s", "mean JCT s"), ("p99_jct_s", "p99 JCT s"), ("makespan_s", "makespan s"),
           ("gpu_hours_per_job", "GPU-h per job"), ("restarts_per_job", "restarts per job"))


def workloads(args, families) -> tuple[str, list[tuple[str, list]]]:
    data = default_data_dir()
    folder = data / "pollux" / "workloads" if data is not None else None
    if folder is not None and folder.is_dir() and not args.synthetic:
        files = sorted(folder.glob("workload-*.csv"), key=lambda p: int(p.stem.split("-")[1]))
        loads = [(p.stem, read_workload(p)) for p in (files[:1] if args.quick else files)]
        if args.quick:
            loads = [(name, jobs[:12]) for name, jobs in loads]
        return "Pollux's Philly-derived workloads (pollux/workloads)", loads
    count, hours = (12, 1.0) if args.quick else (160, 8.0)
    return (f"synthetic Philly-like workloads ({count} jobs over {hours} h)",
            [(f"synthetic-seed{s}", synthetic_workload(catalog_workload_stats(), families, num_jobs=count, hours=hours, seed=s))
             for s in range(1 if args.quick else args.seeds)])


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_heterogeneous", __doc__)
    p.add_argument("--synthetic", action="store_true", help="synthetic workloads even when Pollux's are present")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--policies", default="sia,unaware,gavel")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER)
    p.add_argument("--truth", default="catalog")
    p.add_argument("--restart-cost", type=float, default=None, dest="restart_cost",
                   help="seconds every job loses per reallocation (default: per application)")
    p.add_argument("--processes", type=int, default=None, help="parallel simulations (default 2; 1 with --quick)")
    args = p.parse_args(argv)
    if args.processes is None:
        args.processes = 1 if args.quick else 2
    try:  # every option checked before the simulations (minutes): one line, not a traceback
        cluster = Cluster.parse(args.cluster)
        families = load_truth(args.truth, cluster)
        source, loads = workloads(args, families)
        policies = [x.strip() for x in args.policies.split(",") if x.strip()]
        config = {} if args.restart_cost is None else {"restart_cost_s": args.restart_cost}
        tasks = [Task(name, tuple(jobs), policy, str(cluster), truth=args.truth, config=dict(config))
                 for name, jobs in loads for policy in policies]
        for task in tasks:
            check_task(task, families)
    except (ValidationError, OSError) as exc:
        p.error(str(exc))
    restart = "per application" if args.restart_cost is None else f"{args.restart_cost:g} s for every job"
    print(f"{len(tasks)} simulations: {len(loads)} workloads ({source}) x {len(policies)} policies on {cluster}; "
          f"restart cost {restart}", flush=True)
    load_before = os.getloadavg()
    started = time.perf_counter()
    results: dict[str, list[dict]] = {policy: [] for policy in policies}
    rows = []

    def done(task, result) -> None:
        s = result.summary
        record = {"workload": task.workload_name, "finished": s["finished"], "jobs": s["jobs"],
                  **{key: s[key] for key, _ in FIGURES}, "gpu_hours": s["gpu_hours_per_job"] * s["jobs"],
                  "wall_s": s["wall_seconds"]}
        results[task.policy].append(record)
        rows.append({"what": f"{task.policy} {task.workload_name}", **{k: v for k, v in record.items() if k != "workload"}})
        print(f"  {task.workload_name:16s} {task.policy:8s} mean JCT {s['avg_jct_s']:8.0f} s  p99 {s['p99_jct_s']:8.0f} s  "
              f"makespan {s['makespan_s']:8.0f} s  restarts/job {s['restarts_per_job']:.2f}  wall {s['wall_seconds']:.1f} s",
              flush=True)

    run_sweep(tasks, processes=args.processes, on_done=done)
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()
    rows.sort(key=lambda r: r["what"])
    means = {}
    for policy in policies:
        runs = results[policy]
        means[policy] = {key: statistics.mean(r[key] for r in runs) for key in (*(k for k, _ in FIGURES), "gpu_hours")}
        rows.append({"what": f"{policy}: mean over {len(runs)} workloads", **means[policy],
                     "finished": sum(r["finished"] for r in runs), "jobs": sum(r["jobs"] for r in runs),
                     "wall_s": statistics.mean(r["wall_s"] for r in runs), "wall_s_max": max(r["wall_s"] for r in runs)})
    if "sia" in means:
        for other in policies:
            if other != "sia":
                rows.append({"what": f"sia mean JCT vs {other}", "value": means["sia"]["avg_jct_s"] / means[other]["avg_jct_s"] - 1.0})
    report("bench_heterogeneous", rows, args, extra={
        "cluster": str(cluster), "workloads": source, "truth": args.truth, "restart_cost": restart,
        "sweep_wall_s": elapsed, "processes": args.processes,
        "load_average_before": load_before, "load_average_after": load_after})
    return 0


if __name__ == "__main__":
    sys.exit(main())
