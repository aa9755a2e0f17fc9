"""Simulator speed and policy quality on Sia's 64-GPU three-type cluster (issue: experiments).

Workloads: the 8 Philly-derived 160-job workloads of Pollux's artifact
(``pollux/workloads``, Philly hours 3–10) when ``../shared/data`` is present,
else synthetic Philly-like workloads (``--seeds``). Cluster
``t4:6x4,a100:2x8,rtx2080ti:3x8``; ground truth: the built-in catalog. Every
policy is simulated once per workload, each simulation on one core (two run
side by side on a 2-core host); ``sia`` and ``unaware`` include every online
model update.

Reports per policy the mean JCT over workloads and each simulation's wall
seconds; ``sia``'s mean-JCT reduction against ``unaware`` (target ≥ 35%) and
``gavel`` (≥ 60%), its gap to ``sia-oracle`` (≤ 10%), and its slowest
simulation (target ≤ 20 s for a 160-job workload, issue 35; beside it, Sia's
own simulator took 408 s for Philly workload 1 on this cluster on the same
machine, as issue 35 measured it).

``--split`` (default on; ``--no-split`` skips it) runs the sweep's slowest
``sia`` simulation again alone (the target's reading: one simulation on this
machine; in the sweep two share it) and reports where its time went, exclusive of
what each part calls: the online models (``JobModel.refit``; ``table``,
``goodput``, ``observe`` without their refits; the cluster prior learnt from
finished jobs), ``allocate`` (the ILP, its inputs and the placement), goodput
tables' validation and the simulator itself.

Run: ``python -m experiments.bench_simulator [--quick] [--synthetic] [--seeds 3] [--processes 2] [--no-split]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

from experiments.benchutil import check_options, parser, report
from experiments.datasets import default_data_dir
from experiments.simulator.policies import POLICY_NAMES
from experiments.simulator.runner import DEFAULT_CLUSTER, Task, run_sweep
from experiments.simulator.truth import catalog_workload_stats, load_catalog
from experiments.simulator.workload import read_workload, synthetic_workload
from goodput.cluster import Cluster


def workloads(args, families) -> tuple[str, list[tuple[str, list]]]:
    data = default_data_dir()
    folder = data / "pollux" / "workloads" if data is not None else None
    if folder is not None and folder.is_dir() and not args.synthetic:
        files = sorted(folder.glob("workload-*.csv"), key=lambda p: int(p.stem.split("-")[1]))
        files = files[:1] if args.quick else files
        jobs = [(p.stem, read_workload(p)) for p in files]
        if args.quick:
            jobs = [(name, j[:24]) for name, j in jobs]
        return "Pollux's Philly-derived workloads (pollux/workloads)", jobs
    seeds = 1 if args.quick else args.seeds
    count, hours = (24, 2.0) if args.quick else (args.jobs, args.hours)
    return (f"synthetic Philly-like workloads ({count} jobs over {hours} h)",
            [(f"synthetic-seed{s}", synthetic_workload(catalog_workload_stats(), families, num_jobs=count, hours=hours, seed=s))
             for s in range(seeds)])


SIA_SIMULATOR_S = 408.0  # Sia's own simulator, Philly workload 1 on t4:6x4,a100:2x8,rtx2080ti:3x8 (issue 35)


def time_split(task: Task) -> dict[str, Any]:
    """One simulation with exclusive timers on its parts (see the module docstring): seconds and calls per part."""
    import functools

    import experiments.simulator.engine as engine
    import experiments.simulator.policies as policies
    import goodput.table as table
    from experiments.simulator.runner import run_task
    from goodput.model import JobModel

    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    stack: list[float] = []
    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: Any) -> None:
        fn = getattr(owner, name)
        saved.append((owner, name, fn))

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                inner = stack.pop()
                part = label(*args, **kwargs) if callable(label) else label
                spent[part] = spent.get(part, 0.0) + seconds - inner
                calls[part] = calls.get(part, 0) + 1
                if stack:
                    stack[-1] += seconds

        setattr(owner, name, timed)

    def refit_kind(model: Any, *, hyperparameters: bool = True) -> str:
        if model.refits <= 1:  # counted after the refit: its first (after the arrival profile)
            return "model: refit, first"
        return "model: refit, GP hyperparameters too" if hyperparameters else "model: refit, means and transfers"

    wrap(JobModel, "refit", refit_kind)
    wrap(JobModel, "table", "model: table (without refits)")
    wrap(JobModel, "goodput", "model: goodput (without refits)")
    wrap(JobModel, "observe", "model: observe")
    wrap(engine.ClusterKnowledge, "learn", "model: cluster prior from finished jobs")
    wrap(engine.ClusterKnowledge, "prior", "model: cluster prior handed to new jobs")
    wrap(policies, "allocate", "allocate (ILP, inputs, placement)")
    wrap(table.GoodputTable, "__init__", "goodput tables: validation")
    wrap(engine.Simulator, "_run", "simulator (the rest)")
    load = os.getloadavg()
    start = time.perf_counter()
    try:
        _, result = run_task(task)
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "spent": spent, "calls": calls, "load_average": load, "avg_jct_s": result.summary["avg_jct_s"]}


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_simulator", __doc__)
    p.add_argument("--synthetic", action="store_true", help="synthetic workloads even when Pollux's are present")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=160)
    p.add_argument("--hours", type=float, default=8.0)
    p.add_argument("--policies", default=",".join(POLICY_NAMES))
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--no-split", dest="split", action="store_false", help="skip the time split of one sia simulation")
    args = p.parse_args(argv)
    check_options(p, args, at_least={"seeds": 1, "jobs": 1, "processes": 1})
    cluster = Cluster.parse(DEFAULT_CLUSTER)
    families = load_catalog(gpu_types=cluster.gpu_types)
    source, loads = workloads(args, families)
    policies = [x.strip() for x in args.policies.split(",")]
    tasks = [Task(name, tuple(jobs), policy, DEFAULT_CLUSTER) for name, jobs in loads for policy in policies]
    print(f"{len(tasks)} simulations: {len(loads)} workloads ({source}) x {len(policies)} policies", flush=True)
    jct: dict[str, list[float]] = {p: [] for p in policies}
    wall: dict[str, list[float]] = {p: [] for p in policies}
    sia_wall: dict[str, float] = {}
    rows = []

    def done(task, result) -> None:
        s = result.summary
        jct[task.policy].append(s["avg_jct_s"])
        wall[task.policy].append(s["wall_seconds"])
        if task.policy == "sia":
            sia_wall[task.workload_name] = s["wall_seconds"]
        rows.append({"what": f"{task.policy} {task.workload_name}", "jobs": s["jobs"], "avg_jct_s": s["avg_jct_s"],
                     "makespan_s": s.get("makespan_s"), "restarts_per_job": s["restarts_per_job"],
                     "contention_mean": s.get("contention_mean"), "utilization_mean": s.get("utilization_mean"),
                     "wall_s": s["wall_seconds"]})
        print(f"  {task.workload_name:16s} {task.policy:10s} avg JCT {s['avg_jct_s']:8.0f} s  wall {s['wall_seconds']:.1f} s",
              flush=True)

    run_sweep(tasks, processes=args.processes, on_done=done)
    rows.sort(key=lambda r: r["what"])
    summary = {}
    for name in policies:
        summary[name] = statistics.mean(jct[name])
        rows.append({"what": f"{name}: mean over {len(jct[name])} workloads", "avg_jct_s": summary[name],
                     "wall_s": statistics.mean(wall[name]), "wall_s_max": max(wall[name])})
    if "sia" in summary:
        for other, target in (("unaware", 0.35), ("gavel", 0.60)):
            if other in summary:
                cut = 1.0 - summary["sia"] / summary[other]
                rows.append({"what": f"sia JCT reduction vs {other}", "value": cut, "target": target, "meets_target": cut >= target})
        if "sia-oracle" in summary:
            gap = summary["sia"] / summary["sia-oracle"] - 1.0
            rows.append({"what": "sia JCT above sia-oracle", "value": gap, "target": 0.10, "meets_target": gap <= 0.10})
        slowest = max(wall["sia"])
        rows.append({"what": f"sia wall seconds, slowest workload in the sweep ({args.processes} at a time)",
                     "value": slowest, "target": 20.0, "meets_target": slowest <= 20.0, "sia_simulator_s": SIA_SIMULATOR_S,
                     "load_average": list(os.getloadavg())})
    extra: dict[str, Any] = {"cluster": str(cluster), "workloads": source}
    if args.split and "sia" in policies:
        # the sweep's slowest sia workload, simulated again alone: one `goodput simulate --policy sia` on this host
        name = max(sia_wall, key=sia_wall.__getitem__)
        jobs = dict(loads)[name]
        print(f"time split: sia on {name} (the sweep's slowest) alone", flush=True)
        split = time_split(Task(name, tuple(jobs), "sia", DEFAULT_CLUSTER))
        extra["split"] = split
        for part, seconds in sorted(split["spent"].items(), key=lambda kv: -kv[1]):
            rows.append({"what": f"split ({name}): {part}", "value": seconds, "share": seconds / split["wall_s"],
                         "calls": split["calls"][part]})
        rows.append({"what": f"sia wall seconds, slowest workload alone ({name}, with the split's timers)",
                     "value": split["wall_s"], "target": 20.0, "meets_target": split["wall_s"] <= 20.0,
                     "sia_simulator_s": SIA_SIMULATOR_S, "load_average": list(split["load_average"])})
    report("bench_simulator", rows, args, extra=extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
