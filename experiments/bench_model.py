"""Bayesian JobModel speed: online update + goodput table, full refit (issue: Bayesian JobModel).

Targets on this CPU (issue 34): ``observe()`` of one observation plus a fresh
goodput table of 20 configurations, for a model holding 200 observations,
≤ 10 ms median; a full refit (the MAP parameters, the GP hyperparameters, the
posterior) of that model ≤ 1 s.

Observations are generated from illustrative parameters of three GPU types
(``experiments.bench_core.TYPES``, not measurements) with 3% noise. The last
rows time the path a scheduler takes for a job that is still partly predicted
by transfer: a cluster prior of 5 other jobs (its hierarchy fitted once per
prior), and a job with 1-GPU observations on every type and multi-GPU ones on
one node of one type.

Run: ``python -m experiments.bench_model`` (or ``make bench``).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from experiments.bench_core import TYPES, observations
from experiments.benchutil import parser, report, time_call
from goodput import Cluster, JobModel, Observation
from goodput.throughput import ThroughputParams, predict_step_time
from goodput.hierarchy import ClusterPrior

CLUSTER_20 = "t4:7x4,a100:2x8,rtx2080ti:3x8"  # Sia's configuration set: 20 configurations


def bench_observations(count: int, seed: int = 0) -> list[Observation]:
    out = []
    per_type = count // len(TYPES)
    for i, gpu in enumerate(TYPES):
        out += observations(gpu, per_type + (count - per_type * len(TYPES) if i == 0 else 0), seed=seed + i)
    out.append(Observation(job="bench", gpu_type="t4", num_nodes=1, num_replicas=1, local_bsz=128,
                           step_time=float(predict_step_time(TYPES["t4"], 1, 1, 128)), grad_sqr=1.0, grad_var=4.0))
    return out


def model_with(obs: list[Observation]) -> JobModel:
    """A model holding ``obs``, refitted from scratch (MAP parameters, GP hyperparameters, posterior)."""
    model = JobModel("bench", init_batch_size=128, max_batch_size=4096, local_bsz_bounds=(8, 512))
    return model.observe(obs).refit()


def other_jobs(count: int = 5, per_type: int = 60) -> dict[str, list[Observation]]:
    """``count`` other jobs on the same types: the benchmark's parameters with their sync costs × 0.5–2."""
    out = {}
    for j, factor in enumerate(np.geomspace(0.5, 2.0, count)):
        name = f"other-{j}"
        out[name] = []
        for i, (gpu, p) in enumerate(TYPES.items()):
            params = ThroughputParams(p.alpha_c, p.beta_c, p.alpha_n * factor, p.beta_n * factor, p.alpha_r * factor,
                                      p.beta_r * factor, p.gamma)
            out[name] += observations(gpu, per_type, seed=100 + 10 * j + i, params=params, job=name)
    return out


def partly_transferred(count: int) -> list[Observation]:
    """A job with 1-GPU observations on every type and single-node multi-GPU ones on t4 (P2's situation)."""
    single = [o for o in bench_observations(4 * count, seed=3) if o.num_replicas == 1]
    multi = [o for o in observations("t4", 4 * count, seed=4) if o.num_replicas > 1 and o.num_nodes == 1]
    return (single[: count // 2] + multi[: count - count // 2])[:count]


def main(argv: list[str] | None = None) -> int:
    args = parser("bench_model", __doc__).parse_args(argv)
    reps = 10 if args.quick else 50
    rows = []
    cluster = Cluster.parse(CLUSTER_20)
    assert len(cluster.configurations()) == 20

    obs200 = bench_observations(199)
    model = model_with(obs200)
    stream = iter(observations("a100", 10_000, seed=99))
    refits = model.refits

    def observe_and_table() -> None:
        model.observe(next(stream))
        model.table(cluster)

    online = time_call(observe_and_table, repeat=reps)
    rows.append({"what": "observe(1) + table(20 configurations), 200 observations", "median_ms": online["median_s"] * 1e3,
                 "p95_ms": online["p95_s"] * 1e3, "target_ms": 10.0, "refits_during": model.refits - refits})

    obs200b = bench_observations(199, seed=1)
    refit = time_call(lambda: model_with(obs200b), repeat=3 if args.quick else 7, warmup=1)
    rows.append({"what": "full refit from scratch, 200 observations", "median_ms": refit["median_s"] * 1e3,
                 "p95_ms": refit["p95_s"] * 1e3, "target_ms": 1000.0})
    fresh = model_with(obs200b)
    extra = iter(observations("rtx2080ti", 10_000, seed=7))

    def scheduled_refit() -> None:  # what the refit policy runs: one type's data changed, hyperparameters warm-started
        fresh.observe(next(extra))
        fresh.refit()

    warm = time_call(scheduled_refit, repeat=3 if args.quick else 7)
    rows.append({"what": "scheduled refit (one type changed), 200 observations", "median_ms": warm["median_s"] * 1e3,
                 "p95_ms": warm["p95_s"] * 1e3})

    table_only = time_call(lambda: fresh.table(cluster), repeat=reps)
    rows.append({"what": "table(20 configurations) alone, 200 observations", "median_ms": table_only["median_s"] * 1e3,
                 "p95_ms": table_only["p95_s"] * 1e3})
    nodes = np.ones(1000)
    replicas = np.tile([1.0, 2.0, 4.0, 8.0], 250)
    bsz = np.linspace(8, 512, 1000)
    batch = time_call(lambda: fresh.predict("t4", nodes, replicas, bsz), repeat=reps)
    rows.append({"what": "predict 1000 configurations with std", "median_ms": batch["median_s"] * 1e3, "p95_ms": batch["p95_s"] * 1e3})

    # a job partly predicted by transfer, with a cluster prior (its hierarchy and GP prior)
    jobs = other_jobs()
    started = time.perf_counter()
    prior = ClusterPrior.from_observations(jobs)
    built = time.perf_counter() - started
    started = time.perf_counter()
    prior.fitted()
    hierarchy = time.perf_counter() - started
    rows.append({"what": "cluster prior of 5 jobs × 3 types: cell fits and GP prior (once per prior)", "median_ms": built * 1e3,
                 "p95_ms": built * 1e3})
    rows.append({"what": "... its hierarchy by EM (once per prior)", "median_ms": hierarchy * 1e3, "p95_ms": hierarchy * 1e3})
    partial = partly_transferred(200)
    transfer_model = JobModel("bench", init_batch_size=128, max_batch_size=4096, local_bsz_bounds=(8, 512), cluster_prior=prior)
    transfer_model.observe(partial[:-20]).refit()
    more = iter(partial[-20:] * 10)
    refits = transfer_model.refits

    def observe_and_table_transfer() -> None:
        transfer_model.observe(next(more))
        transfer_model.table(cluster)

    online_transfer = time_call(observe_and_table_transfer, repeat=min(reps, 20))
    rows.append({"what": "observe(1) + table(20), 200 observations, 2 of 3 types by transfer, cluster prior",
                 "median_ms": online_transfer["median_s"] * 1e3, "p95_ms": online_transfer["p95_s"] * 1e3, "target_ms": 10.0,
                 "refits_during": transfer_model.refits - refits})
    refit_transfer = time_call(lambda: JobModel("bench", init_batch_size=128, cluster_prior=prior).observe(partial).refit(),
                               repeat=3 if args.quick else 7, warmup=1)
    rows.append({"what": "full refit from scratch of that model", "median_ms": refit_transfer["median_s"] * 1e3,
                 "p95_ms": refit_transfer["p95_s"] * 1e3, "target_ms": 1000.0})
    for row in rows:
        if "target_ms" in row:
            row["meets_target"] = row["median_ms"] <= row["target_ms"]
    report("bench_model", rows, args, extra={"gp_points": fresh.diagnostics["gp_points"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
