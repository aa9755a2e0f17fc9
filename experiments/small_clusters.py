"""How many jobs a cluster prior needs before it helps: the harness's P1 and P3 with priors of 1, 2, 3 jobs.

``goodput accuracy`` learns each model's cluster prior from every other model of
the folder (leave-one-model-out). A service starts with one or two jobs, and
:data:`service.registry.MIN_SIZED_JOBS` says when it starts learning one. This
measures what a prior from ``k`` other jobs does: for each model, up to
``subsets`` random sets of ``k`` others (seeded) each give a prior
(:class:`goodput.hierarchy.ClusterPrior`), and the model's P1 (1-GPU steps on
every type → its multi-GPU ones) and P3 (single-node → multi-node) test rows
are predicted with it, and with the weak default alone (``k = 0``, no cluster),
with and without the models' parameter counts (``--model-sizes auto``'s, as the
harness finds them). A figure is the median, and the mean, over (model, subset)
of the model's median APE of step time, %.

Run: ``python -m experiments.small_clusters DIR [DIR ...] [--jobs 1,2,3]
[--subsets 4] [--out FILE]``: one line per folder, protocol and sizes setting
(``--out`` also writes the figures as JSON, atomically).

Measured (2-core VM, ``ec44ec7``'s model, the defaults, 91 s for both folders; median / mean):

==========================  ============  ===========  ===========  ===========
folder, protocol, sizes     weak default  1 job        2 jobs       3 jobs
==========================  ============  ===========  ===========  ===========
Pollux's traces, P1, sized  35.4 / 35.1   16.5 / 18.6  12.3 / 13.7  13.3 / 16.2
Pollux's traces, P3, sized  20.3 / 24.0   13.1 / 14.6  9.1 / 12.5   6.7 / 9.1
Gavel, P1, sized            22.7 / 25.6   18.6 / 23.0  15.7 / 17.4  15.9 / 16.2
Gavel, P3, sized            25.0 / 27.4   18.4 / 22.4  14.4 / 16.3  12.9 / 14.0
Pollux's traces, P1, none   35.4 / 35.1   14.4 / 28.1  12.4 / 27.8  16.7 / 28.1
Pollux's traces, P3, none   20.3 / 24.0   18.6 / 28.1  15.5 / 29.2  24.5 / 34.5
Gavel, P1, none             22.7 / 25.6   39.4 / 52.6  35.5 / 40.6  34.4 / 39.0
Gavel, P3, none             25.0 / 27.4   22.7 / 27.7  15.8 / 21.7  16.4 / 19.1
==========================  ============  ===========  ===========  ===========

With sizes, a prior from one other job already beats the weak default, on both folders and both
protocols. Without them, Gavel's P1 is worse than the weak default with 1–3 jobs (and with all four
others: ``experiments/results/accuracy.md``'s table without sizes), and Pollux's P3 is better by the
median but worse by the mean with 1–2 jobs and worse by both with 3: so the service learns a prior
once two jobs report their size, each then taking the other's.
"""

from __future__ import annotations

import argparse
import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from experiments.accuracy import predict_bayes
from experiments.accuracy_protocols import splits_p1, splits_p3
from experiments.folder_check import run
from goodput.hierarchy import ClusterPrior
from goodput.observations import Observation
from goodput.errors import ValidationError
from goodput.validation import check_int

__all__ = ["SmallClusterFigure", "small_cluster_figures", "main"]

_SPLITS = {"P1": splits_p1, "P3": splits_p3}


@dataclass(frozen=True)
class SmallClusterFigure:
    """One protocol's error with priors of ``jobs`` other jobs (0: the weak default), with or without sizes."""

    protocol: str
    sized: bool
    jobs: int
    median_ape: float  # median over (model, subset) of the model's median APE, %
    mean_ape: float
    cases: int  # (model, subset) pairs with test rows


def _median_ape(job: str, observations: Sequence[Observation], protocol: str, prior: ClusterPrior | None,
                size: float | None) -> float | None:
    errors = []
    for split in _SPLITS[protocol](observations):
        predicted = predict_bayes(job, split.train, split.test, prior, size)[0]
        actual = np.array([o.step_time for o in split.test])
        ok = np.isfinite(predicted)
        errors.append(100.0 * np.abs(predicted[ok] / actual[ok] - 1.0))
    errors_all = np.concatenate(errors) if errors else np.zeros(0)
    return float(np.median(errors_all)) if errors_all.size else None


def small_cluster_figures(models: Mapping[str, Sequence[Observation]], sizes: Mapping[str, float],
                          jobs: Sequence[int] = (1, 2, 3), subsets: int = 4, seed: int = 0,
                          protocols: Sequence[str] = ("P1", "P3"),
                          progress: Callable[[int], None] | None = None) -> list[SmallClusterFigure]:
    """:class:`SmallClusterFigure` per protocol, sizes setting (with ``sizes`` when any, then without) and
    cluster size in ``(0, *jobs)`` (module docstring); ``k`` at least the folder's other models are skipped.
    ``progress(total)`` is called once with the number of (model, subset) cases, then ``progress(0)`` after each."""
    subsets = check_int("subsets", subsets, minimum=1)
    jobs = [check_int("jobs", k, minimum=1) for k in jobs]
    unknown = sorted(set(protocols) - set(_SPLITS))
    if unknown:
        raise ValidationError("protocols", ",".join(protocols), f"unknown {', '.join(unknown)}; expected some of {', '.join(_SPLITS)}")
    names = sorted(models)
    settings = [True, False] if sizes else [False]
    cluster_sizes = [k for k in (0, *jobs) if k < len(names)]
    picks: dict[tuple[str, int], list[tuple[str, ...]]] = {}
    for k in cluster_sizes:  # the same subsets for every protocol and sizes setting
        rng = random.Random(seed)
        for job in names:
            others = list(itertools.combinations([n for n in names if n != job], k))
            rng.shuffle(others)
            picks[job, k] = others[:subsets]
    if progress is not None:
        progress(len(settings) * len(protocols) * sum(len(v) for v in picks.values()))
    priors: dict[tuple[tuple[str, ...], bool], ClusterPrior] = {}
    out = []
    for sized in settings:
        for protocol in protocols:
            for k in cluster_sizes:
                cases = []
                for job in names:
                    size = sizes.get(job) if sized else None
                    for subset in picks[job, k]:
                        if subset and (subset, sized) not in priors:  # shared by the protocols
                            priors[subset, sized] = ClusterPrior.from_observations(
                                {j: models[j] for j in subset}, {j: sizes[j] for j in subset if j in sizes} if sized else {})
                        value = _median_ape(job, models[job], protocol, priors[subset, sized] if subset else None, size)
                        if value is not None:
                            cases.append(value)
                        if progress is not None:
                            progress(0)
                if cases:
                    out.append(SmallClusterFigure(protocol, sized, k, float(np.median(cases)), float(np.mean(cases)), len(cases)))
    return out


def _line(figures: list[dict]) -> str:
    groups: dict[tuple, list[str]] = {}
    for f in figures:
        groups.setdefault((f["protocol"], f["sized"]), []).append(
            f"{'weak default' if f['jobs'] == 0 else str(f['jobs']) + ' job' + 's' * (f['jobs'] > 1)} "
            f"{f['median_ape']:.1f} / {f['mean_ape']:.1f}")
    if not groups:
        return "no figures: no model has P1's or P3's test rows (multi-GPU, multi-node steps)"
    return "; ".join(f"{p} {'sized' if s else 'no sizes'}: " + ", ".join(v) for (p, s), v in groups.items())


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, e.g. 1,2,3")
    return values


def _positive_int(text: str) -> int:
    values = _positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one positive integer")
    return values[0]


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", type=_positive_ints, default=[1, 2, 3], help="cluster sizes to try, comma-separated (default 1,2,3)")
    parser.add_argument("--subsets", type=_positive_int, default=4, help="random sets of other jobs per model and size (default 4)")


def _figures(models: Mapping[str, Sequence[Observation]], sizes: Mapping[str, float], args: argparse.Namespace) -> list[dict]:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]small clusters"), BarColumn(), TextColumn("{task.completed}/{task.total} cases"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("cases", total=None)

        def advance(total: int) -> None:
            if total:
                bar.update(task, total=total)
            else:
                bar.advance(task)

        return [asdict(f) for f in small_cluster_figures(models, sizes, args.jobs, args.subsets, progress=advance)]


def main(argv: Sequence[str] | None = None) -> int:
    return run(argv, "python -m experiments.small_clusters", __doc__.split("\n\n")[0], _figures, _line, options=_options)


if __name__ == "__main__":
    raise SystemExit(main())
