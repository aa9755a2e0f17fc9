"""Allocator speed and quality at Sia's scale (issue 5).

Clusters of 64, 256, 1024, 2048 and 8192 GPUs over three GPU types, in the
proportions of Sia's 64-GPU cluster (SOSP'23 §5: 24 + 16 + 24 GPUs, 4-GPU and
8-GPU nodes): ``t4:6kx4, v100:2kx8, k80:3kx8`` for k = 1, 4, 16, 32, 128, with
160 jobs per 64 GPUs (Sia's scaling experiment, §5.5). Targets: median policy
time ≤ 100 ms at 64 GPUs and ≤ 1 s at 2048 GPUs (Sia reports 96 ms and about
1 s), objective within 0.5% of the exact MILP optimum.

Goodput tables come from realistic models (when ``../shared/data`` is present):

* throughput on T4: Pollux's model fitted with ``fit_throughput`` to each
  model's measured steps in ``pollux/traces/<model>/`` (bert, cifar10,
  deepspeech2, imagenet, ncf, yolov3), micro-batch limit = the largest
  measured ``local_bsz``;
* V100 and K80: the T4 compute terms (α_c, β_c) divided by the model's
  per-type speed ratio from Gavel's measured single-GPU throughputs
  (``gavel/simulation_throughputs.json``; geometric mean over batch sizes of
  steps/s on the type over steps/s on P100), taking the T4 as P100-equivalent
  (the one assumption joining the two artifacts: no dataset measures both);
  sync terms are kept. Model pairs: cifar10→ResNet-18, imagenet→ResNet-50,
  yolov3→ResNet-50, bert→Transformer, deepspeech2→LM, ncf→Recommendation;
* statistical efficiency from the gradient statistics of an epoch drawn from
  ``validation-<M0>.csv`` (epochs with |g|² = 0 skipped); batch between M0 and the largest M with a
  validation trace; configurations up to 64 GPUs per job (Sia's set is capped
  at 64 GPUs too);
* the job mix from the applications of ``pollux/workloads/workload-*.csv``;
  each job's table is one of 6 models × 16 epochs, times log-normal noise
  (σ = 5%) per configuration so that no two jobs are identical.

Without the data a synthetic family stands in (documented in
``synthetic_zoo``; the output says which was used).

Sizes are GPU counts (160 jobs per 64 GPUs) or ``GPUSxJOBS``; by default also
``2048x1024`` (issue 35: ≤ 100 ms median). ``scheduler round 2048x1024`` is
``allocate`` as the simulator calls it at that size: Sia's full configuration
set per job (true goodput tables of the built-in catalog's families at random
progress, ~190 rows per job), ``JobSpec`` ages and restarts, the last round's
``Allocation`` as ``current`` (its GPU prices start the fast path), a tenth of
the jobs' tables changing each round; the last round is compared with the
exact MILP.

Per size and seed: ``allocate`` on fresh tables (cold: includes reading the
tables' columns), then repeated (warm), the forced fast path, and the exact
MILP (``solve_milp`` with a time limit) for the optimum. Also: the
simulator's round (64 GPUs, 50 jobs, ``current`` passed in) and, at 1024
GPUs, the MILP with HiGHS presolve on (why it is off by default).

Columns: ``median_ms``/``p95_ms`` of ``allocate`` (warm, all seeds pooled),
``cold_ms`` the first call on fresh tables, ``fast_ms``/``fast_gap`` the
forced fast path and its certified gap (largest over seeds), ``milp_s`` the
exact MILP, ``vs_opt`` the largest relative excess of the default answer over
the MILP optimum (where it finished); ``sim round 64`` is the simulator's
round (50 jobs, ``current`` given), ``milp+presolve 1024`` the MILP with
presolve on. The JSON's ``details`` hold every sample, the MILP statuses and
the fast path's distance to the optimum.

Run: ``python -m experiments.bench_allocator [--quick] [--sizes 64,2048,2048x1024] [--scheduler-rounds 10]
[--milp-time-limit 60]``.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.benchutil import check_options, parser, report
from goodput import Cluster, GoodputTable, allocate
from goodput.allocator.problem import prepare, sia_problem
from goodput.allocator.sia import solve_milp
from goodput.efficiency import efficiency
from goodput.optimize import BatchLimits, optimize_goodput
from goodput.throughput import ThroughputParams, _step_time, fit_throughput

SCALES = {64: 1, 256: 4, 1024: 16, 2048: 32, 8192: 128}
JOBS_PER_64 = 160
TYPES = ("t4", "v100", "k80")
M0 = {"bert": 12, "cifar10": 128, "deepspeech2": 20, "imagenet": 200, "ncf": 256, "yolov3": 8}
GAVEL_MODEL = {"cifar10": "resnet-18", "imagenet": "resnet-50", "yolov3": "resnet-50", "bert": "transformer",
               "deepspeech2": "lm", "ncf": "recommendation"}
MAX_GPUS_PER_JOB = 64
EPOCHS_PER_MODEL = 16
NOISE = 0.05


def cluster_for(gpus: int) -> Cluster:
    k = SCALES[gpus]
    return Cluster.parse(f"t4:{6 * k}x4,v100:{2 * k}x8,k80:{3 * k}x8")


@dataclass
class JobKind:
    """One model: throughput parameters per GPU type, batch limits, gradient statistics per epoch."""

    name: str
    params: dict[str, ThroughputParams]
    init_batch_size: int
    max_batch_size: int
    max_local_bsz: int
    grad_stats: list[tuple[float, float]]  # (grad_sqr, grad_var) per epoch
    weight: float  # share of the job mix


def load_zoo(data_dir: Path, max_observations: int | None = None) -> tuple[list[JobKind], str]:
    """Models fitted to the Pollux traces, other types from Gavel's ratios (see the module docstring).

    ``max_observations`` fits each model to an evenly spaced subset (smoke runs).
    """
    from experiments.datasets import read_csv_rows, read_gavel_throughputs, read_pollux_trace

    traces = data_dir / "pollux" / "traces"
    gavel = read_gavel_throughputs(data_dir / "gavel" / "simulation_throughputs.json",
                                   gpu_types=["k80", "p100", "v100"], include_unconsolidated=False)
    steps: dict[tuple[str, str, int], float] = {}
    for obs in gavel.observations:
        if obs.num_replicas == 1:
            steps[(obs.job, obs.gpu_type, obs.local_bsz)] = 1.0 / obs.step_time
    ratios: dict[str, dict[str, float]] = {}
    for model in sorted(set(GAVEL_MODEL.values())):  # a fixed order, whatever PYTHONHASHSEED is
        for gpu in ("v100", "k80"):
            logs = [np.log(steps[(m, gpu, b)] / steps[(m, "p100", b)]) for (m, g, b) in steps
                    if m == model and g == "p100" and (m, gpu, b) in steps]
            ratios.setdefault(model, {})[gpu] = float(np.exp(np.mean(logs)))
    mix: dict[str, int] = {}
    for path in sorted((data_dir / "pollux").glob("workloads/workload-*.csv")):
        for line in path.read_text().splitlines()[1:]:
            app = line.split(",")[2]
            mix[app] = mix.get(app, 0) + 1
    zoo = []
    for name, m0 in M0.items():
        profile = read_pollux_trace(traces / name)
        observations = profile.observations
        if max_observations is not None and len(observations) > max_observations:
            observations = observations[:: -(-len(observations) // max_observations)]
        t4 = fit_throughput(observations)
        params = {"t4": t4}
        for gpu in ("v100", "k80"):
            r = ratios[GAVEL_MODEL[name]][gpu]
            params[gpu] = ThroughputParams(t4.alpha_c / r, t4.beta_c / r, t4.alpha_n, t4.beta_n, t4.alpha_r,
                                           t4.beta_r, t4.gamma)
        batches = [int(p.stem.split("-")[1]) for p in (traces / name).glob("validation-*.csv")]
        # read_validation rejects |g|² = 0, which deepspeech2's validation-20.csv holds at one epoch;
        # such an epoch says nothing about the noise scale, so it is skipped here
        schema = {"progress": "float0", "iteration": "int0", "metric": "float", "grad_sqr": "float0", "grad_var": "float0"}
        rows = [r for _, r in read_csv_rows(traces / name / f"validation-{m0}.csv", schema) if r["grad_sqr"] > 0]
        zoo.append(JobKind(name, params, m0, max(batches), max(o.local_bsz for o in profile.observations),
                           [(r["grad_sqr"], r["grad_var"]) for r in rows], float(mix.get(name, 1))))
    ratio_text = ", ".join(f"{m}: v100 {r['v100']:.2f}x, k80 {r['k80']:.2f}x" for m, r in sorted(ratios.items()))
    return zoo, f"pollux traces (T4 fits) + gavel per-type ratios vs P100 ({ratio_text})"


def synthetic_zoo(rng: np.random.Generator) -> tuple[list[JobKind], str]:
    """Stand-in when the data is absent: six models of Pollux-fit-like shape (illustrative, not measured).

    T4 compute 5–40 ms + 0.1–2 ms/sample, sync 20–150 ms across nodes; V100
    2.5× and K80 0.35× the T4's compute speed; noise scale φ log-uniform in
    [M0, 50·M0].
    """
    zoo = []
    for i, (name, m0) in enumerate(M0.items()):
        t4 = ThroughputParams(rng.uniform(0.005, 0.04), rng.uniform(1e-4, 2e-3), rng.uniform(0.05, 0.15),
                              rng.uniform(1e-3, 5e-3), rng.uniform(0.02, 0.05), rng.uniform(5e-4, 2e-3), 1.5)
        params = {"t4": t4}
        for gpu, r in (("v100", 2.5), ("k80", 0.35)):
            params[gpu] = ThroughputParams(t4.alpha_c / r, t4.beta_c / r, t4.alpha_n, t4.beta_n, t4.alpha_r,
                                           t4.beta_r, t4.gamma)
        phis = m0 * np.exp(rng.uniform(0, np.log(50), EPOCHS_PER_MODEL))
        zoo.append(JobKind(name, params, m0, 32 * m0, 4 * m0, [(1.0, phi / m0) for phi in phis], 1.0 + i))
    return zoo, "synthetic family (no ../shared/data)"


def kind_tables(zoo: list[JobKind], cluster: Cluster, rng: np.random.Generator):
    """Goodput per configuration for each (model, epoch): a list of (kind index, configs, goodput array)."""
    configs = [c for c in cluster.configurations() if c[2] <= MAX_GPUS_PER_JOB]
    out = []
    for k, kind in enumerate(zoo):
        picks = rng.choice(len(kind.grad_stats), size=min(EPOCHS_PER_MODEL, len(kind.grad_stats)), replace=False)
        for pick in picks:
            grad_sqr, grad_var = kind.grad_stats[int(pick)]
            goodput = np.zeros(len(configs))
            for gpu in TYPES:
                idx = [i for i, c in enumerate(configs) if c[0] == gpu]
                theta = kind.params[gpu].as_array()
                nodes = np.array([configs[i][1] for i in idx], dtype=float)
                gpus = np.array([configs[i][2] for i in idx], dtype=float)
                limits = BatchLimits(kind.init_batch_size, kind.max_batch_size, 1, kind.max_local_bsz)
                best = optimize_goodput(lambda n, r, b, a, th=theta: _step_time(th, n, r, b, a),
                                        lambda m, s=grad_sqr, v=grad_var, m0=kind.init_batch_size: efficiency(s, v, m0, m),
                                        nodes, gpus, limits)
                goodput[idx] = best.goodput
            out.append((k, configs, goodput))
    return out


def make_tables(pool, zoo: list[JobKind], n_jobs: int, rng: np.random.Generator) -> dict[str, GoodputTable]:
    import pandas as pd

    weights = np.array([zoo[k].weight for k, _, _ in pool])
    picks = rng.choice(len(pool), size=n_jobs, p=weights / weights.sum())
    tables = {}
    for j, p in enumerate(picks):
        k, configs, goodput = pool[p]
        noisy = goodput * np.exp(rng.normal(0.0, NOISE, goodput.size))
        frame = pd.DataFrame({"gpu_type": [c[0] for c in configs], "num_nodes": [c[1] for c in configs],
                              "num_gpus": [c[2] for c in configs], "goodput": noisy})
        name = f"{zoo[k].name}-{j}"
        tables[name] = GoodputTable(name, frame)
    return tables


def scheduler_shaped(rounds: int, milp_limit: float, n_jobs: int = 1024) -> tuple[dict, dict]:
    """``allocate`` as the simulator calls it at 2048 GPUs: Sia's full configuration set per job (true
    goodput tables of the built-in catalog's families at a random progress, Sia's three-type cluster scaled
    32-fold), JobSpecs with ages and restarts, and the last round's Allocation as ``current``; each round a
    tenth of the jobs progress (their tables change) and every job ages by 60 s. Returns the row and details
    (the last round against the exact MILP)."""
    from experiments.simulator.engine import SimConfig, Simulator
    from experiments.simulator.policies import make_policy
    from experiments.simulator.truth import catalog_workload_stats, load_catalog
    from experiments.simulator.workload import synthetic_workload
    from goodput.allocator import JobSpec

    cluster = Cluster.parse("t4:192x4,a100:64x8,rtx2080ti:96x8")
    families = load_catalog(gpu_types=cluster.gpu_types)
    jobs = synthetic_workload(catalog_workload_stats(), families, num_jobs=n_jobs, hours=1.0, seed=1)
    sim = Simulator(jobs, families, SimConfig(cluster=cluster), make_policy("sia-oracle"))
    rng = np.random.default_rng(2)
    ages = {}
    restarts = {}
    tables = {}
    for job in sim.jobs:
        job.progress = float(rng.uniform(0.0, 0.9)) * job.family.work
        tables[job.name] = sim._truth_table(job)
        ages[job.name], restarts[job.name] = float(rng.uniform(600.0, 20000.0)), int(rng.integers(0, 3))

    def specs() -> dict[str, JobSpec]:
        return {name: JobSpec(age=ages[name], restarts=restarts[name], restart_cost=30.0) for name in tables}

    current = allocate(tables, cluster, jobs=specs())
    samples, solvers, gaps = [], {}, []
    for _ in range(rounds):
        for job in rng.choice(sim.jobs, size=max(1, len(sim.jobs) // 10), replace=False):
            job.progress = min(job.progress + float(rng.uniform(0.0, 0.05)) * job.family.work, job.family.work * 0.99)
            tables[job.name] = sim._truth_table(job)
        for name in ages:
            ages[name] += 60.0
        spec = specs()
        start = time.perf_counter()
        result = allocate(tables, cluster, current, jobs=spec)
        samples.append(time.perf_counter() - start)
        solvers[result.info.solver] = solvers.get(result.info.solver, 0) + 1
        gaps.append(result.info.gap)
        previous, current = current, result
    problem = sia_problem(prepare(tables, cluster, previous, spec), -0.5, 1.1)
    exact = solve_milp(problem, time_limit=milp_limit)
    vs_opt = None
    if exact is not None and exact.status == "optimal":
        optimum = problem.objective(exact.total)
        vs_opt = (result.info.objective - optimum) / optimum
    row = {"what": f"scheduler round 2048x{n_jobs}", "jobs": n_jobs, "binaries": result.info.num_variables,
           "solver": "/".join(sorted(solvers)), "median_ms": statistics.median(samples) * 1e3,
           "p95_ms": _pct(samples, 0.95) * 1e3, "fast_gap": max(g for g in gaps if g is not None),
           "milp_s": exact.seconds if exact else None, "vs_opt": vs_opt, "target_ms": 100.0}
    return row, {"rounds": rounds, "samples_s": samples, "solvers": solvers, "certified_gaps": gaps,
                 "rows": int(sum(len(t) for t in tables.values())),
                 "milp_status": exact.status if exact else "no solution"}


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_allocator", __doc__)
    p.add_argument("--sizes", default=None,
                   help="comma-separated GPU counts, or GPUSxJOBS (default: all, and 2048x1024; --quick: 64,256)")
    p.add_argument("--scheduler-rounds", type=int, default=None,
                   help="rounds of the simulator-shaped problem at 2048 GPUs x 1024 jobs (default 10; --quick 0)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per size (default 3, 2 at 8192; --quick 1)")
    p.add_argument("--milp-time-limit", type=float, default=None, help="seconds for the exact MILP (default 60; quick 10)")
    args = p.parse_args(argv)
    def size(text: str) -> tuple[int, int]:
        gpus, _, jobs = text.strip().partition("x")
        try:
            out = int(gpus), int(jobs) if jobs else JOBS_PER_64 * int(gpus) // 64
        except ValueError:
            p.error(f"--sizes: {text!r} is not GPUS or GPUSxJOBS")
        if out[1] < 1:
            p.error(f"--sizes: {text!r} holds no job")
        return out

    check_options(p, args, at_least={"seeds": 1, "scheduler_rounds": 0}, positive=["milp_time_limit"])
    default_sizes = [f"{g}" for g in SCALES] + ["2048x1024"]
    sizes = [size(s) for s in (args.sizes.split(",") if args.sizes else (["64", "256"] if args.quick else default_sizes))]
    unknown = [g for g, _ in sizes if g not in SCALES]
    if unknown:
        p.error(f"GPU counts must be among {list(SCALES)}")
    scheduler_rounds = args.scheduler_rounds if args.scheduler_rounds is not None else (0 if args.quick else 10)
    milp_limit = args.milp_time_limit or (10.0 if args.quick else 60.0)
    repeats = 2 if args.quick else 5

    from experiments.datasets import default_data_dir

    data_dir = default_data_dir()
    rng = np.random.default_rng(0)
    if data_dir is not None and (data_dir / "pollux" / "traces").is_dir() and (data_dir / "gavel").is_dir():
        zoo, provenance = load_zoo(data_dir, max_observations=100 if args.quick else None)
    else:
        zoo, provenance = synthetic_zoo(rng)
    print(f"goodput tables from: {provenance}", flush=True)

    rows = []
    # the simulator's round: 64 GPUs, ~50 active jobs, last round's allocation passed in
    cluster = cluster_for(64)
    pool = kind_tables(zoo, cluster, rng)
    tables = make_tables(pool, zoo, 50, np.random.default_rng(1))
    current = allocate(tables, cluster)
    samples = []
    for _ in range(10 if args.quick else 50):
        start = time.perf_counter()
        result = allocate(tables, cluster, current=current)
        samples.append(time.perf_counter() - start)
        current = result
    details: dict[str, dict] = {}
    rows.append({"what": "sim round 64", "jobs": 50,
                 "solver": result.info.solver, "median_ms": statistics.median(samples) * 1e3,
                 "p95_ms": _pct(samples, 0.95) * 1e3, "target_ms": 20.0})

    for gpus, n_jobs in sizes:
        cluster = cluster_for(gpus)
        label = f"sia {gpus}" if n_jobs == JOBS_PER_64 * gpus // 64 else f"sia {gpus}x{n_jobs}"
        seeds = args.seeds or (1 if args.quick else (2 if gpus >= 8192 else 3))
        pool = kind_tables(zoo, cluster, np.random.default_rng(gpus))
        warm, cold, fast_times, solve_times, milp_times = [], [], [], [], []
        gaps, rel_auto, rel_fast, solvers, binaries, milp_status = [], [], [], [], [], []
        for seed in range(seeds):
            tables = make_tables(pool, zoo, n_jobs, np.random.default_rng(1000 * gpus + seed))
            start = time.perf_counter()
            result = allocate(tables, cluster)
            cold.append(time.perf_counter() - start)
            for _ in range(repeats):
                start = time.perf_counter()
                result = allocate(tables, cluster)
                warm.append(time.perf_counter() - start)
                solve_times.append(result.info.solve_time)
            solvers.append(result.info.solver)
            binaries.append(result.info.num_variables)
            start = time.perf_counter()
            fast = allocate(tables, cluster, solver="lagrangian")
            fast_times.append(time.perf_counter() - start)
            gaps.append(fast.info.gap)
            problem = sia_problem(prepare(tables, cluster), -0.5, 1.1)
            exact = solve_milp(problem, time_limit=milp_limit)
            milp_times.append(exact.seconds if exact else milp_limit)
            milp_status.append(exact.status if exact else "no solution")
            if exact is not None and exact.status == "optimal":
                optimum = problem.objective(exact.total)
                rel_auto.append((result.info.objective - optimum) / optimum)
                rel_fast.append((fast.info.objective - optimum) / optimum)
            print(f"  {gpus} GPUs seed {seed}: auto {warm[-1] * 1e3:.0f} ms ({solvers[-1]}), fast path gap "
                  f"{gaps[-1]:.2e}, MILP {milp_times[-1]:.2f} s ({milp_status[-1]})", flush=True)
        target = 100.0 if gpus == 64 or (gpus == 2048 and n_jobs <= 1024) else (1000.0 if gpus == 2048 else None)
        rows.append({
            "what": label, "jobs": n_jobs, "binaries": int(np.median(binaries)),
            "solver": "/".join(sorted(set(solvers))), "median_ms": statistics.median(warm) * 1e3,
            "p95_ms": _pct(warm, 0.95) * 1e3, "cold_ms": statistics.median(cold) * 1e3,
            "fast_ms": statistics.median(fast_times) * 1e3, "fast_gap": max(gaps),
            "milp_s": statistics.median(milp_times), "vs_opt": max(rel_auto) if rel_auto else None,
            "target_ms": target,
        })
        details[label] = {
            "gpus": gpus, "seeds": seeds, "repeats": repeats, "solver_median_ms": statistics.median(solve_times) * 1e3,
            "milp_status": milp_status, "fast_vs_optimum": rel_fast, "auto_vs_optimum": rel_auto, "fast_gaps": gaps,
            "warm_s": warm, "cold_s": cold, "milp_s": milp_times,
        }
        if gpus == 1024 and not args.quick:
            problem = sia_problem(prepare(tables, cluster), -0.5, 1.1)
            start = time.perf_counter()
            with_presolve = solve_milp(problem, time_limit=milp_limit, presolve=True)
            rows.append({"what": "milp+presolve 1024", "jobs": n_jobs, "binaries": problem.num_options,
                         "milp_s": time.perf_counter() - start})
            details["milp+presolve 1024"] = {"status": with_presolve.status if with_presolve else "no solution"}
    if scheduler_rounds:
        row, detail = scheduler_shaped(scheduler_rounds, milp_limit)
        rows.append(row)
        details[row["what"]] = detail
    for row in rows:
        target = row.get("target_ms")
        if target is not None:
            row["ok"] = row["median_ms"] <= target and (
                row.get("vs_opt") is None or row["vs_opt"] <= 0.005)
    report("bench_allocator", rows, args,
           extra={"tables": provenance, "milp_time_limit_s": milp_limit, "details": details})
    return 0


if __name__ == "__main__":
    sys.exit(main())
