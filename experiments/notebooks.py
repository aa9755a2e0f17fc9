"""Execute the worked examples in ``notebooks/`` (and, with ``--save``, commit-ready outputs).

Run: ``python -m experiments.notebooks [--fast] [--save] [NAME ...]``. Each
notebook runs in a scratch working directory (its profiles, simulation outputs
and MLflow store stay there), with ``GOODPUT_NOTEBOOK_FAST=1`` under ``--fast``.
``--save`` writes the executed notebook, outputs included, back in place.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def execute(path: Path, *, fast: bool, workdir: Path, timeout: int = 1800):
    """Run every cell of ``path`` in ``workdir``; returns the executed notebook (raises on a failing cell)."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    env_before = os.environ.get("GOODPUT_NOTEBOOK_FAST")
    os.environ["GOODPUT_NOTEBOOK_FAST"] = "1" if fast else "0"
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    try:
        NotebookClient(notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("GOODPUT_NOTEBOOK_FAST", None)
        else:
            os.environ["GOODPUT_NOTEBOOK_FAST"] = env_before
    return notebook


def save(notebook: Any, path: Path) -> Path:
    """Write ``notebook`` to ``path`` atomically (a crash mid-write leaves the old file, never half a notebook)."""
    import nbformat

    from goodput.io import atomic_write_text

    text = nbformat.writes(notebook)
    return atomic_write_text(path, text if text.endswith("\n") else text + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.notebooks", description=__doc__)
    parser.add_argument("names", nargs="*", help="notebook file names (default: all)")
    parser.add_argument("--fast", action="store_true", help="small budgets (GOODPUT_NOTEBOOK_FAST=1)")
    parser.add_argument("--save", action="store_true", help="write the executed notebooks back with their outputs")
    args = parser.parse_args(argv)
    paths = [NOTEBOOKS / n for n in args.names] if args.names else sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            # each notebook its own store (unless the caller chose one), gone with its folder
            caller_uri = os.environ.get("MLFLOW_TRACKING_URI")
            os.environ["MLFLOW_TRACKING_URI"] = caller_uri or f"sqlite:///{Path(tmp) / 'mlflow.db'}"
            try:
                notebook = execute(path, fast=args.fast, workdir=Path(tmp))
            finally:
                if caller_uri is None:
                    del os.environ["MLFLOW_TRACKING_URI"]
        if args.save:
            save(notebook, path)
        print(f"{path.name}: ran in {time.perf_counter() - start:.1f} s" + (" (saved)" if args.save else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
