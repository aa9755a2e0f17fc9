"""How low P4's online error can go with this model class: the model as it is, against oracles.

After k observations, ``JobModel`` estimates two things from them: each GPU type's own
Pollux fit (its mean; Qiao et al., OSDI'21, eq. 10-12) and the GP's hyperparameters
(:mod:`goodput.gp`). An *oracle* replaces one or both estimates with the same estimate
made from **all** of the type's observations, the held-out rows included:

* ``mean``: every refit of a type's own fit answers with the fit to all its rows (under the
  same cluster sync shape);
* ``gp``: every hyperparameter fit answers with the hyperparameters a model of all the
  job's rows fits;
* ``both``: the two together.

No predictor built from k observations knows these values, so the oracles bound what a
better estimate of the mean or of the hyperparameters could still gain on P4
(``experiments/accuracy.py``'s online protocol, with the harness's leave-one-model-out
cluster prior). What is left under ``both`` is the form's misfit and the measurements'
noise. Findings: ``experiments/results/accuracy.md`` (rounds 16 and 26).

Example::

    python -m experiments.accuracy_floor ../shared/data/pollux/traces --orders 2   # ~2 min
    python -m experiments.accuracy_floor ../shared/data/gavel --variants "as is,both"

Writes ``bench-results/accuracy_floor.json`` (``--out-dir``), optionally an MLflow run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from goodput import bayes
from goodput.cluster_prior import ClusterPrior
from goodput.gp import GPHyperparameters
from goodput.model import JobModel
from goodput.observations import Observation, by_gpu_type
from goodput.throughput import ThroughputParams, fit_throughput

from .accuracy import evaluate_model
from .benchutil import parser, report
from .datasets import read_measurements, resolve_model_sizes

__all__ = ["VARIANTS", "oracle", "full_data_hyperparameters", "floor_rows", "summarise", "main"]

VARIANTS = ("as is", "mean", "gp", "both")
STAGES = ("k=5", "k=10", "k=20", "k=40", "next")


def full_data_hyperparameters(job: str, observations: Sequence[Observation], prior: ClusterPrior | None,
                              model_size: float | None = None) -> GPHyperparameters:
    """The GP hyperparameters a ``JobModel`` of ``job`` fits to all of ``observations``."""
    model = JobModel(job, init_batch_size=min(o.local_bsz for o in observations), cluster_prior=prior, model_size=model_size)
    model.observe(list(observations)).refit()
    return model.gp_hyperparameters


@contextlib.contextmanager
def oracle(variant: str, observations: Sequence[Observation], hyper: GPHyperparameters | None = None) -> Iterator[None]:
    """Within the block, ``JobModel`` estimates as ``variant`` says (see the module's docstring).

    ``observations``: all of the job's rows (every type); ``hyper``: the full-data GP
    hyperparameters (needed by ``gp`` and ``both``).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r} is not one of {VARIANTS}")
    if variant in ("gp", "both") and hyper is None:
        raise ValueError(f"hyper: variant {variant!r} needs the full-data GP hyperparameters")
    rows = by_gpu_type(observations)
    own_fit, fit_hyper = JobModel._own_fit, bayes.fit_hyperparameters
    full_fits: dict[str, ThroughputParams] = {}

    def oracle_own_fit(self: JobModel, name: str) -> ThroughputParams:
        refitting = name in self._dirty or name not in self._params
        fitted = own_fit(self, name)
        if not refitting or name not in rows:
            return fitted
        if name not in full_fits:
            full_fits[name] = fit_throughput(rows[name], sync_shape=self.sync_shape(name))
        # the full fit's values, with the flags of what the revealed rows leave unidentified
        self._params[name] = dataclasses.replace(full_fits[name], fixed=fitted.fixed)
        return self._params[name]

    def oracle_hyperparameters(x: Any, t: Any, s: Any, y: Any, init: GPHyperparameters, **kwargs: Any) -> GPHyperparameters:
        assert hyper is not None
        tasks = hyper.for_types(init.task_names) if init.task_names else hyper.with_tasks(init.num_tasks)
        return dataclasses.replace(init, lengthscale=hyper.lengthscale, task_factor=tasks.task_factor, task_var=tasks.task_var,
                                   noise=hyper.noise)

    try:
        if variant in ("mean", "both"):
            JobModel._own_fit = oracle_own_fit  # type: ignore[method-assign]
        if variant in ("gp", "both"):
            bayes.fit_hyperparameters = oracle_hyperparameters
        yield
    finally:
        JobModel._own_fit = own_fit  # type: ignore[method-assign]
        bayes.fit_hyperparameters = fit_hyper


def floor_rows(models: Mapping[str, Sequence[Observation]], sizes: Mapping[str, float | None], *,
               variants: Sequence[str] = VARIANTS, orders: int = 2, progress: bool = True) -> pd.DataFrame:
    """P4's rows (``evaluate_model``'s, method ``bayes``) for every model under every variant, column ``variant`` added."""
    full = ClusterPrior.from_observations(dict(models), dict(sizes)) if len(models) > 1 else None
    frames = []
    hypers: dict[str, GPHyperparameters] = {}  # per job, shared by "gp" and "both"
    for variant in variants:
        for name in sorted(models):
            prior = full.exclude(name) if full is not None else None
            if variant in ("gp", "both") and name not in hypers:
                hypers[name] = full_data_hyperparameters(name, models[name], prior, sizes.get(name))
            hyper = hypers.get(name) if variant in ("gp", "both") else None
            if progress:
                print(f"  {variant}: {name}", file=sys.stderr, flush=True)
            with warnings.catch_warnings(), oracle(variant, models[name], hyper):
                warnings.simplefilter("ignore")
                rows = evaluate_model(name, models[name], prior, protocols=["P4"], methods=["bayes"], seeds=orders,
                                      model_size=sizes.get(name))
            frames.append(rows.assign(variant=variant))
    return pd.concat(frames, ignore_index=True)


def summarise(rows: pd.DataFrame) -> list[dict[str, Any]]:
    """Per variant: median APE (%) at each stage and the 90% intervals' coverage (%) at k = 20."""
    rows = rows.assign(ape=(rows.predicted / rows.actual - 1).abs() * 100,
                       covered=(rows.actual >= rows.low) & (rows.actual <= rows.high))
    out = []
    for variant, group in rows.groupby("variant", sort=False):
        line: dict[str, Any] = {"what": variant}
        for stage in STAGES:
            at = group[group.stage == stage]
            line[f"median APE {stage}"] = round(float(np.median(at.ape)), 2) if len(at) else None
        at20 = group[group.stage == "k=20"]
        line["coverage k=20"] = round(100 * float(at20.covered.mean()), 1) if len(at20) else None
        line["rows k=20"] = len(at20)
        out.append(line)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = parser("accuracy_floor", __doc__.splitlines()[0])
    p.add_argument("data_dir", help="a folder `goodput accuracy` reads (placements-<type>.csv per model, Gavel, Zeus, profiles)")
    p.add_argument("--orders", type=int, default=2, help="random orders per (model, type) (the harness uses 6; default 2)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--default-gpu-type", default="t4", help="GPU type of a folder that does not name one (Pollux's traces: t4)")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        p.error(f"--variants: {bad or args.variants!r} not among {VARIANTS}")
    if args.orders < 1:
        p.error(f"--orders: {args.orders} is not a positive count")
    orders = 1 if args.quick else args.orders
    data = read_measurements(args.data_dir, default_gpu_type=args.default_gpu_type)
    sizes = {**data.sizes, **resolve_model_sizes("auto", args.data_dir, sorted(data.models)).sizes}
    sizes = {k: v for k, v in sizes.items() if k in data.models}
    rows = floor_rows(data.models, sizes, variants=variants, orders=orders)
    report("accuracy_floor", summarise(rows), args, extra={"data_dir": str(args.data_dir), "orders": orders})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
