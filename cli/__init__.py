"""The ``goodput`` console command.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``,
which registers the parser and sets ``func(args) -> int``. Modules are listed
in :data:`SUBCOMMANDS`; they import their heavy dependencies (torch, mlflow)
inside ``func`` so that ``goodput --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from goodput.client import ServiceError
from goodput.errors import ValidationError
from profilers.rayutil import RayNotInstalledError

from ._common import check_out

SUBCOMMANDS = [  # in workflow order
    "cli.demo",
    "cli.profile",
    "cli.fit",
    "cli.prior",
    "cli.accuracy",
    "cli.allocate",
    "cli.simulate",
    "cli.compare",
    "cli.serve",
    "cli.table",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="goodput",
        description="Measure, model and schedule deep-learning training jobs by goodput across GPU types.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def _version() -> str:
    from goodput import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        check_out(args)
        return int(args.func(args) or 0)
    except (ValidationError, OSError, RayNotInstalledError, ServiceError) as exc:  # ServiceError: a service's refusal
        print(f"goodput {args.command}: error: {_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"goodput {args.command}: interrupted", file=sys.stderr)
        return 130


def _message(exc: Exception) -> str:
    """One line: a ValidationError's text, or an OSError's ``<strerror>: <path>`` without its errno."""
    if isinstance(exc, OSError) and exc.strerror:
        # os.replace(tmp, path) fails naming both: the second is the path the user gave
        path = exc.filename2 if exc.filename2 is not None else exc.filename
        return exc.strerror if path is None else f"{exc.strerror}: {os.fsdecode(path)}"
    return str(exc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
