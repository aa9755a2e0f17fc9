"""``goodput serve``: the goodput service — running jobs report, schedulers query, nothing lost.

One process holds every job's model. Training jobs post observations
(``profilers.reporter.GoodputReporter``); schedulers ask for goodput, tables
and allocations (``goodput.client.Client``, ``goodput table --server``, the
Kubernetes scheduler extender at ``/v1/k8s/filter`` and ``/v1/k8s/prioritize``).
Observations are stored before they are acknowledged (``--store``, SQLite in
WAL mode by default, any SQLAlchemy URL); models are rebuilt from the store at
start-up while the service already answers, and refitted in the background.
OpenAPI at ``/docs``, Prometheus metrics at ``/metrics``.

Example::

    goodput serve --cluster t4:6x4,a100:2x8 --token-file tokens.txt
    goodput serve --store postgresql+psycopg://goodput@db/goodput --host 0.0.0.0
    goodput prior --store sqlite:///goodput.db --out prior.json   # what the jobs so far teach a new one
    goodput serve --cluster-prior prior.json
    goodput serve --learn-prior                                   # or learn it from the jobs as they report
"""

from __future__ import annotations

import argparse

from ._common import cluster_arg


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run the goodput service (REST API, Kubernetes extender, metrics)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default="sqlite:///goodput.db",
                        help="SQLAlchemy URL of the store (default sqlite:///goodput.db in the working directory; "
                        "PostgreSQL: postgresql+psycopg://user@host/db with the 'postgres' extra)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    parser.add_argument("--port", type=int, default=8470, help="port (default 8470; 0: a free one, printed)")
    parser.add_argument("--token-file", help="file of bearer tokens, one a line: writes then need one")
    parser.add_argument("--cluster", type=cluster_arg, default=None,
                        help="the cluster (type:NODESxGPUS,...): default of table/allocate queries; the worker "
                        "computes its tables ahead after a model changes, once no update is waiting (while jobs "
                        "keep reporting, the first query after a new model computes it: tens of ms)")
    parser.add_argument("--export-dir", help="keep <job>.csv there current with each job's table over --cluster "
                        "(for a Slurm job_submit plugin or a wrapper script; written when the worker computes "
                        "the table ahead, so it can lag while jobs keep reporting)")
    parser.add_argument("--model", choices=["bayesian", "plain"], default="bayesian",
                        help="JobModel kind: the Bayesian model (default) or the plain Pollux fit")
    parser.add_argument("--cluster-prior", metavar="PATH",
                        help="a cluster prior saved as JSON (goodput prior): every job's model takes it, without "
                        "the job's own cells; a job's model_size setting places it on its size slopes")
    parser.add_argument("--learn-prior", action="store_true",
                        help="learn the cluster prior from the jobs' own observations as they change (at most once "
                        "per --prior-interval, started when the worker is otherwise idle, learned in a child process "
                        "while the worker goes on); --cluster-prior serves until then")
    parser.add_argument("--prior-interval", type=float, default=600.0,
                        help="seconds between two cluster priors learned (default 600: each refits every job)")
    parser.add_argument("--prior-jobs", type=int, default=64,
                        help="a learned prior holds the jobs that reported last, this many (default 64; about 0.5 s "
                        "each per learning on 2 cores)")
    parser.add_argument("--max-body-mb", type=float, default=10.0, help="larger request bodies get 413 (default 10)")
    parser.add_argument("--sqlite-synchronous", choices=["FULL", "NORMAL", "EXTRA"], default="FULL",
                        help="SQLite's synchronous setting (default FULL: a commit survives a power cut; NORMAL "
                        "survives a killed server only)")
    parser.add_argument("--k8s-max-score", type=int, choices=[10, 100], default=10,
                        help="top score of /v1/k8s/prioritize (default 10: kube-scheduler's MaxExtenderPriority)")
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from goodput.validation import check_float, check_int
    from service.app import create_app
    from service.server import serve

    check_int("port", args.port, minimum=0)
    if args.port > 65535:
        from goodput.errors import ValidationError

        raise ValidationError("port", args.port, "must be <= 65535")
    max_body = int(check_float("max_body_mb", args.max_body_mb, positive=True) * 1024 * 1024)
    interval = check_float("prior_interval", args.prior_interval, nonnegative=True)
    prior_jobs = check_int("prior_jobs", args.prior_jobs, minimum=2)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # create_app checks every argument before it opens the store: a refused one leaves no database behind
    app = create_app(args.store, store_options={"sqlite_synchronous": args.sqlite_synchronous}, cluster=args.cluster,
                     token_file=args.token_file, max_body_bytes=max_body,
                     export_dir=args.export_dir, model_options={"bayesian": args.model == "bayesian"},
                     cluster_prior=args.cluster_prior, learn_prior=args.learn_prior, prior_interval_s=interval,
                     prior_jobs=prior_jobs,
                     k8s_max_score=args.k8s_max_score)
    app.state.registry.store.claim()  # a second server on the store: one line now, not a failed start-up
    serve(app, args.host, args.port, log_level=args.log_level)
    return 0
