"""Core model speed: Pollux fit, goodput optimisation, goodput table (issue: foundation).

Targets on a 2-core CPU: ``fit_throughput`` on 100 observations < 0.2 s
(AdaptDL's fit: 0.2 s per the Pollux paper), optimisation of one configuration
< 0.2 ms (Pollux's ``optimize``: 0.4 ms), a full goodput table for a 64-GPU
3-type cluster < 5 ms.

Run: ``python -m experiments.bench_core`` (or ``make bench``).
"""

from __future__ import annotations

import sys

import numpy as np

from experiments.benchutil import parser, report, time_call
from goodput import Cluster, JobModel, Observation
from goodput.efficiency import efficiency
from goodput.optimize import BatchLimits, optimize_goodput
from goodput.throughput import ThroughputParams, _step_time, fit_throughput, predict_step_time

CLUSTER_64 = "t4:6x4,a100:2x8,rtx2080ti:3x8"  # Sia's 64-GPU three-type cluster

# Parameters that generate benchmark inputs (shapes like the Pollux T4 fits; not a measurement).
TYPES = {
    "t4": ThroughputParams(0.017, 0.0007, 0.12, 0.0024, 0.031, 0.0012, 2.0),
    "a100": ThroughputParams(0.006, 0.0002, 0.06, 0.002, 0.008, 0.0004, 1.8),
    "rtx2080ti": ThroughputParams(0.010, 0.0004, 0.09, 0.002, 0.02, 0.0008, 1.9),
}


def observations(gpu_type: str, count: int, seed: int = 0, *, params: ThroughputParams | None = None,
                 job: str = "bench") -> list[Observation]:
    """``count`` noisy observations of ``job`` on ``gpu_type`` (parameters: ``TYPES[gpu_type]`` unless given)."""
    rng = np.random.default_rng(seed)
    params = TYPES[gpu_type] if params is None else params
    configs = [(1, 1), (1, 2), (1, 4), (2, 8), (3, 12), (4, 16)]
    out = []
    for i in range(count):
        nodes, replicas = configs[i % len(configs)]
        bsz = int(2 ** rng.uniform(3, 9))
        accum = int(rng.integers(0, 3))
        step = float(predict_step_time(params, nodes, replicas, bsz, accum)) * float(np.exp(rng.normal(0, 0.03)))
        out.append(Observation(job=job, gpu_type=gpu_type, num_nodes=nodes, num_replicas=replicas,
                               local_bsz=bsz, accum_steps=accum, step_time=step))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser("bench_core", __doc__).parse_args(argv)
    reps = 5 if args.quick else 30
    rows = []

    obs100 = observations("t4", 100)
    fit = time_call(lambda: fit_throughput(obs100), repeat=reps)
    rows.append({"what": "fit_throughput, 100 observations", "median_ms": fit["median_s"] * 1e3,
                 "p95_ms": fit["p95_s"] * 1e3, "target_ms": 200.0})

    theta = TYPES["t4"].as_array()
    limits = BatchLimits(init_batch_size=128, max_batch_size=4096, max_local_bsz=512)

    def optimise_one():
        optimize_goodput(lambda n, r, b, a: _step_time(theta, n, r, b, a),
                         lambda m: efficiency(1.0, 4.0, 128, m), 2, 8, limits)

    opt = time_call(optimise_one, repeat=reps, number=200)
    rows.append({"what": "optimize_goodput, one configuration", "median_ms": opt["median_s"] * 1e3,
                 "p95_ms": opt["p95_s"] * 1e3, "target_ms": 0.2})

    cluster = Cluster.parse(CLUSTER_64)
    # The targets are the plain Pollux model's (bayesian=False); the Bayesian model's own
    # targets (online update + table) are in bench_model.
    for bayesian, label, targets in ((False, "plain Pollux", (0.2, 5.0)), (True, "Bayesian", (None, None))):
        model = JobModel("bench", init_batch_size=128, max_batch_size=4096, local_bsz_bounds=(8, 512), bayesian=bayesian)
        for i, gpu in enumerate(TYPES):
            model.observe(observations(gpu, 60, seed=i))
        model.observe(Observation(job="bench", gpu_type="t4", num_nodes=1, num_replicas=1, local_bsz=128,
                                  step_time=0.1, grad_sqr=1.0, grad_var=4.0))
        for gpu in TYPES:
            model.params(gpu)  # fit once; the table timing is the scheduler's per-round cost
        one = time_call(lambda: model.goodput("t4", 2, 8), repeat=reps, number=200)
        rows.append({"what": f"JobModel.goodput, one configuration ({label})", "median_ms": one["median_s"] * 1e3,
                     "p95_ms": one["p95_s"] * 1e3, "target_ms": targets[0]})
        table = time_call(lambda: model.table(cluster), repeat=reps, number=20)
        rows.append({"what": f"JobModel.table, {CLUSTER_64} (19 configurations, {label})", "median_ms": table["median_s"] * 1e3,
                     "p95_ms": table["p95_s"] * 1e3, "target_ms": targets[1]})
    for row in rows:
        if row.get("target_ms") is not None:
            row["meets_target"] = row["median_ms"] <= row["target_ms"]
    report("bench_core", rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
