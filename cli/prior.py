"""``goodput prior``: learn what a cluster's jobs teach a new job, and save it for ``goodput serve --cluster-prior``.

The prior (:class:`goodput.ClusterPrior`, :mod:`goodput.hierarchy`) summarises
every (job, GPU type) the source holds and fits the hierarchy over them: the
typical job on each type, how jobs differ (with their parameter counts, the
size slopes of their sync costs) and how a job differs across types. A new
job's model then starts from it: from its 1-GPU steps alone, its multi-GPU
steps are placed where the cluster's jobs of its size put them.

Sources: the service's store (``--store``: every registered job's stored
observations, and its ``model_size`` setting), or a measurement directory in
the formats ``goodput accuracy`` reads (``--model-sizes`` as there).

Example::

    goodput prior --store sqlite:///goodput.db --out prior.json
    goodput prior ../shared/data/pollux/traces --out pollux-prior.json
    goodput serve --cluster-prior prior.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ._common import writing


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "prior", help="learn a cluster prior from the jobs so far (for goodput serve --cluster-prior)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("data", nargs="?", help="a measurement directory (the formats goodput accuracy reads)")
    source.add_argument("--store", help="the service's store (SQLAlchemy URL): every registered job's observations")
    parser.add_argument("--model-sizes", default="auto",
                        help="with a directory: parameter counts, as goodput accuracy takes them (default auto)")
    parser.add_argument("--out", required=True, help="where to save the prior (JSON, written atomically)")
    parser.add_argument("--json", action="store_true", help="print the fitted hierarchy as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from goodput import ClusterPrior
    from goodput.errors import ValidationError

    from rich.console import Console

    if args.store and args.model_sizes != "auto":
        raise ValidationError("model_sizes", args.model_sizes, "applies to a directory; with --store, a job's size is "
                                                              "its model_size setting (goodput profile --server sets it)")
    status = Console(stderr=True).status("reading the jobs' observations")  # on a terminal only
    with status:
        observations, sizes, source = (_from_store(args.store) if args.store
                                       else _from_directory(args.data, args.model_sizes))
        observations = {job: obs for job, obs in observations.items() if obs}
        if not observations:
            raise ValidationError("store" if args.store else "data", args.store or args.data,
                                  "holds no job with observations")
        status.update(f"learning from {len(observations)} jobs: a fit per job and GPU type, then the hierarchy")
        prior = ClusterPrior.from_observations(observations, sizes)
        description = prior.describe()
    with writing(args.out):
        prior.save(args.out)  # its summaries, shapes and GP prior (not the observations)
    if args.json:
        print(json.dumps({"out": str(args.out), "source": source, **description}, indent=1))
        return 0
    sized = sorted(job for job in observations if sizes.get(job))
    print(f"goodput prior: {len(observations)} jobs ({sum(len(o) for o in observations.values())} observations, "
          f"{len(prior.summaries)} job × type cells) from {source} -> {args.out}")
    print(f"  GPU types: {', '.join(description['types'])}")
    print(f"  parameter counts: {len(sized)} of {len(observations)} jobs"
          + _unsized_note(description.get("size_imputation"), len(sized), len(observations), args.store))
    return 0


def _unsized_note(imputation: dict[str, Any] | None, sized: int, jobs: int, store: str | None) -> str:
    """What the summary line adds about jobs without a parameter count (ClusterPrior.describe's ``size_imputation``)."""
    if sized == jobs:
        note = ""
    elif imputation is None:
        note = " (those without one unknown: no 1-GPU steps at two batch sizes)"
    else:
        note = (f" (those without one read off their 1-GPU compute, ±{imputation['error_std']:.2f} in log"
                + ("" if imputation["calibrated"] else ", uncalibrated: the proxy stands for the size") + ")")
    if sized < 2:
        note += "; give jobs a model_size setting" + ("" if store else ", or --model-sizes") + " for sync priors placed by size"
    return note


def _from_store(url: str) -> tuple[dict[str, list[Any]], dict[str, float], str]:
    from goodput.errors import ValidationError
    from service.registry import read_observations
    from service.store import Store, sqlite_file

    if url.startswith("sqlite:") and not (sqlite_file(url) or Path()).is_file():  # not create an empty one
        raise ValidationError("store", url, "no such SQLite file")
    store = Store(url, create=False)  # reading: a database that is not a store is refused, not given its tables
    try:
        observations: dict[str, list[Any]] = {}
        sizes: dict[str, float] = {}
        for record in store.jobs():  # records this version cannot read are left out, as the service does
            observations[record.name] = read_observations(store, record.name).observations
            if record.settings.get("model_size"):
                sizes[record.name] = float(record.settings["model_size"])
    finally:
        store.close()
    return observations, sizes, f"the store {url}"


def _from_directory(path: str, model_sizes: str) -> tuple[dict[str, list[Any]], dict[str, float], str]:
    from experiments.datasets import read_measurements, resolve_model_sizes

    data = read_measurements(path)
    resolved = resolve_model_sizes(model_sizes, path, sorted(data.models))
    sizes = {**data.sizes, **{k: v for k, v in resolved.sizes.items() if k in data.models}}
    where = resolved.source if resolved.sizes or not data.sizes else "the profiles' own parameter counts"
    return {job: list(obs) for job, obs in data.models.items()}, sizes, f"{path} (sizes: {where})"
