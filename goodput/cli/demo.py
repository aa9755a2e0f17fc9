"""``goodput demo``: profile a zoo model for real, fit its model, print its goodput table (``make demo``).

The demo measures a built-in job (default: the ResNet-style CNN of
:mod:`profilers.zoo`) on the devices present — every CUDA type, else the CPU
with 2 gloo replicas — with :func:`profilers.profile_job`, fits the job's
:class:`~goodput.JobModel` from the profile, and prints the fitted Pollux
parameters and the goodput table. The table covers the device types that were
profiled, so the cluster is an *example shape* built from them (2 nodes of
each type, as many devices per node as replicas were profiled), unless
``--cluster`` names one. The run is logged to MLflow.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ._common import cluster_arg, console, frame_table


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="profile a zoo model for real, fit it, print its goodput table",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", default="resnet", help="built-in job to profile: resnet, transformer, mlp (default resnet)")
    parser.add_argument("--time-budget", type=float, default=15.0, help="profiling seconds per device type (default 15)")
    parser.add_argument("--replicas", type=int, default=None, help="replicas for synchronisation profiling (default: 2 on a CPU host)")
    parser.add_argument("--cluster", type=cluster_arg, default=None,
                        help="cluster for the table (default: an example shape built from the profiled types)")
    parser.add_argument("--out", help="keep the profile in this JSON Lines file (default: a temporary one)")
    parser.add_argument("--no-mlflow", action="store_true", help="do not log the run to MLflow")
    parser.set_defaults(func=run)


def example_cluster(profile) -> str:
    """``type:2xR`` for every profiled type, R = the most replicas profiled on it (at least 1)."""
    parts = []
    for gpu in profile.gpu_types:
        replicas = max(o.num_replicas for o in profile.observations if o.gpu_type == gpu)
        parts.append(f"{gpu}:2x{replicas}")
    return ",".join(parts)


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from goodput import Cluster, JobModel
    from profilers import profile_job, zoo

    out = console()
    work = zoo.get(args.zoo)
    out.rule(f"[bold]goodput demo[/] — profiling {work.job} for real on this machine")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.out) if args.out else Path(tmp) / f"{work.job}.jsonl"
        replicas = None if args.replicas is None else ([] if args.replicas <= 1 else [args.replicas])
        profile = profile_job(**work.profile_args(), time_budget_s=args.time_budget, replicas=replicas,
                              out=path, progress=True, console=out)
        model = JobModel.from_profile(profile)
        if args.cluster is not None:
            cluster, label = args.cluster, f"cluster {args.cluster}"
        else:
            spec = example_cluster(profile)
            cluster = Cluster.parse(spec)
            label = f"example cluster shape {spec} (built from the profiled device types: the table covers only those)"
        table = model.table(cluster)
        params = pd.DataFrame([{"gpu_type": g, **model.params(g).to_dict()} for g in model.gpu_types])
        params["fixed"] = params["fixed"].map(lambda f: ",".join(f) or "-")
        params = params.rename(columns={"fixed": "set by prior"})
        out.print(frame_table(params, title=f"{work.job}: fitted Pollux parameters (seconds) — from the measurements above"))
        shown = table.frame.drop(columns=["throughput", "step_time"])
        out.print(frame_table(shown, title=f"{work.job}: goodput (samples/s × efficiency) on the {label}"))
        if table.missing_gpu_types:
            out.print(f"no observations for {', '.join(table.missing_gpu_types)}: left out of the table")
        if model.has_gradient_stats:
            phi = work.init_batch_size * model.grad_var / model.grad_sqr
            out.print(f"gradient noise scale at M0={model.init_batch_size}: {phi:.3g} samples (measured at initialisation)")
        if not args.no_mlflow:
            import mlflow

            from goodput import tracking
            from profilers.tracking import log_profile

            with tracking.start_run("goodput-demo", run_name=work.job) as run:
                log_profile(profile, path=path)
                mlflow.log_param("cluster", str(cluster))
                mlflow.log_param("data", f"measured: profile_job on {', '.join(profile.gpu_types)}")
                tracking.log_table(table)
            out.print(f"logged MLflow run {run.info.run_id} to {tracking.tracking_uri()}")
    return 0
