"""``goodput allocate TABLES.json [TABLE.json ...] --cluster t4:6x4,a100:2x8``: one scheduling round, printed.

Reads goodput tables: files written by :func:`goodput.table.save_tables`, or
one job's table each as ``goodput fit --out table.json`` writes it. Allocates
GPUs with the chosen policy (Sia by default) and prints each job's
configuration and placement, the unallocated jobs with reasons, and what the
solver did (objective, bound, gap, time). ``--out`` saves the allocation as
JSON; passing it back as ``--current`` runs the next round from it.
"""

from __future__ import annotations

import argparse
import json

from ._common import cluster_arg, console, frame_table, writing


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "allocate", help="allocate GPUs to jobs from their goodput tables (Sia, Gavel, unaware, FIFO)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tables", nargs="+", metavar="TABLES",
                        help="JSON files of goodput tables: several jobs' (goodput.table.save_tables) or one job's "
                        "(goodput fit --out); a job may appear in one file only")
    parser.add_argument("--cluster", type=cluster_arg, required=True, help="cluster as type:NODESxGPUS,...")
    parser.add_argument("--policy", default="sia", choices=["sia", "gavel", "gavel-throughput", "unaware", "fifo"])
    parser.add_argument("-p", "--p", dest="p", type=float, default=-0.5, help="Sia's fairness power (default -0.5)")
    parser.add_argument("--lam", type=float, help="λ, penalty per unallocated job (sia, unaware; default 1.1)")
    parser.add_argument("--solver", choices=["auto", "milp", "lagrangian"], help="sia, unaware (default auto)")
    parser.add_argument("--time-limit", type=float, help="MILP time limit in seconds (default 10)")
    parser.add_argument("--goodput-quantile", type=float,
                        help="read every table at this quantile of goodput: < 0.5 cautious, > 0.5 optimistic (default 0.5)")
    parser.add_argument("--backfill", action="store_true", help="fifo: let later jobs start past a blocked one")
    parser.add_argument("--current", help="last round's allocation (JSON written by --out)")
    parser.add_argument("--jobs", help="JSON {job: {JobSpec fields}}: age, restarts, rigid_gpus, gpu_types, ...")
    parser.add_argument("--out", help="write the allocation here as JSON (atomically)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from goodput import allocate
    from goodput.allocator import Allocation

    tables = read_tables(args.tables)
    options = {"policy": args.policy}
    for name in ("lam", "solver", "time_limit", "goodput_quantile"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.backfill:
        options["backfill"] = True
    if args.jobs:
        from goodput.io import read_json

        options["jobs"] = read_json(args.jobs)
    current = Allocation.from_json(args.current) if args.current else None
    allocation = allocate(tables, args.cluster, current=current, p=args.p, **options)
    if args.out:
        with writing(args.out):
            allocation.to_json(args.out)
    if args.json:
        print(json.dumps(allocation.to_dict(), indent=2))
        return 0

    out = console()
    frame = allocation.to_frame()
    frame["gpu_type"] = frame["gpu_type"].fillna("-")
    frame["normalized_goodput"] = [f"{v:.3g}" if isinstance(v, float) else "-" for v in frame["normalized_goodput"]]
    frame["changed"] = [("yes" if v else "no") if isinstance(v, bool) else "-" for v in frame["changed"]]
    out.print(frame_table(frame, title=f"{allocation.info.policy} allocation on {args.cluster}"))
    info = allocation.info
    used = allocation.gpus_used()
    usage = ", ".join(f"{t}: {used.get(t, 0)}/{args.cluster.capacity(t)}" for t in args.cluster.gpu_types)
    facts = pd.DataFrame([
        {"what": "solver", "value": f"{info.solver} ({info.status})"},
        {"what": "objective", "value": _fmt(info.objective) + f" ({info.sense})"},
        {"what": "bound", "value": _fmt(info.bound)},
        {"what": "gap", "value": _fmt(info.gap)},
        {"what": "variables", "value": str(info.num_variables)},
        {"what": "wall time", "value": f"{info.wall_time * 1e3:.1f} ms (solver {info.solve_time * 1e3:.1f} ms)"},
        {"what": "GPUs used", "value": usage},
        {"what": "jobs", "value": f"{len(allocation.allocated)} allocated, {len(allocation.unallocated)} not"},
    ])
    out.print(frame_table(facts, title="solver"))
    for note in info.notes:
        out.print(f"note: {note}")
    if args.out:
        out.print(f"allocation written to {args.out}")
    return 0


def read_tables(paths: list[str]) -> dict:
    """``{job: GoodputTable}`` from every file; a job in two files is refused."""
    from goodput import load_tables
    from goodput.errors import ValidationError

    tables, source = {}, {}
    for path in paths:
        for job, table in load_tables(path).items():
            if job in tables:
                raise ValidationError("tables", path, f"job {job!r} is in {source[job]} already")
            tables[job], source[job] = table, path
    return tables


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.6g}"
