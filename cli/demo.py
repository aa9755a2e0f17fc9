"""``goodput demo``: the main pipeline on the embedded defaults (``make demo``).

1. **Profile** built-in jobs (default: the ResNet-style CNN and the MLP of
   :mod:`profilers.zoo`) for real on the devices present — every CUDA type,
   else the CPU with 2 gloo replicas — with :func:`profilers.profile_job`.
2. **Model** each job: fit its :class:`~goodput.JobModel` from its profile.
3. **Goodput tables** over a cluster. The tables cover the device types that
   were profiled, so the cluster is an *example shape* built from them (2 nodes
   of each type, as many devices per node as replicas were profiled), unless
   ``--cluster`` names one.
4. **Allocate** the cluster between the jobs with Sia's policy
   (:func:`goodput.allocate`) and print the allocation and its placement.
5. **Track** everything in MLflow (``sqlite:///mlflow.db`` by default): one run
   with a child run per job's profile, the tables and the allocation.
6. **Serve** (unless ``--no-serve``): start ``goodput serve`` in this process on
   127.0.0.1 and a free port with a temporary store, post the profiles to it as
   running jobs would, and ask it for the allocated configurations' goodput
   (the same numbers as the tables above: the service runs the same model).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ._common import cluster_arg, console, frame_table


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="profile built-in jobs for real, fit, tabulate goodput, allocate",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", default="resnet,mlp",
                        help="built-in jobs to profile, comma-separated: resnet, transformer, mlp (default resnet,mlp)")
    parser.add_argument("--time-budget", type=float, default=10.0,
                        help="profiling seconds per job and device type (default 10)")
    parser.add_argument("--replicas", type=int, default=None,
                        help="replicas for synchronisation profiling; 0 or 1: none, a single replica has nothing to "
                        "synchronise (default: 2 on a CPU host, powers of two up to the GPUs of a CUDA type)")
    parser.add_argument("--cluster", type=cluster_arg, default=None,
                        help="cluster for the tables and the allocation (default: an example shape built from the profiled types)")
    parser.add_argument("--out", help="keep the profiles in this folder, one <job>.jsonl each (default: a temporary folder)")
    parser.add_argument("--no-mlflow", action="store_true", help="do not log the run to MLflow")
    parser.add_argument("--no-serve", action="store_true", help="do not start goodput serve and query it")
    parser.set_defaults(func=run)


def example_cluster(profiles) -> str:
    """``type:2xR`` for every profiled type, R = the most replicas profiled on it (at least 1)."""
    replicas: dict[str, int] = {}
    for profile in profiles if isinstance(profiles, (list, tuple)) else [profiles]:
        for obs in profile.observations:
            replicas[obs.gpu_type] = max(replicas.get(obs.gpu_type, 1), obs.num_replicas)
    return ",".join(f"{gpu}:2x{count}" for gpu, count in replicas.items())


def _check_cluster_profiled(cluster, gpu_types) -> None:
    """The cluster must hold a profiled type: its goodput tables would be empty otherwise."""
    from goodput.errors import ValidationError

    if not set(cluster.gpu_types) & set(gpu_types):
        raise ValidationError("cluster", str(cluster), f"none of its GPU type(s) {', '.join(cluster.gpu_types)} is "
                              f"profiled here; the demo profiles {', '.join(gpu_types)} (or omit --cluster)")


def _params_frame(model):
    import pandas as pd

    params = pd.DataFrame([{"gpu_type": g, **model.params(g).to_dict()} for g in model.gpu_types])
    if "fixed" not in params:
        params["fixed"] = [()] * len(params)
    params["fixed"] = params["fixed"].map(lambda f: ",".join(f) or "-")
    return params.rename(columns={"fixed": "set by prior"})


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from goodput import Cluster, JobModel, allocate
    from goodput.efficiency import describe_noise_scale, noise_scale_resolved
    from goodput.errors import ValidationError
    from goodput.validation import check_int
    from profilers import profile_job, zoo
    from profilers.devices import resolve_devices

    out = console()
    names = [n.strip() for n in args.zoo.split(",") if n.strip()]
    if not names:
        raise ValidationError("zoo", args.zoo, "expected built-in jobs, comma-separated: resnet, transformer, mlp")
    workloads = [zoo.get(name) for name in names]
    if args.replicas is not None:
        check_int("replicas", args.replicas, minimum=0)
    replicas = None if args.replicas is None else ([] if args.replicas <= 1 else [args.replicas])
    if args.cluster is not None:
        _check_cluster_profiled(args.cluster, [d.gpu_type for d in resolve_devices(None)])
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.out) if args.out else Path(tmp)
        profiles, paths = [], []
        for work in workloads:
            out.rule(f"[bold]goodput demo[/] — profiling {work.job} for real on this machine")
            path = folder / f"{work.job}.jsonl"
            profiles.append(profile_job(**work.profile_args(), time_budget_s=args.time_budget, replicas=replicas,
                                        out=path, progress=True, console=out))
            paths.append(path)
        if args.cluster is not None:
            cluster, label = args.cluster, f"cluster {args.cluster}"
        else:
            spec = example_cluster(profiles)
            cluster = Cluster.parse(spec)
            label = f"example cluster shape {spec} (built from the profiled device types: the tables cover only those)"
        models = [JobModel.from_profile(p) for p in profiles]
        tables = {}
        for work, model in zip(workloads, models):
            tables[model.job] = table = model.table(cluster)
            _check_cluster_profiled(cluster, model.gpu_types)
            out.print(frame_table(_params_frame(model),
                                  title=f"{work.job}: fitted Pollux parameters (seconds) — from the measurements above"))
            shown = table.frame.drop(columns=["throughput", "step_time"])
            out.print(frame_table(shown, title=f"{work.job}: goodput (samples/s × efficiency) on the {label}"))
            if table.missing_gpu_types:
                out.print(f"no observations for {', '.join(table.missing_gpu_types)}: left out of the table")
            if model.has_gradient_stats:
                phi = describe_noise_scale(model.grad_sqr, model.grad_var, model.init_batch_size)
                if noise_scale_resolved(model.grad_sqr):
                    out.print(f"gradient noise scale at M0={model.init_batch_size}: {phi} samples (measured at initialisation)")
                else:
                    out.print(f"gradient noise scale at M0={model.init_batch_size}: {phi}: in the profiling budget the "
                              "gradient's noise hid its mean, so statistical efficiency is taken as 1 at every batch "
                              "size until a running job's own estimates resolve it")
        allocation = allocate(tables, cluster)
        rows = []
        for job, alloc in allocation.items():
            row = tables[job].lookup(*alloc.configuration) if alloc is not None else None
            rows.append({
                "job": job,
                "gpu_type": alloc.gpu_type if alloc else "-",
                "num_gpus": alloc.num_gpus if alloc else 0,
                "placement": ", ".join(f"{n}:{g}" for n, g in sorted(alloc.placement.items())) if alloc else "-",
                "batch_size": row["batch_size"] if row else 0,
                "local_bsz": row["local_bsz"] if row else 0,
                "accum_steps": row["accum_steps"] if row else 0,
                "goodput": row["goodput"] if row else 0.0,
                "why not": allocation.unallocated.get(job, ""),
            })
        info = allocation.info
        out.print(frame_table(pd.DataFrame(rows), title=f"allocation on the {label} — Sia's policy, "
                              f"{info.solver}, objective {info.objective:.4g}, {info.wall_time * 1e3:.1f} ms"))
        if not args.no_mlflow:
            import mlflow

            from goodput import tracking
            from profilers.tracking import log_profile

            with tracking.start_run("goodput-demo", run_name="+".join(m.job for m in models)) as run:
                mlflow.log_param("cluster", str(cluster))
                mlflow.log_param("jobs", ",".join(m.job for m in models))
                mlflow.log_param("data", f"measured: profile_job on {', '.join(profiles[0].gpu_types)}")
                for model, table in tables.items():
                    tracking.log_table(table, prefix=f"{model}.")
                tracking.log_json_artifact(allocation.to_dict(), "allocation.json")
                for profile, path in zip(profiles, paths):
                    log_profile(profile, path=path, experiment="goodput-demo", nested=True)
            out.print(f"logged MLflow run {run.info.run_id} to {tracking.tracking_uri()}")
        if not args.no_serve:
            _serve_and_query(out, profiles, allocation, tables, Path(tmp))
    return 0


def _serve_and_query(out, profiles, allocation, tables, folder: Path) -> None:
    """Start the service briefly, post the profiles, ask it for each allocated configuration's goodput."""
    import time

    import pandas as pd

    from goodput.client import Client, NotReadyError
    from service import create_app
    from service.server import BackgroundServer

    out.rule("[bold]goodput demo[/] — the same models behind goodput serve")
    started = time.perf_counter()
    app = create_app(f"sqlite:///{folder / 'goodput.db'}", coalesce_s=0, min_interval_s=0)
    rows = []
    with BackgroundServer(app) as server, Client(server.url) as client:
        for profile in profiles:
            client.put_job(profile.job, profile.init_batch_size, profile.max_batch_size,
                           {gpu: (1, high) for gpu, high in profile.max_local_bsz.items()} or None)
            answer = client.post_observations(profile.job, profile.observations)
            out.print(f"POST /v1/jobs/{profile.job}/observations: {answer}")
        for job, alloc in allocation.items():
            if alloc is None:
                continue
            deadline = time.monotonic() + 120
            while True:
                try:
                    served = client.goodput(job, alloc.gpu_type, alloc.num_nodes, alloc.num_gpus)
                    break
                except NotReadyError:  # the service is building the job's model from what was posted
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            local = tables[job].lookup(*alloc.configuration)
            rows.append({"job": job, "query": f"GET /v1/jobs/{job}/goodput?gpu_type={alloc.gpu_type}"
                         f"&num_nodes={alloc.num_nodes}&num_gpus={alloc.num_gpus}",
                         "goodput (service)": served["goodput"], "goodput (in process)": local["goodput"],
                         "batch_size": served["batch_size"]})
    out.print(frame_table(pd.DataFrame(rows), title=f"goodput serve on {server.url}, "
                          f"{time.perf_counter() - started:.1f} s from start to answers"))
