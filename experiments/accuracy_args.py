"""The accuracy harness's settings and arguments, shared by ``goodput accuracy`` and ``python -m experiments.accuracy``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

PROTOCOLS = ("P1", "P2", "P3", "P4", "P5")
METHODS = ("bayes", "bayes-noprior", "pollux", "linear", "sia")
# Random orders per type in P4. With 2, the pooled P4@20 median APE of Pollux's T4 traces was
# 6.25, 5.78 or 5.53% depending on which pair of orders was drawn (seeds 0-1, 2-3, 4-5); 6
# orders average that out for ~10 s more on those traces.
P4_SEEDS = 6


def configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The accuracy harness's arguments (shared by ``goodput accuracy`` and ``python -m experiments.accuracy``)."""
    from profilers.rayutil import add_ray_option

    p.add_argument("data_dir", help="measurements: <model>/placements-<gpu_type>.csv (or one model's tables directly), Pollux traces, Gavel/Zeus folder or *.jsonl profiles")
    p.add_argument("--out", default="accuracy-results", help="output folder (default: accuracy-results/)")
    p.add_argument("--models", help="comma-separated models to evaluate (default: all)")
    p.add_argument("--protocols", type=subset_arg("protocols", PROTOCOLS), default=",".join(PROTOCOLS),
                   help=f"comma-separated subset of {','.join(PROTOCOLS)}")
    p.add_argument("--methods", type=subset_arg("methods", METHODS), default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--seeds", type=int, default=P4_SEEDS, help=f"random orders per type in P4 (default {P4_SEEDS})")
    p.add_argument("--p4-max-test", type=int, default=400, help="held-out observations evaluated per P4 checkpoint")
    p.add_argument("--model-sizes", metavar="FILE|auto|none", default="auto",
                   help="JSON {model: trainable parameters} (or {model: {\"num_parameters\": N, ...}}): scales other models' "
                        "sync costs by the ratio of sizes. auto (default): DATA_DIR/model-sizes.json, else the bundled counts "
                        "of published models (experiments/data/model-sizes/) whose names 2+ of the data's models share; "
                        "none: only what profiles written by profile_job record")
    p.add_argument("--gpu-type", default="t4", help="GPU type of files without one in their name (Pollux's traces: t4)")
    p.add_argument("--resume", action="store_true", help="reuse OUT/rows-<model>.csv of models already evaluated (refused when OUT/settings.json records other settings)")
    add_ray_option(p, "evaluate the (model, protocol) units")
    p.add_argument("--no-mlflow", action="store_true", help="do not log an MLflow run")
    p.add_argument("--no-progress", action="store_true")
    return p


def checked_subset(field: str, values: Any, allowed: Sequence[str]) -> list[str]:
    """``values`` (comma-separated text, or a sequence of names) as a non-empty list of ``allowed`` names,
    in order, each once (a repeat would evaluate, count and log everything twice).

    Raises:
        ValidationError: a name not in ``allowed``, or none given.
    """
    from goodput.errors import ValidationError

    if isinstance(values, str):
        given = values.split(",")
    elif isinstance(values, Sequence) and all(isinstance(v, str) for v in values):
        given = list(values)
    else:
        raise ValidationError(field, values, f"expected names separated by commas, or a list of names ({', '.join(allowed)})")
    names = [v for v in dict.fromkeys(v.strip() for v in given) if v]
    bad = [v for v in names if v not in allowed]
    if bad or not names:
        what = f"unknown {', '.join(bad)}" if bad else "none given"
        raise ValidationError(field, values, f"{what}; choose from {', '.join(allowed)}")
    return names


def subset_arg(field: str, allowed: tuple[str, ...]):
    """argparse type for a comma-separated, non-empty subset of ``allowed`` (given back as text)."""

    def parse(text: str) -> str:
        from goodput.errors import ValidationError

        try:
            return ",".join(checked_subset(field, text, allowed))
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse
