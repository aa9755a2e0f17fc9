"""Workloads: jobs arriving over time, from a CSV or a synthetic Philly-like generator.

CSV format (Pollux's ``workloads/workload-N.csv``, plus an optional column)::

    name,time,application,num_replicas,batch_size[,category]

``time`` is the arrival in seconds from the start; ``num_replicas`` and
``batch_size`` are what the job's owner asked for (used by policies that do
not adapt them: Gavel, FIFO). A malformed row raises
:class:`~goodput.errors.DataFormatError` naming the file and line.

The synthetic generator draws arrivals from the hour-of-day profile of the
Microsoft Philly trace and applications from the Pollux workloads' mix, both
summarised in the catalog (``catalog.json``'s ``workload`` block); requested GPU
counts follow Philly's distribution, capped where a job cannot use them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments.datasets import read_csv_rows
from goodput.errors import DataFormatError, ValidationError
from goodput.validation import check_float, check_int, check_str

__all__ = ["WorkloadJob", "read_workload", "synthetic_workload"]


@dataclass(frozen=True)
class WorkloadJob:
    """One job of a workload.

    Attributes:
        name: unique job name.
        time: arrival, seconds from the start of the workload.
        application: the job family (``"cifar10"``; must exist in the ground truth).
        num_replicas: GPUs the job's owner requested.
        batch_size: total batch the owner requested, samples.
        category: an optional label (e.g. a size class), carried into the results.
    """

    name: str
    time: float
    application: str
    num_replicas: int
    batch_size: int
    category: str | None = None

    def __post_init__(self) -> None:
        check_str("name", self.name)
        check_float("time", self.time, nonnegative=True)
        check_str("application", self.application)
        check_int("num_replicas", self.num_replicas, minimum=1)
        check_int("batch_size", self.batch_size, minimum=1)


def read_workload(path: str | os.PathLike[str]) -> list[WorkloadJob]:
    """Jobs of a workload CSV, sorted by arrival; names must be unique."""
    schema = {"name": "str", "time": "float0", "application": "str", "num_replicas": "int+", "batch_size": "int+"}
    jobs: list[WorkloadJob] = []
    seen: dict[str, int] = {}
    for line_no, row in read_csv_rows(path, schema, optional={"category": "str"}):
        if row["name"] in seen:
            raise DataFormatError(path, line_no, "name", row["name"], f"duplicate job name (first on line {seen[row['name']]})")
        seen[row["name"]] = line_no
        jobs.append(WorkloadJob(row["name"], row["time"], row["application"], row["num_replicas"], row["batch_size"],
                                row.get("category")))
    if not jobs:
        raise DataFormatError(path, None, "rows", 0, "the workload holds no jobs")
    return sorted(jobs, key=lambda j: (j.time, j.name))


def synthetic_workload(
    stats: Mapping[str, Any],
    families: Mapping[str, Any],
    *,
    num_jobs: int = 160,
    hours: float = 8.0,
    start_hour: int = 3,
    seed: int = 0,
) -> list[WorkloadJob]:
    """A Philly-like workload of ``num_jobs`` arrivals over ``hours``.

    Args:
        stats: the catalog's workload statistics (``applications`` mix,
            ``num_gpus`` distribution, ``hourly_arrivals`` profile).
        families: the ground-truth families (for batch limits); applications
            absent from it are left out of the mix.
        start_hour: hour of day the window starts at (Pollux sampled Philly
            hours 3–10).
        seed: the random seed; the same seed gives the same workload.
    """
    num_jobs = check_int("num_jobs", num_jobs, minimum=1)
    hours = check_float("hours", hours, positive=True)
    rng = np.random.default_rng(seed)
    mix = {k: v for k, v in stats["applications"].items() if k in families}
    if not mix:
        raise ValidationError("applications", list(stats["applications"]), "none of them is in the ground truth")
    names = sorted(mix)
    probs = np.array([mix[n] for n in names], dtype=float)
    probs /= probs.sum()
    # Arrivals: inverse CDF of the piecewise-constant hourly rate over the window.
    profile = np.array(stats["hourly_arrivals"], dtype=float)
    edges = np.arange(0.0, hours + 1e-9, 1.0)
    if edges[-1] < hours:
        edges = np.append(edges, hours)
    rates = np.array([profile[int(start_hour + h) % 24] for h in edges[:-1]])
    mass = rates * np.diff(edges)
    cdf = np.concatenate([[0.0], np.cumsum(mass) / mass.sum()])
    times = np.sort(np.interp(rng.uniform(0.0, 1.0, num_jobs), cdf, edges)) * 3600.0
    gpu_counts = np.array([int(k) for k in stats["num_gpus"]])
    gpu_probs = np.array(list(stats["num_gpus"].values()), dtype=float)
    gpu_probs /= gpu_probs.sum()
    jobs = []
    for i, t in enumerate(times):
        app = names[rng.choice(len(names), p=probs)]
        family = families[app]
        max_useful = max(1, family.max_batch_size // family.min_local_bsz)
        replicas = int(min(rng.choice(gpu_counts, p=gpu_probs), max_useful))
        # The owner scales the reference batch with the GPUs asked for (weak scaling), within limits.
        batch = int(min(max(family.init_batch_size * replicas, family.init_batch_size), family.max_batch_size))
        jobs.append(WorkloadJob(f"{app}-{i}", round(float(t), 1), app, replicas, batch))
    return jobs


def write_workload(jobs: list[WorkloadJob], path: str | os.PathLike[str]) -> Path:
    """Write jobs in the CSV format :func:`read_workload` reads (atomically)."""
    import csv
    import io

    from goodput.io import atomic_write_text

    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")  # quotes a name or category holding a comma
    writer.writerow(["name", "time", "application", "num_replicas", "batch_size", "category"])
    writer.writerows([j.name, repr(float(j.time)), j.application, j.num_replicas, j.batch_size, j.category or ""]
                     for j in jobs)  # repr: the arrival time to the last bit (":g" had kept 6 digits)
    return atomic_write_text(path, text.getvalue())
