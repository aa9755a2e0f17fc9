"""Run every benchmark (``make bench``): each ``experiments/bench_*.py`` in turn.

Usage: ``python -m experiments.bench [--quick] [--only core,model] [--mlflow]``.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time

import experiments


def discover() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(experiments.__path__) if m.name.startswith("bench_"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__)
    parser.add_argument("--only", help="comma-separated names (core, model, ...)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mlflow", action="store_true")
    parser.add_argument("--out-dir", default="bench-results")
    args = parser.parse_args(argv)
    names = discover()
    if args.only:
        wanted = {f"bench_{n.strip().removeprefix('bench_')}" for n in args.only.split(",")}
        unknown = wanted - set(names)
        if unknown:
            parser.error(f"unknown benchmark(s) {sorted(unknown)}; have {names}")
        names = [n for n in names if n in wanted]
    forwarded = ["--out-dir", args.out_dir] + (["--quick"] if args.quick else []) + (["--mlflow"] if args.mlflow else [])
    failures = 0
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        start = time.perf_counter()
        code = importlib.import_module(f"experiments.{name}").main(forwarded)
        print(f"=== {name}: exit {code} in {time.perf_counter() - start:.1f} s ===", flush=True)
        failures += code != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
