"""What Ray costs: ``profile_cluster`` against ``profile_job``, and ``simulate --ray`` against local processes (issue 33).

(a) Profiling overhead per type: on a private local Ray instance
    (:func:`profilers.rayutil.local_cluster`: one node of this host's cores,
    labelled ``accelerator_type:bench-cpu``), the wall seconds of
    ``profile_cluster`` for each zoo job on that type against plain
    ``profile_job`` on this host's CPU in this process, same settings (default
    20 s budget). Their difference is what a user waits for extra (target: at
    most 3 s per type). Both are budget-bound, so the difference also holds
    where each happened to stop; beside it, the breakdown: the actor's start
    (``ray_start_s``: a worker process, the job unpickled there, which imports
    torch), and Ray's part (the type's wall in ``profile_cluster`` less
    ``profile_job``'s own seconds in the actor: the start, streaming the
    observations back and ending the actor), with each side's own profiling
    seconds, its replica phase's seconds (the actor's replicas are spawned from
    a Ray worker), and what each measured.
(b) Sweep fan-out: ``run_sweep`` over the 8 Philly-derived workloads of
    Pollux's artifact (``pollux/workloads``) with Pollux's T4 traces as ground
    truth (``pollux/traces``, cluster ``t4:16x4``, policy ``unaware`` as in the
    README's command; ``--policy`` for another), as local
    worker processes (``--processes 2``) and as Ray tasks on the same instance
    (one CPU each: two at a time on 2 cores), wall seconds of each and whether
    they give the same mean JCT (they must). Without ``../shared/data``:
    synthetic workloads on the built-in catalog.

The instance's start is timed apart (a cluster is started once, not per call).
``--preload-torch`` starts it with Ray's ``preload_python_modules=["torch"]``
(what ``RAY_preload_python_modules=torch ray start`` sets on a real cluster):
idle workers import torch before they are given an actor, so the actor's
start no longer includes it. The default is a cluster as Ray starts it.

Run: ``python -m experiments.bench_ray`` (~13 min on 2 cores); ``--quick``: the
MLP with a 4 s budget and two 24-job workloads; ``--parts profile`` or
``--parts sweep`` for one half. Figures go to
``bench-results/bench_ray_profile.json`` and ``bench_ray_sweep.json``, each as
soon as its part is done.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from experiments.benchutil import parser, report

LABEL = "bench-cpu"


def _profile_facts(profile, gpu_type: str) -> dict:
    info = profile.metadata[f"profiler.{gpu_type}"]
    multi = sum(o.gpu_type == gpu_type and o.num_replicas > 1 for o in profile.observations)
    return {"observations": sum(o.gpu_type == gpu_type for o in profile.observations),
            "sizes": len(info["measured"]), "sync_obs": multi, "inner_s": info["seconds"],
            "sync_s": info["phase_seconds"].get("sync", 0.0)}


def profiling_overhead(names: list[str], budget: float) -> list[dict]:
    from profilers import profile_cluster, profile_job, zoo

    rows = []
    for name in names:
        work = zoo.get(name)
        start = time.perf_counter()
        plain = profile_job(**work.profile_args(), devices="cpu", time_budget_s=budget, progress=False)
        plain_wall = time.perf_counter() - start
        start = time.perf_counter()
        cluster = profile_cluster(**work.profile_args(), gpu_types=[LABEL], time_budget_s=budget, progress=False)
        cluster_wall = time.perf_counter() - start
        ours, theirs = _profile_facts(plain, "cpu"), _profile_facts(cluster, LABEL)
        info = cluster.metadata[f"profiler.{LABEL}"]
        rows.append({
            "what": f"profile {name}", "budget_s": budget,
            "profile_job_wall_s": round(plain_wall, 2), "profile_cluster_wall_s": round(cluster_wall, 2),
            # what the user waits for extra: the headline figure, judged against the target
            "ray_overhead_s": round(cluster_wall - plain_wall, 2), "target_s": 3.0,
            "within_target": cluster_wall - plain_wall <= 3.0,
            "ray_start_s": info["ray_start_s"],
            # Ray's own part: the type's wall seconds in profile_cluster less profile_job's inside the actor (first-call
            # costs of the fresh worker fall inside the latter, as in a fresh process); apart from the wall difference,
            # which also holds where each budget-bound profiling stopped
            "ray_part_s": round(info["ray_wall_s"] - theirs["inner_s"], 2),
            "inner_s (job / cluster)": f"{ours['inner_s']:.1f} / {theirs['inner_s']:.1f}",
            "sync_s (job / cluster)": f"{ours['sync_s']:.1f} / {theirs['sync_s']:.1f}",
            "sizes (job / cluster)": f"{ours['sizes']} / {theirs['sizes']}",
            "sync obs (job / cluster)": f"{ours['sync_obs']} / {theirs['sync_obs']}",
        })
        print(f"  {name}: profile_job {plain_wall:.1f} s, profile_cluster {cluster_wall:.1f} s", flush=True)
    return rows


def _sweep_tasks(quick: bool, policy: str) -> tuple[str, list]:
    from experiments.datasets import default_data_dir
    from experiments.simulator.runner import Task, load_truth, load_workloads
    from goodput.cluster import Cluster

    data = default_data_dir()
    if data is not None and (data / "pollux" / "workloads").is_dir():
        cluster, truth = "t4:16x4", str(data / "pollux" / "traces")
        loads = load_workloads(str(data / "pollux" / "workloads"), {})
        source = "Pollux's 8 workloads, truth: Pollux's T4 traces"
    else:
        cluster, truth = "t4:6x4,a100:2x8,rtx2080ti:3x8", "catalog"
        families = load_truth(truth, Cluster.parse(cluster))
        loads = [w for s in range(8) for w in load_workloads(None, families, synthetic=160, seed=s)]
        source = "8 synthetic 160-job workloads, truth: the built-in catalog"
    if quick:
        loads = [(name, jobs[:24]) for name, jobs in loads[:2]]
    return (f"{source}, cluster {cluster}, policy {policy}",
            [Task(name, tuple(jobs), policy, cluster, truth=truth) for name, jobs in loads])


def sweep_fan_out(quick: bool, policy: str) -> tuple[list[dict], str]:
    from experiments.simulator.runner import run_sweep

    source, tasks = _sweep_tasks(quick, policy)
    rows, jcts = [], {}
    for backend, options in (("processes", {"processes": 2}), ("ray", {"backend": "ray"})):
        start = time.perf_counter()
        results = run_sweep(tasks, **options)
        wall = time.perf_counter() - start
        jcts[backend] = [r.summary["avg_jct_s"] for _, r in results]
        rows.append({"what": f"run_sweep {backend}", "simulations": len(tasks), "wall_s": round(wall, 2),
                     "mean_jct_s": statistics.mean(jcts[backend]),
                     "sim_wall_s_mean": statistics.mean(r.summary["wall_seconds"] for _, r in results)})
        print(f"  {backend}: {wall:.1f} s for {len(tasks)} simulations", flush=True)
    rows.append({"what": "ray wall / processes wall", "value": rows[1]["wall_s"] / rows[0]["wall_s"],
                 "same_jcts": jcts["ray"] == jcts["processes"]})
    return rows, source


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_ray", __doc__)
    p.add_argument("--parts", default="profile,sweep", help="profile, sweep or both (default)")
    p.add_argument("--policy", default="unaware", help="the sweep's policy (default: unaware)")
    p.add_argument("--preload-torch", action="store_true",
                   help="start the instance with Ray's preload_python_modules=['torch'] (idle workers import torch)")
    args = p.parse_args(argv)
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if not parts or parts - {"profile", "sweep"}:
        p.error(f"--parts: expected profile, sweep or both, got {args.parts!r}")
    from profilers.rayutil import local_cluster

    node = {"num_cpus": os.cpu_count() or 1, "resources": {f"accelerator_type:{LABEL}": 1}}
    if args.preload_torch:
        node["_system_config"] = {"preload_python_modules": ["torch"]}
    start = time.perf_counter()
    with local_cluster([node]):
        started = time.perf_counter() - start
        print(f"private Ray instance started in {started:.1f} s", flush=True)
        if "profile" in parts:
            load = os.getloadavg()
            names, budget = (["mlp"], 4.0) if args.quick else (["resnet", "transformer", "mlp"], 20.0)
            rows = profiling_overhead(names, budget)
            report("bench_ray_profile", rows, args,
                   extra={"ray_start_s": round(started, 2), "preload_torch": args.preload_torch, **_loads(load)})
        if "sweep" in parts:
            load = os.getloadavg()
            rows, source = sweep_fan_out(args.quick, args.policy)
            report("bench_ray_sweep", rows, args, extra={"ray_start_s": round(started, 2), "workloads": source, **_loads(load)})
    return 0


def _loads(before: tuple[float, float, float]) -> dict:
    """The host's load averages before and after a part (others' work skews the timings: say how much there was)."""
    after = os.getloadavg()
    print(f"load average before {before[0]:.2f} {before[1]:.2f} {before[2]:.2f}, after {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")
    return {"load_average_before": before, "load_average_after": after}


if __name__ == "__main__":
    sys.exit(main())
