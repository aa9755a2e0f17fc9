"""The command line of a check run on measurement folders (``experiments.noise_floor``, ``experiments.compute_form``).

``python -m experiments.<check> DIR [DIR ...] [--out FILE]``: each folder read with
:func:`experiments.datasets.read_measurements`, its figures computed and printed on one
line, and all of them written as JSON (atomically) with ``--out``; a folder that does
not exist, or an ``--out`` that cannot be written, exits with status 2 before any work.
A check with options of its own (``experiments.small_clusters``) also gets them, and the
models' parameter counts as ``goodput accuracy --model-sizes auto`` finds them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.datasets import read_measurements, resolve_model_sizes
from goodput.errors import ValidationError
from goodput.io import atomic_write_text, check_out_path

__all__ = ["run"]


def run(argv: Sequence[str] | None, prog: str, description: str,
        figures_of: Callable[..., Any], line_of: Callable[[Any], str],
        options: Callable[[argparse.ArgumentParser], None] | None = None) -> int:
    """Parse ``argv``, then ``figures_of({model: observations})`` per folder (JSON-able), printed as
    ``"<folder>: " + line_of(figures)``; returns the exit status. With ``options`` (adds a check's own
    arguments to the parser), ``figures_of(models, sizes, args)`` instead: ``sizes`` the folder's parameter
    counts (``--model-sizes auto``), ``args`` the parsed arguments."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("dirs", nargs="+", help="measurement folders (the layout goodput accuracy reads)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    if options is not None:
        options(parser)
    args = parser.parse_args(argv)
    missing = [folder for folder in args.dirs if not Path(folder).is_dir()]  # every folder and --out before the work
    if missing:
        print(f"{prog}: error: {missing[0]}: not a directory", file=sys.stderr)
        return 2
    if args.out:
        try:
            check_out_path("out", args.out, "file")
        except ValidationError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
    results = {}
    for folder in args.dirs:
        try:
            data = read_measurements(folder)
        except (ValidationError, OSError) as exc:  # a malformed table (DataFormatError), a folder without data
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        if options is None:
            results[folder] = figures_of(data.models)
        else:
            known = {**data.sizes, **resolve_model_sizes("auto", folder, sorted(data.models)).sizes}
            results[folder] = figures_of(data.models, {k: v for k, v in known.items() if k in data.models}, args)
        print(f"{folder}: {line_of(results[folder])}")
    if args.out:  # strict JSON: a figure a folder cannot give (no repeats, no cells) is null, not NaN
        atomic_write_text(args.out, json.dumps(_no_nan(results), indent=1, allow_nan=False) + "\n")
    return 0


def _no_nan(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_nan(v) for v in value]
    return value
