"""``goodput accuracy DATA_DIR``: accuracy of step-time prediction on measured data (see experiments/accuracy.py)."""

from __future__ import annotations

import argparse

from experiments.accuracy_args import configure


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "accuracy",
        help="evaluate the Bayesian model and Sia/Pollux baselines on measured step times (protocols P1-P5)",
        description="Run protocols P1 (cold), P2 (one type warm), P3 (multi-node), P4 (online) and P5 (batch sweep) "
        "on a directory of measurements (<model>/placements-<gpu_type>.csv, Pollux traces, Gavel or Zeus folders, "
        "or JSON Lines profiles); print and save a markdown table and log an MLflow run.",
    )
    configure(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from experiments.accuracy import run_from_args

    return run_from_args(args)
