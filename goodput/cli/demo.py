"""``goodput demo``: the main job on the embedded defaults (``make demo``).

Until the profilers land, the demo runs the pipeline that exists on an
EXAMPLE job: its throughput parameters below are illustrative numbers chosen
for the demo, NOT measurements, and every printout says so. Observations are
generated from them with 3% noise, then fitted, turned into a goodput table and
logged to MLflow.
"""

from __future__ import annotations

import argparse

from ._common import EXAMPLE_CLUSTER, cluster_arg, console, frame_table

# Illustrative parameters (seconds) of an example job on two GPU types — not measured.
EXAMPLE_PARAMS = {
    "t4": dict(alpha_c=0.020, beta_c=0.0008, alpha_n=0.12, beta_n=0.004, alpha_r=0.030, beta_r=0.0015, gamma=1.8),
    "a100": dict(alpha_c=0.006, beta_c=0.0002, alpha_n=0.06, beta_n=0.002, alpha_r=0.008, beta_r=0.0004, gamma=1.8),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the main pipeline on the embedded defaults",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", type=cluster_arg, default=cluster_arg(EXAMPLE_CLUSTER))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-mlflow", action="store_true", help="do not log the run to MLflow")
    parser.set_defaults(func=run)


def example_observations(seed: int = 0):
    """Observations generated from EXAMPLE_PARAMS with 3% log-normal noise (labelled source='example')."""
    import numpy as np

    from goodput import Observation
    from goodput.throughput import ThroughputParams, predict_step_time

    rng = np.random.default_rng(seed)
    out = []
    for gpu, values in EXAMPLE_PARAMS.items():
        params = ThroughputParams(**values)
        configs = [(1, 1), (1, 2), (1, 4)] + ([(2, 8)] if gpu == "t4" else [])
        for nodes, replicas in configs:
            for bsz in (16, 32, 64, 128, 256):
                t = float(predict_step_time(params, nodes, replicas, bsz)) * float(np.exp(rng.normal(0, 0.03)))
                out.append(Observation(job="example-job", gpu_type=gpu, num_nodes=nodes, num_replicas=replicas,
                                       local_bsz=bsz, step_time=t, source="example",
                                       grad_sqr=1.0, grad_var=4.0))
    return out


def run(args: argparse.Namespace) -> int:
    from goodput import JobModel, Profile

    out = console()
    out.rule("[bold]goodput demo[/] — EXAMPLE job (illustrative parameters, not measurements)")
    profile = Profile(example_observations(args.seed), job="example-job", init_batch_size=128, max_batch_size=2048)
    model = JobModel.from_profile(profile, local_bsz_bounds=(8, 256))
    table = model.table(args.cluster)
    import pandas as pd

    params = pd.DataFrame([{"gpu_type": g, **model.params(g).to_dict()} for g in model.gpu_types]).drop(columns="fixed", errors="ignore")
    out.print(frame_table(params, title="fitted Pollux parameters (seconds) — from EXAMPLE observations"))
    out.print(frame_table(table.frame.drop(columns=["throughput", "step_time"]), title=f"goodput table on {args.cluster}"))
    if table.missing_gpu_types:
        out.print(f"no observations for {', '.join(table.missing_gpu_types)}: left out of the table")
    if not args.no_mlflow:
        from goodput import tracking

        with tracking.start_run("goodput-demo", run_name="example-job") as run:
            tracking.log_params({"job": model.job, "cluster": str(args.cluster), "data": "EXAMPLE (not measured)"})
            tracking.log_table(table)
        out.print(f"logged MLflow run {run.info.run_id} to {tracking.tracking_uri()}")
    return 0
