"""The round-based cluster simulator.

Every ``round_s`` seconds (60 by default) the policy under test sees the active
jobs — what a real scheduler would see: each job's goodput table from its own
online :class:`~goodput.model.JobModel` (or, for an oracle policy, from the
ground truth), its current allocation, age and restarts — and returns
allocations. Jobs then progress by their *true* goodput (Pollux's
scale-invariant progress, :mod:`experiments.simulator.truth`), pay a restart
delay whenever their allocation changes, and finish when their work is done.

The closed loop: a new job is profiled on 1 GPU of every type at a few batch
sizes (with measurement noise); while it runs it reports an observation of its
configuration (step time, sync time, gradient statistics, with noise) the first
time it runs a configuration and every ``report_every`` rounds after that. Only
those reports reach its model.

Example::

    from experiments.simulator import Simulator, SimConfig, load_catalog, synthetic_workload
    sim = Simulator(jobs, load_catalog(), SimConfig(cluster=Cluster.parse("t4:6x4,a100:2x8,rtx2080ti:3x8")),
                    policy=make_policy("sia"))
    result = sim.run()
    result.summary["avg_jct_s"]
"""

from __future__ import annotations

import math
import time as _time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from goodput.cluster import Cluster
from goodput.errors import ValidationError
from goodput.model import JobModel
from goodput.observations import Observation
from goodput.optimize import GoodputCandidates, best_goodput, best_goodput_each
from goodput.table import GoodputTable
from goodput.validation import check_float, check_int

from .truth import Family, check_cluster_types
from .workload import WorkloadJob

__all__ = ["Assignment", "JobView", "Policy", "SimConfig", "SimJob", "SimResult", "Simulator"]


@dataclass(frozen=True)
class Assignment:
    """Where a job runs: ``placement`` maps node ids (``"t4-0"``) to GPUs on that node."""

    gpu_type: str
    num_nodes: int
    num_gpus: int
    placement: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, allocation: Any) -> Assignment:
        """From any object with ``gpu_type, num_nodes, num_gpus, placement`` (e.g. the allocator's JobAllocation)."""
        placement = allocation.placement
        items = placement.items() if isinstance(placement, Mapping) else placement
        return cls(allocation.gpu_type, int(allocation.num_nodes), int(allocation.num_gpus),
                   tuple(sorted((str(k), int(v)) for k, v in items)))


@dataclass
class JobView:
    """What a policy sees of one active job."""

    name: str
    application: str
    arrival: float
    age_s: float
    attained_s: float  # seconds the job has held GPUs so far
    restarts: int
    restart_cost_s: float
    requested_gpus: int
    requested_batch: int
    current: Assignment | None
    table: GoodputTable | None  # goodput per configuration (model or oracle); None for non-adaptive policies
    throughput: GoodputTable | None  # samples/s at the requested batch per configuration (for Gavel/FIFO)
    gpu_types: tuple[str, ...]  # types the job can run on
    num_stages: Mapping[str, int] = field(default_factory=dict)  # GPUs per replica by type, where more than 1


class Policy(Protocol):
    """A scheduling policy under test."""

    name: str
    round_s: float  # seconds between reallocations
    oracle: bool  # sees the ground truth instead of the jobs' models
    adaptive_batch: bool  # picks each job's batch size (True) or runs the requested one (False)
    pooled_model: bool  # the jobs' models cannot tell GPU types apart (Pollux-like); optional, default False

    def decide(self, now: float, cluster: Cluster, jobs: list[JobView]) -> Mapping[str, Any]:
        """Allocation per job name (an object with gpu_type, num_nodes, num_gpus, placement) or None."""


@dataclass
class SimConfig:
    """Simulation settings.

    Attributes:
        cluster: the cluster.
        seed: seed of measurement noise.
        step_noise: log-normal sigma of measured step times (0.03 = 3%).
        grad_noise: log-normal sigma of measured gradient noise scales.
        bootstrap_batches: batch sizes profiled per GPU type when a job arrives.
        report_every: rounds between repeated reports of an unchanged configuration.
        max_hours: stop (and report unfinished jobs) after this much simulated time.
        observation_bias: per GPU type of the cluster, a factor on every step time
            the jobs report (1 = honest); to study a misinformed model.
        table_refresh: relative change of a job's noise scale that refreshes an oracle table.
        restart_cost_s: seconds every job loses per reallocation; ``None`` (default):
            each application's own (:attr:`Family.restart_cost_s`, Sia's measured costs).
    """

    cluster: Cluster
    seed: int = 0
    step_noise: float = 0.03
    grad_noise: float = 0.10
    bootstrap_batches: int = 6
    report_every: int = 10
    max_hours: float = 24.0 * 14
    observation_bias: Mapping[str, float] = field(default_factory=dict)
    table_refresh: float = 0.05
    restart_cost_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, Cluster):
            raise ValidationError("cluster", self.cluster, "expected a Cluster")
        for name in ("step_noise", "grad_noise"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1):
                raise ValidationError(name, value, "must be in [0, 1)")
        self.seed = check_int("seed", self.seed, minimum=0)
        self.report_every = check_int("report_every", self.report_every, minimum=1)
        self.bootstrap_batches = check_int("bootstrap_batches", self.bootstrap_batches, minimum=1)
        self.max_hours = check_float("max_hours", self.max_hours, positive=True)
        self.table_refresh = check_float("table_refresh", self.table_refresh, nonnegative=True)
        if self.restart_cost_s is not None:
            self.restart_cost_s = check_float("restart_cost_s", self.restart_cost_s, nonnegative=True)
        for gpu_type, factor in self.observation_bias.items():
            if gpu_type not in self.cluster.gpu_types:
                raise ValidationError(f"observation_bias[{gpu_type!r}]", gpu_type,
                                      f"not a GPU type of the cluster ({', '.join(self.cluster.gpu_types)})")
            check_float(f"observation_bias[{gpu_type!r}]", factor, positive=True)


@dataclass
class SimJob:
    """A job's state during simulation."""

    spec: WorkloadJob
    family: Family
    restart_cost_s: float = 0.0  # seconds per (re)allocation
    model: JobModel | None = None
    progress: float = 0.0
    assignment: Assignment | None = None
    local_bsz: int = 0
    accum_steps: int = 0
    restarts: int = 0
    starts: int = 0
    delay_left: float = 0.0
    start_time: float | None = None
    finish_time: float | None = None
    gpu_seconds: float = 0.0
    held_seconds: float = 0.0
    seen_configs: set[tuple[Any, ...]] = field(default_factory=set)
    rounds_since_report: int = 0
    table: GoodputTable | None = None
    table_stale: bool = True
    table_phi: float = 0.0
    throughput_table: GoodputTable | None = None
    active_jobs_seen: list[int] = field(default_factory=list)
    gpu_types_used: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def running(self) -> bool:
        return self.assignment is not None and self.finish_time is None


@dataclass
class SimResult:
    """Per-job records, per-round records and the summary metrics."""

    jobs: Any  # pandas DataFrame
    rounds: Any  # pandas DataFrame
    summary: dict[str, Any]
    settings: dict[str, Any]


@dataclass
class ClusterKnowledge:
    """What the scheduler learns across jobs, and hands to each new job's model.

    * ``prior``: a :class:`~goodput.hierarchy.ClusterPrior` summarising the
      finished jobs that ran on several GPUs (a rolling window of the
      ``window`` most recent), so a new job's multi-GPU predictions are not
      blind (its bootstrap profile holds 1-GPU runs only);
    * ``gp_hyperparameters``: the latest refitted job's GP hyperparameters, the
      starting point of a new job's first fit (a short warm refit).

    The prior is rebuilt once ``refresh_every`` jobs have been learned since the
    last (each rebuild fits the hierarchy, an EM over every cell of the window,
    paid in the next new job's first refit). The default, 1, rebuilds after every
    finished job: on Philly workload 1 (policy sia) 4 saved 0.7 s of 37 s and
    raised the mean JCT by 1.2%.
    """

    window: int = 24
    summaries: list[Any] = field(default_factory=list)
    gp_hyperparameters: Any = None
    refresh_every: int = 1
    _prior: Any = field(default=None, repr=False)
    _learned_since: int = field(default=0, repr=False)

    def prior(self) -> Any:
        """The prior of the finished jobs learned so far, one object until ``refresh_every`` more are learned
        (its hierarchy is fitted once, at the first new job that uses it)."""
        from goodput.hierarchy import ClusterPrior

        if self.summaries and (self._prior is None or self._learned_since >= self.refresh_every):
            self._prior = ClusterPrior(list(self.summaries))
            self._learned_since = 0
        return self._prior

    def learn(self, model: JobModel) -> None:
        """Fold a finished job's model in (only jobs observed on several GPUs teach anything new)."""
        if model is None or not any(o.num_replicas > 1 for o in model.observations):
            return
        from goodput.hierarchy import ClusterPrior

        self.summaries = [s for s in self.summaries if s.job != model.job]
        self.summaries += ClusterPrior.from_observations({model.job: list(model.observations)},
                                                         {model.job: getattr(model, "model_size", None)},
                                                         gp_prior=False).summaries
        self._learned_since += 1
        jobs = list(dict.fromkeys(s.job for s in self.summaries))
        if len(jobs) > self.window:
            keep = set(jobs[-self.window:])
            self.summaries = [s for s in self.summaries if s.job in keep]


ModelFactory = Callable[..., JobModel]

POOLED = "pooled"  # the one GPU type a heterogeneity-unaware job's model knows


def default_model_factory(spec: WorkloadJob, family: Family, cluster: Cluster, knowledge: ClusterKnowledge,
                          *, pooled: bool = False) -> JobModel:
    """The job's own Bayesian model: M0, batch and per-type memory limits from its family; the
    cluster's knowledge (other jobs' sync costs, GP hyperparameters) as its prior. A ``pooled``
    model (Pollux-like) sees every GPU type as one, with the tightest memory limit of them."""
    types = [g for g in cluster.gpu_types if family.supports(g)]
    if pooled:
        bounds: Any = (family.min_local_bsz, min(family.max_local_bsz[g] for g in types))
        stages: Any = family.stages(types[0])  # one count on every type (Simulator checks it)
    else:
        bounds = {g: (family.min_local_bsz, family.max_local_bsz[g]) for g in types}
        stages = {g: family.stages(g) for g in types} if family.hybrid else 1
    return JobModel(spec.name, family.init_batch_size, max_batch_size=family.max_batch_size, local_bsz_bounds=bounds,
                    cluster_prior=knowledge.prior(), gp_hyperparameters=knowledge.gp_hyperparameters, num_stages=stages)


class Simulator:
    """Simulates one workload under one policy (see the module docstring)."""

    def __init__(
        self,
        workload: Iterable[WorkloadJob],
        families: Mapping[str, Family],
        config: SimConfig,
        policy: Policy,
        model_factory: ModelFactory = default_model_factory,
        progress: Callable[[float, int, int], None] | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.cluster = config.cluster
        self.model_factory = model_factory
        self.progress = progress
        self.rng = np.random.default_rng(config.seed)
        self.jobs: list[SimJob] = []
        check_cluster_types(families, self.cluster)
        names: set[str] = set()
        for spec in workload:
            if spec.name in names:
                raise ValidationError("workload", spec.name, "duplicate job name")
            names.add(spec.name)
            family = families.get(spec.application)
            if family is None:
                raise ValidationError(f"{spec.name}.application", spec.application,
                                      f"not in the ground truth (known: {', '.join(sorted(families))})")
            if not any(family.supports(g) for g in self.cluster.gpu_types):
                raise ValidationError(f"{spec.name}.application", spec.application,
                                      f"has no measurements on any GPU type of the cluster {self.cluster}")
            if family.hybrid:
                _check_hybrid(spec, family, self.cluster, pooled=bool(getattr(policy, "pooled_model", False)))
            cost = config.restart_cost_s if config.restart_cost_s is not None else family.restart_cost_s
            self.jobs.append(SimJob(spec, family, restart_cost_s=cost))
        if not self.jobs:
            raise ValidationError("workload", [], "holds no jobs")
        self.jobs.sort(key=lambda j: (j.spec.time, j.name))
        self.round_records: list[dict[str, Any]] = []
        self.knowledge = ClusterKnowledge()
        self.pooled = bool(getattr(policy, "pooled_model", False))
        self.node_capacity = {node: pool.gpus_per_node for pool in self.cluster for node in pool.node_ids()}
        self.node_type = {node: pool.gpu_type for pool in self.cluster for node in pool.node_ids()}
        self._configs: dict[tuple[Any, ...], Any] = {}  # useful configurations and batch candidates, per family
        self._model_clusters: dict[str, Cluster] = {}
        self._phi_seen: dict[str, tuple[float, float]] = {}  # job -> (progress, noise scale) last computed
        if not getattr(policy, "adaptive_batch", True):
            for job in self.jobs:
                self._check_rigid(job)

    def _check_rigid(self, job: SimJob) -> None:
        """A rigid policy runs a job at its requested batch on the allowed configuration with the fewest GPUs
        not below its request (:func:`rigid_gpus`; :func:`goodput.allocator.policies.requested_rows`): the
        cluster must have one on which that batch runs, else the job would wait to the end of the simulation.
        Its table at that batch is kept (the one the policy reads)."""
        job.throughput_table = table = self._truth_table(job, fixed_batch=job.spec.batch_size)
        request = rigid_gpus(job.spec.num_replicas, self.cluster)
        frame = table.frame
        if not ((frame["goodput"] > 0) & (frame["num_gpus"] >= request)).any():
            family = job.family
            pipelines = f", pipelines of {family.num_stages} GPUs" if family.hybrid else ""
            raise ValidationError(f"{job.name}.batch_size", job.spec.batch_size,
                                  f"runs on no configuration of at least the {request} GPU{'s' if request > 1 else ''} a "
                                  f"rigid policy gives it on the cluster {self.cluster} ({job.spec.application}: "
                                  f"micro-batches of at least {family.min_local_bsz} samples{pipelines}); ask for a larger "
                                  "batch or fewer GPUs, or use an adaptive policy (sia)")

    # ------------------------------------------------------------------ observations
    def _noise(self, sigma: float) -> float:
        return float(math.exp(self.rng.normal(0.0, sigma))) if sigma > 0 else 1.0

    def _measure(self, job: SimJob, gpu_type: str, nodes: int, gpus: int, local_bsz: int, accum: int,
                 *, noise_at_reference: bool = False) -> Observation:
        """A noisy report of a configuration: step and sync times, and the gradient noise the job measures —
        of the batch it trains at, or (``noise_at_reference``, a profile) of its reference batch M0."""
        family = job.family
        t_iter, sync = family.iter_time(gpu_type, nodes, gpus, local_bsz, accum)
        factor = self._noise(self.config.step_noise) * self.config.observation_bias.get(gpu_type, 1.0)
        step = t_iter * factor
        batch = None if noise_at_reference else family.replicas(gpu_type, gpus) * local_bsz * (accum + 1)
        phi = family.noise_scale(job.progress, batch) * self._noise(self.config.grad_noise)
        m0 = family.init_batch_size
        return Observation(
            job=job.name, gpu_type=POOLED if self.pooled else gpu_type, num_nodes=nodes,
            num_replicas=family.replicas(gpu_type, gpus), local_bsz=local_bsz,
            accum_steps=accum, step_time=step, sync_time=min(sync * factor, step),
            grad_sqr=1.0, grad_var=phi / m0, source="simulated", num_stages=family.stages(gpu_type),
        )

    def _bootstrap(self, job: SimJob) -> None:
        """Sia-style profile on arrival: 1 GPU of every type, a few batch sizes (a hybrid job: one pipeline,
        with and without accumulation, whose micro-batches fill the pipeline)."""
        job.model = self.model_factory(job.spec, job.family, self.cluster, self.knowledge, pooled=self.pooled)
        batch: list[Observation] = []
        for pool in self.cluster:
            gpu_type = pool.gpu_type
            if not job.family.supports(gpu_type):
                continue
            nodes, gpus, accums = 1, 1, (0,)
            if job.family.stages(gpu_type) > 1:
                configs = job.family.configurations(pool)
                if not configs:  # not one pipeline fits this type's nodes
                    continue
                _, nodes, gpus = configs[0]
                accums = (0, job.family.stages(gpu_type) - 1)
            low, high = job.family.min_local_bsz, job.family.max_local_bsz[gpu_type]
            sizes = sorted({int(round(x)) for x in np.geomspace(low, high, self.config.bootstrap_batches)})
            for bsz in sizes:
                for accum in accums:
                    batch.append(self._measure(job, gpu_type, nodes, gpus, bsz, accum, noise_at_reference=True))
        job.model.observe(batch)
        job.table_stale = True

    def _report(self, job: SimJob) -> None:
        a = job.assignment
        key = (a.gpu_type, a.num_nodes, a.num_gpus, job.local_bsz, job.accum_steps)
        job.rounds_since_report += 1
        if key in job.seen_configs and job.rounds_since_report < self.config.report_every:
            return
        job.seen_configs.add(key)
        job.rounds_since_report = 0
        if job.model is not None:
            job.model.observe(self._measure(job, a.gpu_type, a.num_nodes, a.num_gpus, job.local_bsz, job.accum_steps))
            job.table_stale = True

    # ------------------------------------------------------------------ tables
    def _useful_configs(self, pool: Any, family: Family, fixed_batch: int | None) -> tuple[np.ndarray, np.ndarray]:
        """The pool's configurations (nodes, GPUs) on which some batch fits the family's limits (whole pipelines
        of a hybrid job: :meth:`Family.configurations`).

        More than ``max_batch_size // min_local_bsz`` replicas (``fixed_batch // min_local_bsz`` for a
        fixed batch) leave no batch within the limits, so their goodput is 0 and no allocator offers
        them: leaving those rows out changes no allocation, and on a large pool it saves most of
        the table (a 192-node pool has 194 configurations; cifar10 can use 35 of them).
        """
        key = (pool.gpu_type, family.name, fixed_batch)
        cached = self._configs.get(key)
        if cached is None:
            limits = family.limits(pool.gpu_type, fixed_batch)
            useful = max(limits.max_batch_size // limits.min_local_bsz, 1)
            stages = family.stages(pool.gpu_type)
            configs = [c for c in family.configurations(pool) if c[2] // stages <= useful]
            cached = (np.array([c[1] for c in configs], dtype=float), np.array([c[2] for c in configs], dtype=float))
            self._configs[key] = cached
        return cached

    def _candidates(self, pool: Any, family: Family, fixed_batch: int | None) -> GoodputCandidates:
        """The family's batch candidates and true step times on the pool's useful configurations: all of a truth
        table but the efficiency, which moves with the job's progress (kept for the whole simulation)."""
        key = ("candidates", pool.gpu_type, family.name, fixed_batch)
        cached = self._configs.get(key)
        if cached is None:
            nodes, gpus = self._useful_configs(pool, family, fixed_batch)
            cached = family.candidates(pool.gpu_type, nodes, gpus, fixed_batch)
            self._configs[key] = cached
        return cached

    def _config_candidates(self, family: Family, gpu_type: str, nodes: int, gpus: int) -> GoodputCandidates | None:
        """The candidates of one configuration (a column of :meth:`_candidates`); ``None`` if not a useful one."""
        key = ("column", gpu_type, family.name, nodes, gpus)
        if key not in self._configs:
            pool = self.cluster.pool(gpu_type)
            all_nodes, all_gpus = self._useful_configs(pool, family, None)
            hit = np.flatnonzero((all_nodes == nodes) & (all_gpus == gpus))
            self._configs[key] = self._candidates(pool, family, None).column(int(hit[0])) if hit.size else None
        return self._configs[key]

    def _truth_table(self, job: SimJob, *, fixed_batch: int | None = None) -> GoodputTable:
        """A table from the ground truth: true goodput at the job's current progress (an oracle's view),
        or, with ``fixed_batch``, true samples/s at that batch (what Gavel profiles)."""
        progress = 0.0 if fixed_batch else job.progress
        parts = []
        for pool in self.cluster:
            if not job.family.supports(pool.gpu_type):
                continue
            nodes, gpus = self._useful_configs(pool, job.family, fixed_batch)
            if not nodes.size:  # not one pipeline fits this type's nodes
                continue
            best = job.family.best_config(pool.gpu_type, nodes, gpus, progress, fixed_batch=fixed_batch,
                                          candidates=self._candidates(pool, job.family, fixed_batch))
            parts.append((pool.gpu_type, nodes, gpus, best.throughput if fixed_batch else best.goodput, best))
        if not parts:
            return GoodputTable(job.name, [])
        return GoodputTable.from_columns(job.name, {
            "gpu_type": [t for t, nodes, *_ in parts for _ in range(nodes.size)],
            "num_nodes": np.concatenate([p[1] for p in parts]).astype(int),
            "num_gpus": np.concatenate([p[2] for p in parts]).astype(int),
            "goodput": np.concatenate([p[3] for p in parts]).astype(float),
            "batch_size": np.concatenate([p[4].batch_size for p in parts]).astype(int),
            "local_bsz": np.concatenate([p[4].local_bsz for p in parts]).astype(int),
            "accum_steps": np.concatenate([p[4].accum_steps for p in parts]).astype(int),
            "std": 0.0,
        })

    def _model_cluster(self, job: SimJob) -> Cluster:
        """The cluster cut to the nodes a job can use (see :meth:`_useful_configs`): its model's table
        over it has the same rows, less the configurations on which nothing fits."""
        from goodput.cluster import NodePool

        key = job.family.name
        cut = self._model_clusters.get(key)
        if cut is None:
            pools = []
            for pool in self.cluster:
                limits = job.family.limits(pool.gpu_type) if job.family.supports(pool.gpu_type) else None
                useful = (max(limits.max_batch_size // limits.min_local_bsz, 1) * job.family.stages(pool.gpu_type)
                          if limits else pool.gpus)  # GPUs: whole pipelines of a hybrid job
                pools.append(NodePool(pool.gpu_type, min(pool.nodes, max(1, useful // pool.gpus_per_node)),
                                      pool.gpus_per_node))
            cut = Cluster(tuple(pools))
            self._model_clusters[key] = cut
        return cut

    def _pooled_table(self, job: SimJob) -> GoodputTable:
        """A pooled model's table: the same predictions on every GPU type's configurations (it cannot tell them apart)."""
        import pandas as pd

        from goodput.cluster import NodePool

        frames = []
        for pool in self._model_cluster(job):
            if not job.family.supports(pool.gpu_type):
                continue
            shape = Cluster((NodePool(POOLED, pool.nodes, pool.gpus_per_node),))
            frame = job.model.table(shape).frame.drop(columns=["normalized_goodput"])
            frame["gpu_type"] = pool.gpu_type
            frames.append(frame)
        return GoodputTable(job.name, pd.concat(frames, ignore_index=True))

    def _table(self, job: SimJob) -> GoodputTable:
        if self.policy.oracle:
            phi = job.family.noise_scale(job.progress)
            if job.table is None or abs(phi / job.table_phi - 1.0) > self.config.table_refresh:
                job.table, job.table_phi = self._truth_table(job), phi
            return job.table
        if job.table is None or job.table_stale:
            job.table = self._pooled_table(job) if self.pooled else job.model.table(self._model_cluster(job))
            job.table_stale = False
            hyper = getattr(job.model, "gp_hyperparameters", None)
            if hyper is not None:
                self.knowledge.gp_hyperparameters = hyper
        return job.table

    # ------------------------------------------------------------------ allocation
    def _refresh_truth_tables(self, active: list[SimJob]) -> None:
        """An oracle's tables: each job's refreshed once its noise scale has moved by ``table_refresh``
        (:meth:`_table`), all of a round's at once, one evaluation per job family and pool (the same tables
        as :meth:`_truth_table` job by job)."""
        groups: dict[int, list[tuple[SimJob, float]]] = {}
        for job in active:
            seen = self._phi_seen.get(job.name)
            if seen is not None and seen[0] == job.progress:
                phi = seen[1]  # a job that did not progress (queued) has the same φ
            else:
                phi = job.family.noise_scale(job.progress)
                self._phi_seen[job.name] = (job.progress, phi)
            if job.table is None or abs(phi / job.table_phi - 1.0) > self.config.table_refresh:
                groups.setdefault(id(job.family), []).append((job, phi))
        for members in groups.values():
            family = members[0][0].family
            pools = [pool for pool in self.cluster
                     if family.supports(pool.gpu_type) and self._useful_configs(pool, family, None)[0].size]
            if not pools:
                for job, phi in members:
                    job.table, job.table_phi = GoodputTable(job.name, []), phi
                continue
            candidates = [self._candidates(pool, family, None) for pool in pools]
            batches = [np.maximum(c.batch, c.init_batch_size) for c in candidates]
            effs = family.efficiencies([job.progress for job, _ in members], batches)  # per pool: (jobs, C, n)
            best = [best_goodput_each(c, e) for c, e in zip(candidates, effs)]
            columns = {k: np.concatenate([b[k] for b in best], axis=1) for k in best[0]}
            # every job's values checked at once (finite, >= 0); the tables then take them as they are
            checked = bool(np.all(np.isfinite(columns["goodput"])) and all(np.all(v >= 0) for v in columns.values()))
            zeros = np.zeros(columns["goodput"].shape[1])
            first = None
            for k, (job, phi) in enumerate(members):
                values = {name: columns[name][k] for name in ("goodput", "batch_size", "local_bsz", "accum_steps")}
                if first is None:  # the family's configurations, checked once
                    configs = [self._useful_configs(pool, family, None) for pool in pools]
                    first = job.table = GoodputTable.from_columns(job.name, {
                        "gpu_type": [pool.gpu_type for pool, (n, _) in zip(pools, configs) for _ in range(n.size)],
                        "num_nodes": np.concatenate([n for n, _ in configs]).astype(int),
                        "num_gpus": np.concatenate([g for _, g in configs]).astype(int), **values, "std": 0.0})
                else:
                    job.table = GoodputTable.from_columns(job.name, {**values, "std": zeros}, like=first,
                                                          checked=checked)
                job.table_phi = phi

    def _views(self, now: float, active: list[SimJob]) -> list[JobView]:
        views = []
        batched = self.policy.oracle and self.policy.adaptive_batch
        if batched:
            self._refresh_truth_tables(active)
        for job in active:
            adaptive = self.policy.adaptive_batch
            if not adaptive and job.throughput_table is None:
                job.throughput_table = self._truth_table(job, fixed_batch=job.spec.batch_size)
            views.append(JobView(
                name=job.name, application=job.spec.application, arrival=job.spec.time, age_s=now - job.spec.time,
                attained_s=min(job.held_seconds, now - job.spec.time),
                restarts=job.restarts, restart_cost_s=job.restart_cost_s,
                requested_gpus=job.spec.num_replicas, requested_batch=job.spec.batch_size,
                current=job.assignment, table=(job.table if batched else self._table(job)) if adaptive else None,
                throughput=job.throughput_table,
                gpu_types=tuple(g for g in self.cluster.gpu_types if job.family.supports(g)),
                num_stages={g: job.family.stages(g) for g in self.cluster.gpu_types
                            if job.family.supports(g) and job.family.stages(g) > 1},
            ))
        return views

    def _check_capacity(self, assignments: Mapping[str, Assignment]) -> None:
        used: dict[str, int] = {}
        for name, a in assignments.items():
            if sum(g for _, g in a.placement) != a.num_gpus or len(a.placement) != a.num_nodes:
                raise ValidationError(f"{name}.placement", a.placement, f"does not hold {a.num_gpus} GPUs on {a.num_nodes} nodes")
            for node, gpus in a.placement:
                if self.node_type.get(node) != a.gpu_type:
                    raise ValidationError(f"{name}.placement", node, f"is not a {a.gpu_type} node")
                used[node] = used.get(node, 0) + gpus
        for node, gpus in used.items():
            if gpus > self.node_capacity[node]:
                raise ValidationError("placement", node, f"{gpus} GPUs allocated on a node of {self.node_capacity[node]}")

    def _batch_config(self, job: SimJob) -> tuple[int, int]:
        a = job.assignment
        if not self.policy.adaptive_batch:
            row = job.throughput_table.lookup(a.gpu_type, a.num_nodes, a.num_gpus) if job.throughput_table else None
            if row is None or row["goodput"] <= 0:
                best = job.family.best_config(a.gpu_type, a.num_nodes, a.num_gpus, 0.0, fixed_batch=job.spec.batch_size)
                return max(int(best.local_bsz[0]), 1), int(best.accum_steps[0])
            return int(row["local_bsz"]), int(row["accum_steps"])
        if self.policy.oracle:
            best = job.family.best_config(a.gpu_type, a.num_nodes, a.num_gpus, job.progress,
                                          candidates=self._config_candidates(job.family, a.gpu_type, a.num_nodes, a.num_gpus))
            return max(int(best.local_bsz[0]), 1), int(best.accum_steps[0])
        choice = job.model.goodput(POOLED if self.pooled else a.gpu_type, a.num_nodes, num_gpus=a.num_gpus)
        if choice.local_bsz < 1:  # the model thinks nothing fits: run the smallest legal batch
            replicas = job.family.replicas(a.gpu_type, a.num_gpus)
            wanted = max(job.family.min_local_bsz, math.ceil(job.family.init_batch_size / replicas))
            return min(wanted, job.family.max_local_bsz[a.gpu_type]), 0  # never past what fits in memory
        return choice.local_bsz, choice.accum_steps

    def _oracle_batches(self, jobs: list[SimJob]) -> None:
        """An oracle's batch configurations (:meth:`_batch_config`) for many jobs: one evaluation per job family
        and GPU type over the jobs' configurations, each at its job's progress (the same choices)."""
        groups: dict[tuple[int, str], list[tuple[SimJob, GoodputCandidates]]] = {}
        for job in jobs:
            a = job.assignment
            column = self._config_candidates(job.family, a.gpu_type, a.num_nodes, a.num_gpus)
            if column is None:
                job.local_bsz, job.accum_steps = self._batch_config(job)
                continue
            groups.setdefault((id(job.family), a.gpu_type), []).append((job, column))
        for members in groups.values():
            family = members[0][0].family
            columns = [c for _, c in members]
            stacked = GoodputCandidates(*(np.concatenate([getattr(c, f) for c in columns], axis=1)
                                          for f in ("batch", "micro", "accum", "valid", "times", "throughput")),
                                        columns[0].init_batch_size)
            eff = family.column_efficiencies([job.progress for job, _ in members],
                                             np.maximum(stacked.batch, stacked.init_batch_size))
            best = best_goodput(stacked, lambda _: eff)  # each job on its own configuration, at its own progress
            for k, (job, _) in enumerate(members):
                job.local_bsz, job.accum_steps = max(int(best.local_bsz[k]), 1), int(best.accum_steps[k])

    def _apply(self, now: float, decisions: Mapping[str, Any], active: list[SimJob]) -> None:
        assignments = {}
        for name, alloc in decisions.items():
            if alloc is not None:
                assignments[name] = alloc if isinstance(alloc, Assignment) else Assignment.of(alloc)
        unknown = sorted(set(assignments) - {job.name for job in active})
        if unknown:
            raise ValidationError("decisions", unknown[0], "the policy allocated GPUs to a job that is not active")
        self._check_capacity(assignments)
        changed: list[SimJob] = []  # jobs on a new assignment: their batch configuration, below
        for job in active:
            new = assignments.get(job.name)
            if new == job.assignment:
                continue
            if new is not None and not job.family.supports(new.gpu_type):
                raise ValidationError(f"{job.name}.gpu_type", new.gpu_type, "the job cannot run on this type")
            if new is not None and job.family.replicas(new.gpu_type, new.num_gpus) < 1:
                raise ValidationError(f"{job.name}.num_gpus", new.num_gpus, f"not whole pipelines of "
                                      f"{job.family.stages(new.gpu_type)} GPUs on {new.gpu_type}")
            if new is not None:
                if job.starts > 0:
                    job.restarts += 1
                job.starts += 1
                job.delay_left = job.restart_cost_s
                if job.start_time is None:
                    job.start_time = now
                job.gpu_types_used.add(new.gpu_type)
            job.assignment = new
            if new is not None:
                changed.append(job)
        if self.policy.oracle and self.policy.adaptive_batch:
            self._oracle_batches(changed)
        else:
            for job in changed:
                job.local_bsz, job.accum_steps = self._batch_config(job)

    # ------------------------------------------------------------------ time
    def _advance(self, job: SimJob, now: float, seconds: float) -> None:
        a = job.assignment
        job.held_seconds += seconds
        delay = min(job.delay_left, seconds)
        job.delay_left -= delay
        usable = seconds - delay
        if usable <= 0:
            job.gpu_seconds += a.num_gpus * seconds
            return
        rate = job.family.rate(a.gpu_type, a.num_nodes, a.num_gpus, job.local_bsz, job.accum_steps, job.progress)
        remaining = job.family.work - job.progress
        if rate * usable >= remaining:
            used = remaining / rate
            job.progress = job.family.work
            job.finish_time = now + delay + used
            job.gpu_seconds += a.num_gpus * (delay + used)
        else:
            job.progress += rate * usable
            job.gpu_seconds += a.num_gpus * seconds

    def run(self) -> SimResult:
        """Simulate until every job finishes (or ``max_hours``); single-threaded by design.

        BLAS and torch are limited to one thread while it runs: the numeric
        work is many tiny problems, for which multithreaded BLAS only spins
        (and slows down 25-fold when other processes share the cores).
        """
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=1), _torch_threads(1):
            return self._run()

    def _run(self) -> SimResult:
        import pandas as pd

        from .metrics import summarize

        start_wall = _time.perf_counter()
        round_s = float(self.policy.round_s)
        now = math.floor(self.jobs[0].spec.time / round_s) * round_s
        pending = list(self.jobs)  # by arrival
        active: list[SimJob] = []
        finished = 0
        limit = now + self.config.max_hours * 3600.0
        total_gpus = self.cluster.total_gpus
        while (pending or active) and now < limit:
            while pending and pending[0].spec.time <= now:
                job = pending.pop(0)
                if self.policy.adaptive_batch and not self.policy.oracle:
                    self._bootstrap(job)
                active.append(job)
            if not active:
                now = math.ceil(pending[0].spec.time / round_s) * round_s
                continue
            for job in active:
                job.active_jobs_seen.append(len(active))
            decisions = self.policy.decide(now, self.cluster, self._views(now, active))
            self._apply(now, decisions, active)
            used: dict[str, int] = {}
            retune: list[SimJob] = []
            for job in active:
                if job.assignment is not None:
                    used[job.assignment.gpu_type] = used.get(job.assignment.gpu_type, 0) + job.assignment.num_gpus
                    self._advance(job, now, round_s)
                    if job.finish_time is None and job.delay_left <= 0 and self.policy.adaptive_batch:
                        if not self.policy.oracle:
                            self._report(job)
                        if self.policy.oracle:
                            retune.append(job)  # each depends on its own state only: all at once, below
                        elif job.rounds_since_report == 0:
                            job.local_bsz, job.accum_steps = self._batch_config(job)
            self._oracle_batches(retune)
            running = sum(1 for j in active if j.assignment is not None)
            self.round_records.append({
                "time_s": now, "active": len(active), "running": running, "queued": len(active) - running,
                "gpus_used": sum(used.values()), "utilization": sum(used.values()) / total_gpus,
                **{f"gpus_{g}": used.get(g, 0) for g in self.cluster.gpu_types},
            })
            done = [j for j in active if j.finish_time is not None]
            for job in done:
                job.assignment = None
                if self.policy.adaptive_batch and not self.policy.oracle:
                    self.knowledge.learn(job.model)
            active = [j for j in active if j.finish_time is None]
            finished += len(done)
            now += round_s
            if self.progress is not None:
                self.progress(now, finished, len(self.jobs))
        jobs = pd.DataFrame([_job_record(j) for j in self.jobs])
        rounds = pd.DataFrame(self.round_records)
        settings = {"policy": self.policy.name, "round_s": round_s, "cluster": str(self.cluster),
                    "seed": self.config.seed, "step_noise": self.config.step_noise,
                    "grad_noise": self.config.grad_noise, "report_every": self.config.report_every,
                    "max_hours": self.config.max_hours, "bootstrap_batches": self.config.bootstrap_batches,
                    "table_refresh": self.config.table_refresh,
                    "restart_cost_s": "per application" if self.config.restart_cost_s is None else self.config.restart_cost_s,
                    "observation_bias": {g: float(f) for g, f in sorted(self.config.observation_bias.items())},
                    "jobs": len(self.jobs), **_policy_settings(self.policy)}
        summary = summarize(jobs, rounds, self.jobs, self.cluster, round_s)
        summary["wall_seconds"] = _time.perf_counter() - start_wall
        return SimResult(jobs, rounds, summary, settings)


def rigid_gpus(requested: int, cluster: Cluster) -> int:
    """The GPUs a rigid policy (Gavel, FIFO) gives a job that asked for ``requested``: the request, capped at the
    largest GPU type's count (it runs on one type; without the cap a larger request would wait forever)."""
    return min(requested, max(cluster.capacity(t) for t in cluster.gpu_types))


def _check_hybrid(spec: WorkloadJob, family: Family, cluster: Cluster, *, pooled: bool) -> None:
    """A hybrid job needs one pipeline to fit some GPU type of the cluster; a pooled (heterogeneity-unaware)
    model cannot tell types apart, so its pipeline must have one stage count on every type it may use."""
    types = [pool.gpu_type for pool in cluster if family.supports(pool.gpu_type) and family.configurations(pool)]
    if not types:
        raise ValidationError(f"{spec.name}.application", spec.application,
                              f"one pipeline ({family.num_stages} GPUs) fits no node pool of the cluster {cluster}")
    counts = {family.stages(g) for g in cluster.gpu_types if family.supports(g)}
    if pooled and len(counts) > 1:
        raise ValidationError(f"{spec.name}.application", spec.application,
                              f"its pipelines have {family.num_stages} stages by GPU type; a heterogeneity-unaware "
                              "policy pools the types, so it cannot run them")


def _policy_settings(policy: Policy) -> dict[str, Any]:
    """The policy's allocator options worth recording with a run (a non-default goodput quantile)."""
    quantile = getattr(policy, "options", {}).get("goodput_quantile")
    return {} if quantile is None else {"goodput_quantile": quantile}


class _torch_threads:
    """Temporarily set torch's intra-op threads (only if torch is already imported)."""

    def __init__(self, count: int) -> None:
        self.count, self.saved = count, None

    def __enter__(self) -> None:
        import sys

        torch = sys.modules.get("torch")
        if torch is not None:
            self.saved = torch.get_num_threads()
            torch.set_num_threads(self.count)

    def __exit__(self, *exc: object) -> None:
        import sys

        torch = sys.modules.get("torch")
        if torch is not None and self.saved is not None:
            torch.set_num_threads(self.saved)


def _job_record(job: SimJob) -> dict[str, Any]:
    jct = None if job.finish_time is None else job.finish_time - job.spec.time
    return {
        "name": job.name, "application": job.spec.application, "category": job.spec.category,
        "arrival_s": job.spec.time, "start_s": job.start_time, "finish_s": job.finish_time, "jct_s": jct,
        "gpu_hours": job.gpu_seconds / 3600.0, "restarts": job.restarts,
        "requested_gpus": job.spec.num_replicas, "requested_batch": job.spec.batch_size,
        "progress_fraction": job.progress / job.family.work,
        "gpu_types_used": ",".join(sorted(job.gpu_types_used)),
        "mean_contention": float(np.mean(job.active_jobs_seen)) if job.active_jobs_seen else 0.0,
    }
