"""``goodput simulate``: trace-driven cluster simulation of scheduling policies."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import console, frame_table

POLICIES = ("sia", "sia-oracle", "unaware", "gavel", "fifo")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from experiments.simulator.runner import DEFAULT_CLUSTER
    from profilers.rayutil import add_ray_option

    parser = subparsers.add_parser(
        "simulate", help="simulate scheduling policies on a workload (trace-driven, MLflow-tracked)",
        description="Simulate a heterogeneous GPU cluster round by round: jobs arrive from a workload CSV (or a "
        "directory of them, run in parallel processes or as Ray tasks with --ray) or a synthetic Philly-like generator, progress by their true "
        "goodput, pay restart costs, and are scheduled by the policies under test on what they can observe.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--workload", help="a workload CSV, or a directory of them (each is simulated)")
    source.add_argument("--synthetic", type=int, metavar="N", help="generate N Philly-like jobs (default: 160)")
    parser.add_argument("--hours", type=float, help="arrival window of a synthetic workload (hours; default 8)")
    parser.add_argument("--policy", default="sia", help=f"policy or comma-separated policies, or 'all' ({', '.join(POLICIES)})")
    parser.add_argument("--goodput-quantile", default="0.5", metavar="Q[,Q...]",
                        help="the allocator reads the online models' tables at this quantile of goodput (< 0.5 "
                        "cautious, > 0.5 optimistic); several, comma-separated, each run as policy-qQ (default 0.5)")
    parser.add_argument("--cluster", default=DEFAULT_CLUSTER, help=f"type:NODESxGPUS,... (default: {DEFAULT_CLUSTER})")
    parser.add_argument("--truth", default="catalog",
                        help="ground truth: 'catalog' (built in), a catalog JSON, or a directory of measured tables")
    parser.add_argument("--gpu-type", default="t4", help="GPU type of measured tables without a type suffix (placements.csv)")
    parser.add_argument("--restart-cost", type=float, metavar="S", dest="restart_cost",
                        help="seconds every job loses per (re)allocation (default: per application: a measured model's "
                        "application.json, else Sia's measured costs by name, else 30)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload and of measurement noise")
    parser.add_argument("--round", type=float, dest="round_s", help="seconds between scheduling rounds (policy default)")
    parser.add_argument("--max-hours", type=float, default=24.0 * 14, help="stop after this much simulated time")
    parser.add_argument("--processes", type=int, help="parallel simulations, >= 1 (default: CPU count)")
    add_ray_option(parser, "run the simulations (workloads x policies)")
    parser.add_argument("--out", default="sim-out", help="output folder (default: sim-out/)")
    parser.add_argument("--experiment", default="goodput-sim", help="MLflow experiment (default: goodput-sim)")
    parser.add_argument("--no-mlflow", action="store_true", help="do not log runs to MLflow")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import contextlib

    import pandas as pd

    from experiments.simulator.runner import Task, check_task, load_truth, load_workloads
    from goodput import tracking
    from goodput.cluster import Cluster
    from goodput.errors import ValidationError
    from goodput.validation import check_int
    from profilers.rayutil import ray_option

    cluster = Cluster.parse(args.cluster)
    policies = list(POLICIES) if args.policy == "all" else list(dict.fromkeys(p.strip() for p in args.policy.split(",") if p.strip()))
    if not policies:
        raise ValidationError("policy", args.policy, f"expected one or more policies ({', '.join(POLICIES)}) or all")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValidationError("policy", unknown[0], f"unknown policy (known: {', '.join(POLICIES)}, all)")
    quantiles = _quantiles(args.goodput_quantile)
    check_int("seed", args.seed, minimum=0)
    if args.synthetic is not None:
        check_int("synthetic", args.synthetic, minimum=1)
    if args.processes is not None:
        check_int("processes", args.processes, minimum=1)
    use_ray, address = ray_option(args)
    if use_ray and args.processes is not None:
        raise ValidationError("processes", args.processes, "sets local worker processes; with --ray, Ray places the simulations")
    if args.workload and args.hours is not None:
        raise ValidationError("hours", args.hours, "sets the arrival window of a synthetic workload only; "
                              "a --workload CSV gives its own arrival times")

    config = {"max_hours": args.max_hours}
    if args.restart_cost is not None:
        config["restart_cost_s"] = args.restart_cost

    def task(name: str, jobs: tuple, policy: str, q: float) -> Task:
        return Task(name, jobs, policy, str(cluster), truth=args.truth, default_gpu_type=args.gpu_type,
                    seed=args.seed, round_s=args.round_s, config=dict(config),
                    policy_options={} if q == 0.5 else {"goodput_quantile": q})

    for policy in policies:  # --round, --max-hours, ...: refused here, before the workload and the worker processes
        for q in quantiles:
            check_task(task("", (), policy, q))
    out = console()
    skipped: dict[str, str] = {}
    hours = 8.0 if args.hours is None else args.hours
    if args.workload:  # only the workloads' applications are loaded from the truth
        workloads = load_workloads(args.workload, {}, seed=args.seed, hours=hours)
        applications = {job.application for _, jobs in workloads for job in jobs}
        families = load_truth(args.truth, cluster, args.gpu_type, applications=applications, skipped=skipped)
    else:
        families = load_truth(args.truth, cluster, args.gpu_type, skipped=skipped)
        workloads = load_workloads(None, families, synthetic=args.synthetic or 0, seed=args.seed, hours=hours)
    for name, reason in skipped.items():
        out.print(f"truth: skipped {name}: {reason}", markup=False, highlight=False, soft_wrap=True)
    tasks = [task(name, tuple(jobs), policy, q) for name, jobs in workloads for policy in policies for q in quantiles]
    for each in tasks:  # a workload the simulator would refuse fails here, before any simulation runs
        check_task(each, families)
    out.print(f"simulating {len(workloads)} workload(s) x {len(policies)} polic(ies) x {len(quantiles)} quantile(s) on {cluster} "
              f"({cluster.total_gpus} GPUs), truth: {args.truth}")
    params = {"truth": args.truth} if args.workload else {"truth": args.truth, "arrival_hours": hours}
    rows = []
    with contextlib.ExitStack() as stack:
        parent_id = None
        if not args.no_mlflow and len(tasks) > 1:  # RUNNING until the sweep ends: KILLED on Ctrl-C, FAILED on an error
            parent_id = stack.enter_context(tracking.parent_run(
                args.experiment, f"sweep:{','.join(policies)}",
                {"policies": policies, "workloads": [w for w, _ in workloads], "cluster": str(cluster),
                 "seed": args.seed, "goodput_quantiles": quantiles, **params}))
        _sweep(args, tasks, out, rows, params, parent_id, use_ray, address)

    frame = pd.DataFrame(rows).sort_values(["workload", "policy"])
    out.print(frame_table(frame, title="simulation results (times in seconds)"))
    if len(workloads) > 1:
        means = frame.groupby("policy")[["avg_jct_s", "makespan_s", "unfair_fraction"]].agg(["mean", "std"]).reset_index()
        means.columns = [" ".join(c).strip() for c in means.columns]
        out.print(frame_table(means, title="mean and std over workloads"))
    out.print(f"outputs in {args.out}/<workload>/<policy>/" + ("" if args.no_mlflow else
              f"; MLflow experiment {args.experiment!r} at {tracking.tracking_uri()}"))
    return 0


def _quantiles(text: str) -> list[float]:
    """``"0.25,0.5"`` → ``[0.25, 0.5]``, each in (0, 1)."""
    from goodput.errors import ValidationError
    from goodput.validation import check_quantile

    values = []
    for part in (p.strip() for p in str(text).split(",")):
        try:
            value = float(part)
        except ValueError:
            raise ValidationError("goodput_quantile", part, "expected a number in (0, 1)") from None
        values.append(check_quantile("goodput_quantile", value))
    return list(dict.fromkeys(values))


def _sweep(args: argparse.Namespace, tasks: list, out: Any, rows: list, params: dict[str, Any], parent_id: str | None,
           use_ray: bool, address: str | None) -> None:
    """Run the tasks, writing each result's files (and its MLflow run, a child of ``parent_id``) as it comes."""
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from experiments.simulator.report import log_result, write_outputs
    from experiments.simulator.runner import Task, run_sweep

    with Progress(TextColumn("[bold]simulations"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=out, transient=False) as bar:
        progress_task = bar.add_task("sim", total=len(tasks))

        def done(task: Task, result) -> None:
            label = result.settings["policy"]  # the policy's name, with its goodput quantile when not 0.5
            folder = Path(args.out) / task.workload_name / label
            write_outputs(result, folder, task.workload_name)
            if not args.no_mlflow:
                log_result(result, task.workload_name, folder, experiment=args.experiment,
                           params=params, parent_run_id=parent_id)
            rows.append({"workload": task.workload_name, "policy": label, **{
                k: result.summary.get(k) for k in ("finished", "avg_jct_s", "median_jct_s", "p99_jct_s", "makespan_s",
                                                   "restarts_per_job", "unfair_fraction", "wall_seconds")}})
            bar.advance(progress_task)

        run_sweep(tasks, processes=args.processes, on_done=done, backend="ray" if use_ray else "processes", address=address)
