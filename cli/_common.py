"""Helpers shared by the subcommands: argument types and rich output."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from typing import Any

from experiments.benchutil import console  # noqa: F401  (re-exported for the subcommands)
from goodput.cluster import Cluster
from goodput.errors import ValidationError
from goodput.io import check_out_path

EXAMPLE_CLUSTER = "t4:6x4,a100:2x8,rtx2080ti:3x8"


def cluster_arg(text: str) -> Cluster:
    """argparse type for ``--cluster t4:6x4,a100:2x8``."""
    try:
        return Cluster.parse(text)
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# what each subcommand's --out names: a file it writes, or a folder it writes into
OUT_KINDS = {"fit": "file", "prior": "file", "profile": "file", "allocate": "file", "table": "file",
             "demo": "folder", "accuracy": "folder", "simulate": "folder", "compare": "folder"}


def check_out(args: argparse.Namespace) -> None:
    """Refuse an unusable ``--out`` before the work: a folder given for a file, a file for a folder, or a
    place that cannot be created (an ancestor that is a file, or a folder without write permission)."""
    path = getattr(args, "out", None)
    kind = OUT_KINDS.get(getattr(args, "command", None))
    if path and kind is not None:
        check_out_path("out", path, kind)


@contextlib.contextmanager
def writing(path: Any) -> Iterator[None]:
    """An OSError inside names ``path`` (the user's), not the temporary file an atomic write was making."""
    try:
        yield
    except OSError as exc:
        if exc.strerror is None:
            raise
        raise type(exc)(exc.errno, exc.strerror, os.fspath(path)) from None


def frame_table(frame: Any, title: str | None = None, float_format: str = "{:.4g}") -> Any:
    """A rich Table from a pandas DataFrame."""
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for column in frame.columns:
        table.add_column(str(column), justify="left" if frame[column].dtype == object else "right")
    for row in frame.itertuples(index=False):
        table.add_row(*[float_format.format(v) if isinstance(v, float) else str(v) for v in row])
    return table
