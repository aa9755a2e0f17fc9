"""``goodput compare EXPERIMENT``: compare simulation runs tracked in MLflow."""

from __future__ import annotations

import argparse

from ._common import console, frame_table


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare", help="compare simulation runs of an MLflow experiment (mean ± std per policy)",
        description="Read every simulation run of EXPERIMENT from MLflow (mlflow.search_runs), print mean ± std "
        "over workloads per policy, and save comparison plots.")
    parser.add_argument("experiment", help="MLflow experiment name (goodput simulate --experiment)")
    parser.add_argument("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    parser.add_argument("--out", default="compare", help="folder for the plots and comparison.csv (default: compare/)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from experiments.simulator.compare import DEFAULT_METRICS, SETTINGS, compare_runs, save_comparison_plots
    from goodput.io import atomic_write_text

    frame = compare_runs(args.experiment, uri=args.tracking_uri)
    out = console()
    if frame.empty:
        out.print(f"no simulation runs in experiment {args.experiment!r}")
        return 1
    shown = frame[["policy", *[c for c in SETTINGS if c in frame], "runs"]].copy()
    for metric in DEFAULT_METRICS:
        if f"{metric}_mean" in frame:
            shown[metric] = [f"{m:.4g} ± {s:.2g}" for m, s in zip(frame[f"{metric}_mean"], frame[f"{metric}_std"])]
    out.print(frame_table(shown, title=f"{args.experiment}: mean ± std over workloads"))
    atomic_write_text(Path(args.out) / "comparison.csv", frame.to_csv(index=False))
    paths = save_comparison_plots(frame, args.out)
    out.print(f"comparison.csv and {len(paths)} plots written to {args.out}/")
    return 0
