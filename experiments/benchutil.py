"""Shared benchmark plumbing: median timings, a printed table, a saved JSON, an optional MLflow run.

Every benchmark under ``experiments/bench_*.py`` exposes ``main(argv) -> int``
and writes ``bench-results/<name>.json`` (override with ``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from goodput.io import atomic_write_text


def time_call(fn: Callable[[], Any], *, repeat: int, number: int = 1, warmup: int = 1) -> dict[str, float]:
    """Median, p95 and minimum seconds of ``fn()`` over ``repeat`` rounds of ``number`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    samples.sort()
    return {
        "median_s": statistics.median(samples),
        "p95_s": samples[min(len(samples) - 1, int(round(0.95 * (len(samples) - 1))))],
        "min_s": samples[0],
        "repeat": repeat,
        "number": number,
    }


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:  # pragma: no cover
        pass
    return info


def console() -> Any:
    """A rich console; when output is not a terminal (CI logs, pipes) use a wide page, not 80 columns."""
    import shutil
    import sys

    from rich.console import Console

    width = None if sys.stdout.isatty() else max(shutil.get_terminal_size((160, 24)).columns, 160)
    return Console(width=width)


def parser(name: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m experiments.{name}", description=description)
    p.add_argument("--out-dir", default="bench-results", help="where the JSON figures go (default: bench-results/)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke run)")
    p.add_argument("--mlflow", action="store_true", help="also log the figures as an MLflow run")
    return p


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace, *, at_least: Mapping[str, int] | None = None,
                  positive: Sequence[str] = ()) -> None:
    """Refuse, through ``p.error`` (one line, exit 2), an option below its minimum (``at_least``) or not above 0
    (``positive``), before any work; options left at ``None`` (their defaults) pass."""
    def value(name: str) -> Any:
        return getattr(args, name)

    for name, low in (at_least or {}).items():
        if value(name) is not None and not value(name) >= low:
            p.error(f"--{name.replace('_', '-')} {value(name)}: must be >= {low}")
    for name in positive:
        if value(name) is not None and not value(name) > 0:
            p.error(f"--{name.replace('_', '-')} {value(name)}: must be > 0")


def report(name: str, rows: Sequence[dict[str, Any]], args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Path:
    """Print ``rows`` as a table, save them with the machine facts and the options, optionally log to MLflow
    (the options and machine facts as the run's parameters)."""
    from rich.console import Console
    from rich.table import Table

    title = f"{name} — {platform.node()} ({os.cpu_count()} CPUs)"
    columns = list(dict.fromkeys(k for row in rows for k in row))
    if len(columns) > MAX_TABLE_COLUMNS:  # a table that wide shrinks every cell to "…": one line per row instead
        print(title)
        for row in rows:
            print("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items() if v is not None))
    else:
        table = Table(title=title)
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*[_fmt(row.get(c)) for c in columns])
        Console(width=220).print(table)
    # the options that shaped the figures (--quick, a benchmark's own): runs of other settings stay apart
    settings = {k: v for k, v in sorted(vars(args).items()) if k not in ("out_dir", "mlflow")
                and (v is None or isinstance(v, (bool, int, float, str)))}
    facts = machine()
    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": facts, "settings": settings,
               "rows": list(rows), **(extra or {})}
    path = atomic_write_text(Path(args.out_dir) / f"{name}.json", json.dumps(payload, indent=2, default=str) + "\n")
    print(f"figures saved to {path}")
    if args.mlflow:
        from goodput import tracking

        with tracking.start_run("benchmarks", run_name=name):
            import mlflow

            tracking.log_params({**settings, **{f"machine.{k}": v for k, v in facts.items()}, "host": platform.node()})

            metrics = {}
            for row in rows:
                label = metric_name(str(row.get("what", row.get("case", "row"))))
                for key, value in row.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        metrics[f"{label}.{key}"[:250]] = float(value)
            mlflow.log_metrics(metrics)
            mlflow.log_artifact(str(path))
    return path


MAX_TABLE_COLUMNS = 12


def metric_name(label: str) -> str:
    """A row's label as an MLflow metric name: characters MLflow refuses (``,()+×``, spaces) become ``_``.

    >>> metric_name("observe(1) + table, 200 obs")
    'observe_1____table__200_obs'
    """
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", label)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
