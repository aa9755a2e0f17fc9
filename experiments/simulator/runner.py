"""Running simulations: one (workload, policy) pair, or a sweep in parallel processes.

Simulations run in worker processes; their results come back to the parent,
which writes the files and logs every run to MLflow itself (one writer: no
contention on the sqlite store), as child runs of one parent run per sweep.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from goodput.cluster import Cluster
from goodput.errors import ValidationError
from goodput.validation import check_int

from .engine import SimConfig, SimResult, Simulator
from .truth import CATALOG_PATH, Family, catalog_workload_stats, check_cluster_types, load_catalog, load_measured
from .workload import WorkloadJob, read_workload, synthetic_workload

__all__ = ["Task", "check_task", "load_truth", "load_workloads", "run_task", "run_sweep", "truth_settings",
           "DEFAULT_CLUSTER"]

DEFAULT_CLUSTER = "t4:6x4,a100:2x8,rtx2080ti:3x8"  # Sia's 64-GPU, three-type setup


@dataclass(frozen=True)
class Task:
    """One simulation to run (picklable, for worker processes)."""

    workload_name: str
    jobs: tuple[WorkloadJob, ...]
    policy: str
    cluster: str
    truth: str = "catalog"  # "catalog", a catalog JSON path, or a measured-tables directory
    default_gpu_type: str = "t4"
    seed: int = 0
    round_s: float | None = None
    config: dict[str, Any] = field(default_factory=dict)  # extra SimConfig fields
    policy_options: dict[str, Any] = field(default_factory=dict)  # make_policy options, e.g. goodput_quantile

    def __post_init__(self) -> None:
        names: set[str] = set()
        for job in self.jobs:
            if job.name in names:
                raise ValidationError("workload", job.name, "duplicate job name")
            names.add(job.name)


def load_truth(truth: str, cluster: Cluster, default_gpu_type: str = "t4", *,
               applications: Iterable[str] | None = None, skipped: dict[str, str] | None = None) -> dict[str, Family]:
    """Families from the built-in catalog, another catalog file, or a measured-tables directory.

    From a directory only ``applications`` (a workload's; ``None``: all) are loaded, so that a bad
    table of another model stops nothing; ``skipped`` receives each folder left out and why
    (:func:`~experiments.simulator.truth.load_measured`).

    Raises :class:`~goodput.errors.ValidationError` when a GPU type of ``cluster`` has no data in the truth
    (of those applications), :class:`~goodput.errors.DataFormatError` for a bad table of a needed one.
    """
    catalog = CATALOG_PATH if truth == "catalog" else (Path(truth) if Path(truth).is_file() else None)
    if catalog is not None:
        families: dict[str, Family] = dict(load_catalog(catalog, cluster.gpu_types))
        known = {g for family in families.values() for g in family.gpu_types}
        # a type missing: the message lists what the whole catalog covers (the families above are cut to the cluster's)
        covered = None if set(cluster.gpu_types) <= known else {g for f in load_catalog(catalog).values() for g in f.gpu_types}
    else:
        families = dict(load_measured(Path(truth), default_gpu_type=default_gpu_type, applications=applications,
                                      skipped=skipped))
        covered = None
    check_cluster_types(families, cluster, covered)
    return families


def truth_settings(truth: str, default_gpu_type: str = "t4") -> dict[str, Any]:
    """The ground truth's settings to record with a run: its source and, for measured tables, the GPU type
    of tables without a type suffix (it changes what the tables mean)."""
    if truth == "catalog" or Path(truth).is_file():
        return {"truth": truth}
    return {"truth": truth, "truth_gpu_type": default_gpu_type}


def load_workloads(source: str | None, families: dict[str, Family], *, synthetic: int = 0, seed: int = 0,
                   hours: float = 8.0, catalog: Path = CATALOG_PATH) -> list[tuple[str, list[WorkloadJob]]]:
    """``[(name, jobs)]`` from a CSV file, every ``*.csv`` of a directory, or the synthetic generator."""
    if source:
        path = Path(source)
        if path.is_dir():
            files = sorted(path.glob("*.csv"), key=lambda p: (len(p.stem), p.stem))
            if not files:
                raise FileNotFoundError(f"no workload CSV files in {path}")
            return [(p.stem, read_workload(p)) for p in files]
        return [(path.stem, read_workload(path))]
    count = synthetic or 160
    window = "" if hours == 8.0 else f"-{hours:g}h"  # another arrival window is another workload
    return [(f"synthetic-{count}-seed{seed}{window}",
             synthetic_workload(catalog_workload_stats(catalog), families, num_jobs=count, hours=hours, seed=seed))]


def check_task(task: Task, families: Mapping[str, Family] | None = None) -> None:
    """Raise :class:`~goodput.errors.ValidationError` for a task's policy settings (``round_s``, options) or
    simulation settings that :func:`run_task` would refuse, without loading its truth or running it; with
    the truth's ``families``, also for a workload the simulator would refuse (an unknown application, a
    hybrid job the policy cannot run), so that a sweep fails before any of it runs."""
    cluster = Cluster.parse(task.cluster)
    policy, config = _policy_and_config(task, cluster)
    if families is not None:
        Simulator(task.jobs, families, config, policy)  # validates the workload; runs nothing


def _policy_and_config(task: Task, cluster: Cluster) -> tuple[Any, SimConfig]:
    from .policies import make_policy

    policy = make_policy(task.policy, round_s=task.round_s, **task.policy_options)
    return policy, SimConfig(cluster=cluster, seed=task.seed, **task.config)


def run_task(task: Task) -> tuple[Task, SimResult]:
    """Run one simulation (in whichever process calls it)."""
    cluster = Cluster.parse(task.cluster)
    families = load_truth(task.truth, cluster, task.default_gpu_type, applications={job.application for job in task.jobs})
    policy, config = _policy_and_config(task, cluster)
    result = Simulator(task.jobs, families, config, policy).run()
    result.settings.update(truth_settings(task.truth, task.default_gpu_type))
    return task, result


def run_sweep(tasks: Sequence[Task], processes: int | None = None,
              on_done: Callable[[Task, SimResult], None] | None = None, *, backend: str = "processes",
              address: str | None = None) -> list[tuple[Task, SimResult]]:
    """Run tasks in parallel; ``on_done`` sees each result as it arrives (in this process); results in ``tasks``' order.

    ``backend``: ``"processes"`` (``processes`` local worker processes, default the CPU count) or
    ``"ray"`` (a Ray task of one CPU per simulation on the cluster at ``address``; see
    :func:`profilers.rayutil.connected`). Both give the same results: a simulation depends on its task only.
    Every task's settings are checked first (:func:`check_task`), here: a bad one fails before any runs.
    """
    if backend not in ("processes", "ray"):
        raise ValidationError("backend", backend, "expected 'processes' or 'ray'")
    if processes is not None:
        if backend == "ray":
            raise ValidationError("processes", processes, "sets local worker processes; with backend='ray' Ray places the tasks")
        processes = check_int("processes", processes, minimum=1)
    for task in tasks:
        check_task(task)
    if backend == "ray":
        from profilers.rayutil import connected, map_tasks

        with connected(address, "run_sweep(backend='ray')"):
            return map_tasks(run_task, list(tasks), on_result=None if on_done is None else lambda _, pair: on_done(*pair))
    processes = processes or min(len(tasks), os.cpu_count() or 1)
    results: list[tuple[Task, SimResult]] = []
    if processes <= 1 or len(tasks) == 1:
        for task in tasks:
            pair = run_task(task)
            results.append(pair)
            if on_done:
                on_done(*pair)
        return results
    by_index: dict[int, tuple[Task, SimResult]] = {}
    # spawn, not fork: the parent may hold live threads (torch's pools, a progress bar's refresh
    # thread), and a forked child of a multithreaded process can deadlock on a lock one of them held.
    pool = ProcessPoolExecutor(max_workers=processes, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = {pool.submit(run_task, task): i for i, task in enumerate(tasks)}
        for future in as_completed(futures):
            pair = future.result()
            by_index[futures[future]] = pair
            if on_done:
                on_done(*pair)
    except BaseException:
        # a failed simulation or Ctrl-C stops the sweep now: leaving the pool's with-block had waited for
        # every queued simulation (their results then discarded), and a worker that took Ctrl-C as its task's
        # error went on to the next one. What on_done has seen is kept.
        workers = list((getattr(pool, "_processes", None) or {}).values())  # shutdown() forgets them
        pool.shutdown(wait=False, cancel_futures=True)
        for process in workers:
            process.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [by_index[i] for i in range(len(tasks))]
