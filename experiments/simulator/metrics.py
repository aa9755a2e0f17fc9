"""Simulation metrics: job completion times, makespan, GPU-hours, restarts, contention, fairness.

Finish-time fairness (Mahajan et al., "Themis", NSDI'20; used by Sia, SOSP'23)
compares a job's completion time with the time it would take alone on an
equal share of the cluster: ρ = JCT / T_isolated, and a job is treated
unfairly when ρ > 1. Here the share is the cluster divided by the mean number
of active jobs during the job's life (N): on each GPU type the job may use any of
Sia's configurations with at most ``capacity / N`` GPUs (at least one), with
its goodput-optimal configuration and batch in each stretch of progress, and T_isolated is the time to do its work
on the best such type, integrating the changing gradient noise over progress
plus one start (its restart cost: even alone, a job must be launched once; no
queueing and no further restarts). The job's time is counted from the first
scheduling round at or after its arrival, so that round quantisation (up to a
round of waiting, identical for every policy of that round length) does not
dominate short jobs.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from goodput.cluster import Cluster

__all__ = ["summarize", "isolated_time"]

_SEGMENTS = 6  # progress segments of the isolated-time integral


def _segments() -> tuple[np.ndarray, np.ndarray]:
    edges = np.linspace(0.0, 1.0, _SEGMENTS + 1)
    return (edges[:-1] + edges[1:]) / 2.0, np.diff(edges)


@lru_cache(maxsize=65536)
def _best_rate(family: Any, gpu_type: str, num_nodes: int, num_gpus: int, segment: int) -> float:
    mids, _ = _segments()
    progress = mids[segment] * family.work
    best = family.best_config(gpu_type, num_nodes, num_gpus, progress)
    return float(best.goodput[0]) / family.init_batch_size  # progress per second


@lru_cache(maxsize=1024)
def _best_rates(family: Any, pool: Any) -> tuple[np.ndarray, np.ndarray]:
    """The job's configurations of the pool (whole pipelines of a hybrid job): their GPU counts (ascending)
    and, per segment, the best rate among the first k configurations for every k (a running maximum of
    :func:`_best_rate`), shape (configurations, segments)."""
    mids, _ = _segments()
    configs = family.configurations(pool)  # ascending GPU counts
    nodes = np.array([n for _, n, _ in configs], dtype=float)
    gpus = np.array([g for _, _, g in configs], dtype=float)
    candidates = family.candidates(pool.gpu_type, nodes, gpus)  # one optimisation per segment: _best_rate's values
    rates = np.stack([family.best_config(pool.gpu_type, nodes, gpus, m * family.work, candidates=candidates).goodput
                      for m in mids], axis=1) / family.init_batch_size
    return gpus, np.maximum.accumulate(rates, axis=0)


def isolated_time(family: Any, cluster: Cluster, contention: float, restart_cost_s: float | None = None) -> float:
    """Seconds to finish alone on a 1/``contention`` share of the cluster (see module docstring), plus one
    start (``restart_cost_s``, default the family's). A hybrid-parallel job's share is whole pipelines,
    at least one."""
    _, widths = _segments()
    best = np.inf
    share = max(contention, 1.0)
    for pool in cluster:
        configs = family.configurations(pool) if family.supports(pool.gpu_type) else []
        if not configs:
            continue
        gpus, running_max = _best_rates(family, pool)
        allowed = int(np.searchsorted(gpus, max(gpus[0], pool.gpus / share), side="right"))  # configurations that fit
        rates = running_max[allowed - 1]  # the best rate among them, per segment
        if np.all(rates > 0):
            best = min(best, float(np.sum(widths * family.work / rates)))
    return best + (family.restart_cost_s if restart_cost_s is None else restart_cost_s)


def summarize(jobs: Any, rounds: Any, sim_jobs: list[Any], cluster: Cluster, round_s: float = 60.0) -> dict[str, Any]:
    """The summary metrics of one simulation (times in seconds, per-job means).

    Jobs still unfinished when the simulation stopped (``max_hours``) count in the JCT
    figures, the makespan and the finish-time fairness (``unfair_fraction``,
    ``ftf_rho_median``) with their time so far, a lower bound, so that a policy
    leaving jobs behind (or never running them) never looks better for it;
    ``jct_censored`` says so. Jobs that arrive after it stopped never entered it:
    ``not_arrived`` counts them, and no per-job figure does (their JCT so far would
    be 0); with none arrived the JCT figures and the makespan are left out.
    """
    last_round = float(rounds["time_s"].max()) if len(rounds) else -np.inf
    end = float(last_round + round_s) if len(rounds) else float(jobs["arrival_s"].max())
    arrived = jobs[jobs["arrival_s"].to_numpy(dtype=float) <= last_round] if len(jobs) else jobs
    done = jobs[jobs["jct_s"].notna()]
    unfinished = int(len(arrived) - len(done))
    jct = arrived["jct_s"].to_numpy(dtype=float)
    finish = arrived["finish_s"].to_numpy(dtype=float)
    if unfinished:
        jct = np.where(np.isnan(jct), end - arrived["arrival_s"].to_numpy(dtype=float), jct)
        finish = np.where(np.isnan(finish), end, finish)
    summary: dict[str, Any] = {
        "jobs": int(len(jobs)),
        "finished": int(len(done)),
        "unfinished": unfinished,
        "not_arrived": int(len(jobs) - len(arrived)),
        "jct_censored": bool(unfinished),
    }
    if len(arrived):
        summary.update({
            "avg_jct_s": float(np.mean(jct)),
            "median_jct_s": float(np.median(jct)),
            "p99_jct_s": float(np.percentile(jct, 99)),
            "avg_jct_h": float(np.mean(jct) / 3600.0),
            "makespan_s": float(np.max(finish) - arrived["arrival_s"].min()),
        })
    summary["gpu_hours_per_job"] = float(arrived["gpu_hours"].mean()) if len(arrived) else 0.0
    summary["restarts_per_job"] = float(arrived["restarts"].mean()) if len(arrived) else 0.0
    if len(rounds):
        # over time, from the first round to the end: the engine records no round while no job is active
        # (it jumps to the next arrival), and those rounds count as idle (two short jobs 10 h apart on one
        # GPU had averaged to utilisation 1.0, not 0.03)
        slots = max(round((end - float(rounds["time_s"].min())) / round_s), len(rounds))
        summary["contention_mean"] = float(rounds["queued"].sum() / slots)
        summary["contention_max"] = int(rounds["queued"].max())
        summary["utilization_mean"] = float(rounds["utilization"].sum() / slots)
    rho = []
    for job in sim_jobs:
        if not job.active_jobs_seen:
            continue  # arrived after the simulation stopped
        ideal = isolated_time(job.family, cluster, float(np.mean(job.active_jobs_seen)), job.restart_cost_s)
        if np.isfinite(ideal) and ideal > 0:
            first_round = np.ceil(job.spec.time / round_s) * round_s
            finish = job.finish_time if job.finish_time is not None else end  # unfinished: a lower bound of its ρ
            rho.append((finish - first_round) / ideal)
    if rho:
        summary["unfair_fraction"] = float(np.mean(np.array(rho) > 1.0))
        summary["ftf_rho_median"] = float(np.median(rho))
    return summary
