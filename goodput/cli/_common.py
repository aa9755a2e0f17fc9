"""Helpers shared by the subcommands: argument types and rich output."""

from __future__ import annotations

import argparse
from typing import Any

from goodput.cluster import Cluster
from goodput.errors import ValidationError

EXAMPLE_CLUSTER = "t4:6x4,a100:2x8,rtx2080ti:3x8"


def cluster_arg(text: str) -> Cluster:
    """argparse type for ``--cluster t4:6x4,a100:2x8``."""
    try:
        return Cluster.parse(text)
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def console() -> Any:
    """A rich console; when output is not a terminal (CI logs, pipes) use a wide page, not 80 columns."""
    import shutil
    import sys

    from rich.console import Console

    width = None if sys.stdout.isatty() else max(shutil.get_terminal_size((160, 24)).columns, 160)
    return Console(width=width)


def frame_table(frame: Any, title: str | None = None, float_format: str = "{:.4g}") -> Any:
    """A rich Table from a pandas DataFrame."""
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for column in frame.columns:
        table.add_column(str(column), justify="left" if frame[column].dtype == object else "right")
    for row in frame.itertuples(index=False):
        table.add_row(*[float_format.format(v) if isinstance(v, float) else str(v) for v in row])
    return table
