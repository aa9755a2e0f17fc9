"""``goodput fit PROFILE``: fit a job's model and print its goodput table."""

from __future__ import annotations

import argparse
import json

from ._common import EXAMPLE_CLUSTER, cluster_arg, console, frame_table, writing


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fit",
        help="fit a job's model from a profile and print its goodput table",
        description="Fit Pollux's throughput model per GPU type from a JSON Lines profile, "
        "then print the fitted parameters and the goodput table over a cluster's configurations.",
    )
    parser.add_argument("profile", help="JSON Lines profile (written by profile_job or Profile.save)")
    parser.add_argument("--cluster", type=cluster_arg, default=cluster_arg(EXAMPLE_CLUSTER),
                        help=f"cluster as type:NODESxGPUS,... (default: {EXAMPLE_CLUSTER})")
    parser.add_argument("--job", help="job to fit when the profile holds several")
    parser.add_argument("--init-batch-size", type=int, help="reference batch size M0 (default: the profile's)")
    parser.add_argument("--max-batch-size", type=int, help="largest total batch size (default: the profile's, else M0)")
    parser.add_argument("--out", help="write the goodput table here (.json or .csv)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from goodput import JobModel, Profile
    from goodput.errors import ValidationError

    profile = _chosen_job(Profile.load(args.profile), args)
    _check_init_batch_size(profile, args)
    overrides = {}
    if args.init_batch_size is not None:
        overrides["init_batch_size"] = args.init_batch_size
    if args.max_batch_size is not None:
        overrides["max_batch_size"] = args.max_batch_size
    model = JobModel.from_profile(profile, **overrides)
    table = model.table(args.cluster)
    if len(table) == 0:
        raise ValidationError("cluster", str(args.cluster), f"{model.empty_table_reason(args.cluster)} (profile {args.profile})")
    params = {gpu: model.params(gpu).to_dict() for gpu in model.gpu_types}
    if args.out:
        with writing(args.out):
            (table.to_csv if args.out.endswith(".csv") else table.to_json)(args.out)
    if args.json:
        print(json.dumps({"job": model.job, "params": params, "table": table.to_dict()}, indent=2))
        return 0
    import pandas as pd

    out = console()
    frame = pd.DataFrame([{"gpu_type": g, **{k: v for k, v in p.items() if k != "fixed"},
                           "set by prior": ",".join(p.get("fixed", [])) or "-"} for g, p in params.items()])
    out.print(frame_table(frame, title=f"{model.job}: Pollux throughput parameters (seconds)"))
    shown = table.frame.drop(columns=["throughput", "step_time"], errors="ignore")
    out.print(frame_table(shown, title=f"{model.job}: goodput on {args.cluster} (samples/s × efficiency)"))
    if table.missing_gpu_types:
        out.print(f"[yellow]no observations for GPU type(s) {', '.join(table.missing_gpu_types)}: left out of the table[/]")
    if not model.has_gradient_stats:
        out.print("[yellow]no gradient statistics in the profile: batch size held at M0 (efficiency 1)[/]")
    if args.out:
        out.print(f"table written to {args.out}")
    return 0


def _chosen_job(profile, args: argparse.Namespace):
    """The profile of the job to fit: ``--job``'s (with its own settings), or the file's only job."""
    from goodput.errors import ValidationError

    if len(profile) == 0:
        what = "holds no observations" if profile.meta_dict() or profile.job_meta else "is empty: it holds no records"
        raise ValidationError("profile", args.profile, f"{what}; profile the job first (goodput profile)")
    if args.job:
        if args.job not in profile.jobs:
            raise ValidationError("--job", args.job, f"not in {args.profile} (it holds {profile.jobs})")
        profile = profile.select(job=args.job)
        profile.job = args.job
    elif profile.job is None and len(profile.jobs) > 1:
        raise ValidationError("--job", None, f"{args.profile} holds jobs {profile.jobs}: choose one with --job")
    return profile


def _check_init_batch_size(profile, args: argparse.Namespace) -> None:
    """A reference batch size M0 is known: the profile's or ``--init-batch-size``."""
    from goodput.errors import ValidationError

    if args.init_batch_size is None and profile.init_batch_size is None:
        raise ValidationError("--init-batch-size", None,
                              f"{args.profile} records no init_batch_size (the job's reference batch size M0): "
                              "pass --init-batch-size")
