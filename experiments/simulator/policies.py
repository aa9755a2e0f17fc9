"""The policies a simulation compares, all through :func:`goodput.allocate`.

========== ================================================================ ======== ===========
name       what it does                                                     round    batch size
========== ================================================================ ======== ===========
sia        Sia's goodput ILP on each job's online :class:`JobModel`          60 s     model's best
sia-oracle the same ILP on the ground truth (separates modelling error)      60 s     true best
unaware    GPU types pooled, Pollux-like: one model per job that cannot      60 s     model's best
           tell GPU types apart, and the pooled goodput ILP
gavel      Gavel's heterogeneity-aware max-sum-throughput, requested GPUs   360 s    requested
fifo       first in, first out with the requested GPUs                       60 s     requested
========== ================================================================ ======== ===========

Gavel and FIFO run each job at the batch size its owner asked for, on the GPU
count it asked for capped at the largest GPU type's (they place a job on one
type; without the cap a larger request would wait forever); Gavel is
given each job's true throughput at that batch on every type (Gavel assumes
profiled throughputs), which is generous to it.

Every policy passes the allocator each job's restart cost (its application's,
:attr:`JobView.restart_cost_s`: Sia's restart factor and the allocator's
penalty for moving it) and, for a hybrid-parallel job, its GPUs per replica on
each type as ``JobSpec.granularity``: it is given whole pipelines only. The
``unaware`` policy's pooled model cannot tell GPU types apart, so it runs a
hybrid job only if its pipelines have one stage count on every type (the
simulator refuses the workload otherwise, before any round).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from goodput.allocator import Allocation, JobAllocation, JobSpec, allocate
from goodput.cluster import Cluster
from goodput.errors import ValidationError
from goodput.validation import check_float, check_quantile

from .engine import JobView, rigid_gpus

__all__ = ["AllocatorPolicy", "make_policy", "POLICY_NAMES"]


@dataclass
class AllocatorPolicy:
    """A simulation policy that calls :func:`goodput.allocate` each round."""

    name: str
    allocator_policy: str
    oracle: bool
    adaptive_batch: bool
    round_s: float
    pooled_model: bool = False  # the jobs' models cannot tell GPU types apart (Pollux-like)
    p: float = -0.5
    options: dict[str, Any] = field(default_factory=dict)
    last_info: Any = None
    _seen: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)  # per job: current allocation, spec

    def decide(self, now: float, cluster: Cluster, jobs: list[JobView]) -> Mapping[str, Any]:
        tables = {j.name: (j.table if self.adaptive_batch else j.throughput) for j in jobs}
        current = {j.name: self._allocation(j) for j in jobs if j.current is not None}
        # a rigid policy's request is capped at the largest GPU type's count (rigid_gpus: Pollux's workloads
        # ask for up to 32 GPUs of a 64-T4 cluster; a larger request would wait forever)
        specs = {j.name: self._spec(j, cluster) for j in jobs}
        self._seen = {j.name: self._seen[j.name] for j in jobs if j.name in self._seen}  # forget finished jobs
        if self.last_info is not None and self.last_info.prices is not None:
            # the last round's GPU prices start this round's fast path (only its time depends on them)
            current = Allocation(current, {}, self.last_info)
        allocation = allocate(tables, cluster, current, p=self.p, policy=self.allocator_policy, jobs=specs, **self.options)
        self.last_info = allocation.info
        return dict(allocation)

    def _allocation(self, job: JobView) -> JobAllocation:
        """The job's current assignment as the allocator's JobAllocation (kept while the assignment is the same)."""
        seen = self._seen.get(job.name, {})
        kept = seen.get("current")
        if kept is None or kept[0] is not job.current:
            a = job.current
            kept = (a, JobAllocation(a.gpu_type, a.num_nodes, a.num_gpus, dict(a.placement)))
            self._seen[job.name] = {**seen, "current": kept}
        return kept[1]

    def _spec(self, job: JobView, cluster: Cluster) -> JobSpec:
        """The job's JobSpec this round: its fixed fields checked once (the first round), then a copy with this
        round's age, restarts and attained seconds (valid by construction: age >= attained >= 0)."""
        seen = self._seen.get(job.name, {})
        template = seen.get("spec")
        if template is None:
            template = JobSpec(age=job.age_s, restarts=job.restarts, restart_cost=job.restart_cost_s,
                               attained=job.attained_s,
                               requested_gpus=None if job.requested_gpus is None else rigid_gpus(job.requested_gpus, cluster),
                               arrival=job.arrival, gpu_types=job.gpu_types,
                               granularity=dict(getattr(job, "num_stages", None) or {}) or 1)
            self._seen[job.name] = {**seen, "spec": template}
            return template
        spec = copy.copy(template)
        for name, value in (("age", float(job.age_s)), ("restarts", int(job.restarts)),
                            ("attained", float(job.attained_s))):
            object.__setattr__(spec, name, value)
        return spec


POLICY_NAMES = ("sia", "sia-oracle", "unaware", "gavel", "fifo")


def make_policy(name: str, round_s: float | None = None, **options: Any) -> AllocatorPolicy:
    """A fresh policy object by name (see the module table); ``round_s`` overrides its round length.

    ``options`` go to :func:`goodput.allocate` each round. A ``goodput_quantile``
    other than 0.5 reads every table at that quantile (cautious below 0.5,
    optimistic above; it moves only rows with a ``std``, i.e. the online
    models' tables) and names the policy ``<name>-q<quantile>``, e.g.
    ``sia-q0.25``, so that runs at several quantiles stay apart.
    """
    presets = {
        "sia": ("sia", False, True, 60.0),
        "sia-oracle": ("sia", True, True, 60.0),
        "unaware": ("unaware", False, True, 60.0),
        "gavel": ("gavel-throughput", True, False, 360.0),
        "fifo": ("fifo", True, False, 60.0),
    }
    if name not in presets:
        raise ValidationError("policy", name, f"unknown policy (known: {', '.join(POLICY_NAMES)})")
    allocator_policy, oracle, adaptive, default_round = presets[name]
    if round_s is not None:
        round_s = check_float("round_s", round_s, positive=True)
    label = name
    if "goodput_quantile" in options:
        quantile = options["goodput_quantile"] = check_quantile("goodput_quantile", options["goodput_quantile"])
        label = name if quantile == 0.5 else f"{name}-q{quantile:g}"
    return AllocatorPolicy(label, allocator_policy, oracle, adaptive, float(round_s or default_round),
                           pooled_model=name == "unaware", options=options)
