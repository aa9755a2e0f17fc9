"""``goodput table --server URL --job J [--cluster SPEC] [--format csv|json] [--out FILE]``: a job's goodput table.

Asks a running ``goodput serve`` for the job's goodput table over the cluster
(Sia's configuration set; default: the server's ``--cluster``) and prints it
as CSV (one row per configuration: ``job, gpu_type, num_nodes, num_gpus,
goodput, batch_size, local_bsz, accum_steps, ...``, then ``missing_gpu_types``
when the job has no data on some of the cluster's types; the layout of
``goodput serve --export-dir``'s files) or JSON — the export a
Slurm ``job_submit`` plugin or a wrapper script reads. ``--out`` writes the
file atomically instead. A job whose model is still being rebuilt (server
start-up) is waited for up to ``--wait`` seconds.

Example::

    goodput table --server http://goodput:8470 --job cifar10 --cluster t4:6x4,a100:2x8 --format csv
"""

from __future__ import annotations

import argparse
import os
import sys

from ._common import cluster_arg, writing


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("table", help="a job's goodput table from a running goodput serve (CSV/JSON)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True, help="the service, e.g. http://127.0.0.1:8470")
    parser.add_argument("--job", required=True, help="the job's name")
    parser.add_argument("--cluster", type=cluster_arg, default=None, help="type:NODESxGPUS,... (default: the server's)")
    parser.add_argument("--format", choices=["csv", "json"], default="csv")
    parser.add_argument("--out", help="write here (atomically) instead of printing")
    parser.add_argument("--wait", type=float, default=30.0,
                        help="seconds to wait while the server rebuilds the job's model (default 30)")
    parser.add_argument("--token", default=os.environ.get("GOODPUT_TOKEN"),
                        help="bearer token (default $GOODPUT_TOKEN; reads need none)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from goodput.client import Client, ServiceError
    from goodput.io import atomic_write_text
    from goodput.validation import check_float

    with Client(args.server, token=args.token, wait=check_float("wait", args.wait, nonnegative=True)) as client:
        try:
            data = client.table_dict(args.job, args.cluster)  # waits while the job's model is being built
        except ServiceError as exc:  # 422s are ValidationErrors, reported by the command's main
            if isinstance(exc, ValueError):
                raise
            print(f"goodput table: error: {exc}", file=sys.stderr)
            return 2
    if data.get("missing_gpu_types"):
        print(f"goodput table: the job has no observations on {', '.join(data['missing_gpu_types'])}: "
              "no rows for them", file=sys.stderr)
    if args.format == "json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        from goodput import GoodputTable

        table = GoodputTable.from_dict({"job": data["job"], "rows": data["rows"],
                                        "missing_gpu_types": data.get("missing_gpu_types", [])})
        text = table.csv_text(placeholder=False)  # one row per configuration, none for an empty table
    if args.out:
        with writing(args.out):
            atomic_write_text(args.out, text)
    else:
        sys.stdout.write(text)
    return 0
