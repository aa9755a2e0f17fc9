"""Simulator scale (issue 35, item 5): a 2048-GPU cluster, 1000+ active jobs, 24 h of arrivals.

Cluster: Sia's 64-GPU three-type cluster (``t4:6x4,a100:2x8,rtx2080ti:3x8``)
scaled 32-fold, ``t4:192x4,a100:64x8,rtx2080ti:96x8`` (2048 GPUs). Ground
truth: the built-in catalog. Workload: the synthetic Philly-like generator
(:func:`experiments.simulator.workload.synthetic_workload`: arrival times
drawn from the Microsoft Philly trace's hour-of-day profile, applications from
the mix of Pollux's Philly-derived workloads, requested GPUs from Philly's
distribution), ``--jobs`` arrivals over 24 h (seed 0), simulated in 60 s rounds
for ``--hours`` (24: the arrival window; jobs still running then are counted
unfinished).

Policy: ``sia-oracle`` — Sia's goodput ILP on true goodput tables (each job's
table refreshed when its gradient noise has moved 5%), through
:func:`goodput.allocate` with ``exact_limit=--exact-limit`` (default 0: every
round takes the fast path's answer, whose certified gap is recorded; with the
allocator's default, 20,000, rounds of 300–900 active jobs that the fast path
cannot certify within 1e-6 spend 1–8 s each in HiGHS on the reduced problem,
too many for a 10-minute day). Online
Bayesian models (policy ``sia``) cannot be afforded at this scale with
today's model: ``--online-rounds`` runs the same workload with them for a few
rounds and reports what the models cost per job and per round, so that the
cost can be extrapolated.

Reports: wall time; rounds; active jobs per round (mean, max, share of rounds
with 1000 or more); utilisation; where each round's time went (the policy's
``allocate`` call with building its inputs, the goodput tables, the rest of
the simulator); ``allocate``'s wall time per round where 1000+ jobs are active
(median, p95), the solvers used and their certified gaps; and, for
``--milp-samples`` such rounds, the distance of the answer from the exact MILP
optimum (HiGHS, ``--milp-time-limit``). Targets: 24 h in ≤ 10 min of wall
time, ``allocate`` ≤ 100 ms median at 1000+ active jobs.

Run: ``python -m experiments.bench_scale [--quick] [--jobs 50000] [--hours 24] [--exact-limit N]
[--milp-samples 3] [--online-rounds 10]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from experiments.benchutil import check_options, parser, report
from goodput.cluster import Cluster

BASE = ((("t4", 6, 4), ("a100", 2, 8), ("rtx2080ti", 3, 8)))
THRESHOLD = 1000  # active jobs that make a round count as "at scale"


def scaled_cluster(factor: int) -> Cluster:
    """Sia's 64-GPU cluster with ``factor`` times the nodes of each type."""
    return Cluster.parse(",".join(f"{t}:{n * factor}x{g}" for t, n, g in BASE))


def _pct(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class _Recorder:
    """Wraps a simulation's policy and tables: wall time per round and part, allocate's facts, sampled inputs."""

    def __init__(self, sim: Any, threshold: int, keep: int) -> None:
        self.sim, self.threshold, self.keep = sim, threshold, max(keep, 1)
        self.seen, self.stride = 0, 1
        self.rounds: list[dict[str, Any]] = []
        self.samples: list[tuple[Any, ...]] = []
        self.table_s = 0.0
        self._round_start = time.perf_counter()
        self._tables_at_start = 0.0
        policy, table, refresh = sim.policy, sim._table, sim._refresh_truth_tables
        decide = policy.decide

        def timed_table(job: Any) -> Any:
            start = time.perf_counter()
            try:
                return table(job)
            finally:
                self.table_s += time.perf_counter() - start

        def timed_refresh(jobs: Any) -> Any:
            start = time.perf_counter()
            try:
                return refresh(jobs)
            finally:
                self.table_s += time.perf_counter() - start

        def timed_decide(now: float, cluster: Cluster, views: list) -> Any:
            import goodput.allocator.api as api

            captured: dict[str, Any] = {}
            allocate = api.allocate

            def capture(tables, cluster, current=None, p=-0.5, **options):  # type: ignore[no-untyped-def]
                start = time.perf_counter()
                result = allocate(tables, cluster, current, p=p, **options)
                captured.update(seconds=time.perf_counter() - start, tables=tables, current=current, p=p,
                                options=options)
                return result

            import experiments.simulator.policies as policies

            policies.allocate = capture
            start = time.perf_counter()
            try:
                decision = decide(now, cluster, views)
            finally:
                policies.allocate = allocate
            info = policy.last_info
            record = {"active": len(views), "decide_s": time.perf_counter() - start,
                      "allocate_s": captured.get("seconds", 0.0), "solver": info.solver, "gap": info.gap,
                      "binaries": info.num_variables, "objective": info.objective}
            self.rounds.append(record)
            if record["active"] >= self.threshold:
                self.seen += 1
                if (self.seen - 1) % self.stride == 0:  # every stride-th round at scale
                    self.samples.append((captured["tables"], cluster, captured["current"], captured["p"],
                                         captured["options"], info))
                    if len(self.samples) > 2 * self.keep:  # thin out: keep the memory bounded, the picks even
                        self.samples, self.stride = self.samples[::2], self.stride * 2
            return decision

        sim._table, sim._refresh_truth_tables = timed_table, timed_refresh
        policy.decide = timed_decide

    def progress(self, now: float, finished: int, total: int) -> None:
        """Called by the simulator at the end of each round: the round's wall time and table time."""
        end = time.perf_counter()
        if self.rounds:
            record = self.rounds[-1]
            record["round_s"] = end - self._round_start
            record["tables_s"] = self.table_s - self._tables_at_start
            record["finished"] = finished
        self._round_start, self._tables_at_start = end, self.table_s


def _milp_distance(samples: list[tuple[Any, ...]], time_limit: float) -> list[dict[str, Any]]:
    """Each sampled round's answer against the exact MILP optimum of the same problem."""
    from goodput.allocator.problem import prepare, sia_problem
    from goodput.allocator.sia import solve_milp

    out = []
    for tables, cluster, current, p, options, info in samples:
        problem = sia_problem(prepare(tables, cluster, current, options.get("jobs")), p, options.get("lam", 1.1))
        exact = solve_milp(problem, time_limit=time_limit)
        row = {"jobs": len(tables), "binaries": problem.num_options, "solver": info.solver, "certified_gap": info.gap,
               "milp_status": exact.status if exact else "no solution", "milp_s": exact.seconds if exact else None}
        if exact is not None:
            optimum = problem.objective(exact.total)
            sign = 1.0 if problem.sense == "minimize" else -1.0
            row["vs_milp"] = sign * (info.objective - optimum) / max(abs(optimum), 1e-9)  # > 0: worse than the MILP's
        out.append(row)
    return out


def _online_cost(jobs: list, families: dict, cluster: Cluster, rounds: int) -> dict[str, Any]:
    """The same workload with online JobModels (policy ``sia``) for a few rounds: seconds spent in the models."""
    import functools

    from experiments.simulator.engine import SimConfig, Simulator
    from experiments.simulator.policies import make_policy
    from goodput.model import JobModel

    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    depth = [0]
    saved = {name: getattr(JobModel, name) for name in ("observe", "refit", "table", "goodput")}

    def wrap(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:  # outermost model call only: a refit inside table() counts once
                    spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
                    calls[name] = calls.get(name, 0) + 1

        return timed

    refits_before = 0
    for name, fn in saved.items():
        setattr(JobModel, name, wrap(name, fn))
    try:
        # the simulation's clock starts at the round boundary before the first arrival, its first round at the one
        # after (unless the arrival is on a boundary): without that round counted, N rounds had run N - 1
        first = min(job.time for job in jobs)
        extra = 0 if first % 60.0 == 0 else 1
        sim = Simulator(jobs, families, SimConfig(cluster=cluster, max_hours=(rounds + extra) / 60.0), make_policy("sia"))
        start = time.perf_counter()
        result = sim.run()
        wall = time.perf_counter() - start
        models = [j.model for j in sim.jobs if j.model is not None]
        refits = sum(m.refits for m in models) - refits_before
    finally:
        for name, fn in saved.items():
            setattr(JobModel, name, fn)
    model_s = sum(spent.values())
    bootstrapped = len(models)
    return {"rounds": len(result.rounds), "wall_s": wall, "model_s": model_s, "jobs_with_models": bootstrapped,
            "refits": refits, "model_s_per_job": model_s / max(bootstrapped, 1),
            "model_s_per_round": model_s / max(len(result.rounds), 1),
            "active_mean": float(result.rounds["active"].mean()) if len(result.rounds) else 0.0,
            "spent": spent, "calls": calls}


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_scale", __doc__)
    p.add_argument("--factor", type=int, default=None, help="nodes per type × this (default 32: 2048 GPUs; --quick 4)")
    p.add_argument("--jobs", type=int, default=None, help="arrivals (default 50000; --quick 600)")
    p.add_argument("--hours", type=float, default=None, help="simulated hours (default 24; --quick 0.5)")
    p.add_argument("--arrival-hours", type=float, default=None, help="the arrivals' window (default 24; --quick 1)")
    p.add_argument("--exact-limit", type=int, default=0,
                   help="allocate's exact_limit (default 0: the fast path's answer and its certified gap every round; "
                   "the allocator's own default, 20000, runs the MILP on the rounds the fast path cannot certify)")
    p.add_argument("--milp-samples", type=int, default=None, help="rounds compared with the exact MILP (default 3)")
    p.add_argument("--milp-time-limit", type=float, default=120.0, help="seconds per exact MILP (default 120)")
    p.add_argument("--online-rounds", type=int, default=None, help="rounds with online models (default 10; 0: skip)")
    p.add_argument("--threshold", type=int, default=None, help=f"active jobs of a round at scale (default {THRESHOLD})")
    p.add_argument("--save-rounds", action="store_true",
                   help="also pickle the sampled rounds' allocate inputs to OUT_DIR/bench_scale-rounds.pkl (for profiling)")
    args = p.parse_args(argv)
    check_options(p, args, at_least={"factor": 1, "jobs": 1, "threshold": 1, "milp_samples": 0, "online_rounds": 0,
                                     "exact_limit": 0},
                  positive=["hours", "arrival_hours", "milp_time_limit"])  # before the simulation (minutes at full size)
    factor = args.factor if args.factor is not None else (4 if args.quick else 32)
    hours = args.hours if args.hours is not None else (0.5 if args.quick else 24.0)
    n_jobs = args.jobs if args.jobs is not None else (50000 * factor // 32 if not args.quick else 600)
    arrival_hours = args.arrival_hours if args.arrival_hours is not None else (1.0 if args.quick else 24.0)
    threshold = args.threshold if args.threshold is not None else (50 if args.quick else THRESHOLD)
    milp_samples = args.milp_samples if args.milp_samples is not None else (1 if args.quick else 3)
    online_rounds = args.online_rounds if args.online_rounds is not None else (2 if args.quick else 10)

    from experiments.simulator.engine import SimConfig, Simulator
    from experiments.simulator.policies import make_policy
    from experiments.simulator.truth import catalog_workload_stats, load_catalog
    from experiments.simulator.workload import synthetic_workload

    cluster = scaled_cluster(factor)
    families = load_catalog(gpu_types=cluster.gpu_types)
    jobs = synthetic_workload(catalog_workload_stats(), families, num_jobs=n_jobs, hours=arrival_hours, seed=0)
    options = {"exact_limit": args.exact_limit}
    load_before = os.getloadavg()
    print(f"{cluster} ({cluster.total_gpus} GPUs), {n_jobs} jobs over {arrival_hours:g} h, simulating {hours:g} h with sia-oracle "
          f"{options or ''}; load average {load_before[0]:.2f}", flush=True)

    sim = Simulator(jobs, families, SimConfig(cluster=cluster, max_hours=hours), make_policy("sia-oracle", **options))
    recorder = _Recorder(sim, threshold, keep=milp_samples)
    last_print = [time.perf_counter()]

    def progress(now: float, finished: int, total: int) -> None:
        recorder.progress(now, finished, total)
        if time.perf_counter() - last_print[0] > 30:
            last_print[0] = time.perf_counter()
            r = recorder.rounds[-1]
            print(f"  {now / 3600:5.2f} h: {r['active']} active, {finished} finished, round {r.get('round_s', 0):.2f} s "
                  f"(allocate {r['allocate_s'] * 1e3:.0f} ms, {r['solver']}), load {os.getloadavg()[0]:.1f}", flush=True)

    sim.progress = progress
    start = time.perf_counter()
    result = sim.run()
    wall = time.perf_counter() - start
    load_after = os.getloadavg()

    rounds = [r for r in recorder.rounds if "round_s" in r]
    at_scale = [r for r in rounds if r["active"] >= threshold]
    active = [r["active"] for r in rounds]
    # sample evenly among the rounds at scale (the recorder kept every one's inputs: keep milp_samples of them)
    samples = recorder.samples
    if samples and milp_samples:
        picks = np.linspace(0, len(samples) - 1, min(milp_samples, len(samples))).round().astype(int)
        samples = [samples[i] for i in sorted(set(picks.tolist()))]
    else:
        samples = []
    recorder.samples = []
    if args.save_rounds and samples:
        import pickle
        from pathlib import Path

        from goodput.io import atomic_write_bytes

        # (tables, cluster, current, p, options, info) per sampled round; atomically: a run that dies keeps the last
        atomic_write_bytes(Path(args.out_dir) / "bench_scale-rounds.pkl", pickle.dumps(samples))
    distances = _milp_distance(samples, args.milp_time_limit)

    total_allocate = sum(r["decide_s"] for r in rounds)
    total_tables = sum(r["tables_s"] for r in rounds)
    gaps = [r["gap"] for r in at_scale if r["gap"] is not None]
    solvers: dict[str, int] = {}
    for r in at_scale:
        solvers[r["solver"]] = solvers.get(r["solver"], 0) + 1
    summary = result.summary
    n_rounds = max(len(rounds), 1)
    allocate_ms = [r["allocate_s"] * 1e3 for r in at_scale]

    def row(what: str, value: Any, target: Any = None, note: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {"what": what, "value": value}
        if target is not None:
            out["target"] = target
        if note:
            out["note"] = note
        return out

    arrived = sum(1 for j in jobs if j.time <= hours * 3600)
    rows: list[dict[str, Any]] = [
        row("wall seconds", round(wall, 1), 600.0 if factor == 32 and hours >= 24 else None,
            f"{cluster.total_gpus} GPUs, {len(rounds)} rounds of 60 s, load {load_before[0]:.2f} -> {load_after[0]:.2f}"),
        row("active jobs per round: mean / max", f"{statistics.mean(active):.0f} / {max(active)}" if active else "-",
            note=f"{len(at_scale)} rounds ({len(at_scale) / n_rounds:.0%}) with {threshold}+ active"),
        row("jobs finished / arrived", f"{summary.get('finished')} / {arrived}"),
        row("utilisation (mean)", round(float(result.rounds["utilization"].mean()), 3)),
        row("seconds per round: policy (allocate + inputs)", round(total_allocate / n_rounds, 4),
            note=f"{total_allocate / wall:.0%} of the wall time"),
        row("seconds per round: goodput tables", round(total_tables / n_rounds, 4), note=f"{total_tables / wall:.0%}"),
        row("seconds per round: rest of the simulator", round((wall - total_allocate - total_tables) / n_rounds, 4)),
        row(f"allocate ms at {threshold}+ active: median / p95",
            f"{statistics.median(allocate_ms):.0f} / {_pct(allocate_ms, 0.95):.0f}" if allocate_ms else "-",
            100.0 if allocate_ms else None,
            f"binaries median {statistics.median([r['binaries'] for r in at_scale]):.0f}; solvers {solvers}"
            if at_scale else ""),
        row(f"certified gap at {threshold}+ active: median / max / share <= 1e-6",
            f"{statistics.median(gaps):.1e} / {max(gaps):.1e} / {sum(g <= 1e-6 for g in gaps) / len(gaps):.0%}"
            if gaps else "-"),
    ]
    for d in distances:
        vs = d.get("vs_milp")
        rows.append(row(f"vs exact MILP, a round of {d['jobs']} jobs", "-" if vs is None else f"{vs:+.1e}",
                        note=f"{d['binaries']} binaries; ours {d['solver']} (certified gap {d['certified_gap']:.1e}); "
                        f"MILP {d['milp_status']} in {d['milp_s'] or 0:.1f} s"))
    online = None
    if online_rounds:
        print(f"online models: the same workload with policy sia for {online_rounds} rounds", flush=True)
        online = _online_cost(jobs, families, cluster, online_rounds)
        rows.append(row(f"online models (sia), first {online['rounds']} rounds: model seconds",
                        round(online["model_s"], 1),
                        note=f"{online['jobs_with_models']} jobs modelled, {online['refits']} refits, "
                        f"{online['model_s_per_job']:.2f} s per job, {online['model_s_per_round']:.1f} s per round "
                        f"({online['active_mean']:.0f} active); simulation wall {online['wall_s']:.0f} s"))
    report("bench_scale", rows, args, extra={
        "cluster": str(cluster), "policy": "sia-oracle", "allocate_options": options, "workload": {
            "generator": "synthetic_workload (Philly hour-of-day arrivals, Pollux application mix, Philly GPU counts)",
            "jobs": n_jobs, "hours_of_arrivals": arrival_hours, "seed": 0},
        "threshold": threshold, "load_average_before": load_before, "load_average_after": load_after,
        "active_per_round": active, "round_s": [r["round_s"] for r in rounds],
        "allocate_s": [r["allocate_s"] for r in rounds], "solvers_at_scale": solvers, "milp_distances": distances,
        "online": online, "summary": {k: v for k, v in summary.items() if isinstance(v, (int, float, str))}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
