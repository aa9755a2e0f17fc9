"""``allocate(tables, cluster, current=None, p=-0.5, **policy_options) -> Allocation``."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ..cluster import Cluster
from ..errors import ValidationError
from ..table import GoodputTable
from ..validation import check_quantile
from .policies import allocate_fifo, allocate_gavel, allocate_unaware
from .problem import prepare
from .result import Allocation
from .sia import allocate_sia, check_power

__all__ = ["allocate", "POLICIES"]

POLICIES = ("sia", "gavel", "gavel-throughput", "unaware", "fifo")

_OPTIONS = {
    "sia": {"lam", "solver", "time_limit", "mip_rel_gap", "presolve", "exact_limit", "placement_retries"},
    "unaware": {"lam", "solver", "time_limit", "mip_rel_gap", "presolve", "exact_limit"},
    "gavel": set(),
    "gavel-throughput": set(),
    "fifo": {"backfill"},
}


def allocate(
    tables: Mapping[str, GoodputTable],
    cluster: Cluster,
    current: Mapping[str, Any] | None = None,
    p: float = -0.5,
    **policy_options: Any,
) -> Allocation:
    """Decide every job's GPUs for one scheduling round.

    Args:
        tables: ``{job: GoodputTable}`` (e.g. ``JobModel.table(cluster)`` per job).
        cluster: the cluster (:class:`goodput.Cluster`).
        current: last round's allocations, ``{job: JobAllocation | None}`` or
            the previous :class:`Allocation`; jobs whose configuration stays
            keep their GPUs, and Sia's restart factor penalises the others.
            A previous Allocation also hands its fast path's GPU prices on
            (:attr:`SolverInfo.prices`): the next solve starts from them.
            Entries for jobs without a table (finished) are ignored.
        p: Sia's fairness power (non-zero; < 0 minimises, as Sia does). Used
            by ``"sia"`` and ``"unaware"``.
        policy_options:
            ``policy``: ``"sia"`` (default; :mod:`.sia`), ``"gavel"`` (Gavel's
            heterogeneity-aware max-min fairness), ``"gavel-throughput"``
            (Gavel's max-sum-throughput), ``"unaware"`` (GPU types pooled,
            Pollux-like) or ``"fifo"`` (:mod:`.policies`);
            ``jobs``: ``{job: JobSpec | dict}`` per-job facts and options
            (:class:`goodput.allocator.JobSpec`; default: elastic,
            preemptible, age 0);
            ``lam``: λ, the penalty per unallocated job (1.1);
            ``solver``: ``"auto"``, ``"milp"`` or ``"lagrangian"``;
            ``time_limit`` (s, the solver's over a call, its placement retries
            included), ``mip_rel_gap`` (1e-6), ``presolve``
            (False), ``exact_limit`` (binaries up to which ``"auto"`` falls
            back to the MILP when the fast path's certified gap exceeds
            ``mip_rel_gap``; 20,000), ``placement_retries`` (2);
            ``backfill`` (FIFO: let later jobs start when the head of the
            queue does not fit; False);
            ``goodput_quantile``: every policy reads each table at this
            quantile of its goodput (:meth:`GoodputTable.at_quantile`; 0.5,
            the median, by default): below 0.5 it is cautious about
            configurations the job's model is unsure of, above 0.5 it
            explores them (a table already at a quantile is refused:
            moving it again would compound).

    Returns:
        an :class:`Allocation`: ``allocation[job]`` is ``None`` or a
        ``JobAllocation(gpu_type, num_nodes, num_gpus, placement)``;
        ``allocation.unallocated`` gives reasons; ``allocation.info`` the
        solver, objective, bound, gap and time.

    Raises:
        ValidationError: bad input, naming the job (NaN or negative goodput,
            an unknown GPU type, non-preemptible demands beyond capacity, an
            unknown option).

    Example::

        from goodput import Cluster, GoodputTable, allocate
        cluster = Cluster.parse("t4:2x4,a100:1x8")
        tables = {"a": GoodputTable("a", [{"gpu_type": "t4", "num_nodes": 1, "num_gpus": 1, "goodput": 100.0},
                                          {"gpu_type": "a100", "num_nodes": 1, "num_gpus": 8, "goodput": 900.0}])}
        allocation = allocate(tables, cluster)
        allocation["a"]          # JobAllocation(gpu_type='a100', num_nodes=1, num_gpus=8, placement={'a100-0': 8})
        allocation.info.solver   # 'unconstrained': the job's best option fits, no solver needed
    """
    started = time.perf_counter()
    options = dict(policy_options)
    policy = options.pop("policy", "sia")
    if policy not in POLICIES:
        raise ValidationError("policy", policy, f"expected one of {POLICIES}")
    jobs = options.pop("jobs", None)
    quantile = check_quantile("goodput_quantile", options.pop("goodput_quantile", 0.5))
    if quantile != 0.5 and isinstance(tables, Mapping):
        tables = {job: t.at_quantile(quantile) if isinstance(t, GoodputTable) else t for job, t in tables.items()}
    unknown = sorted(set(options) - _OPTIONS[policy])
    if unknown:
        raise ValidationError(unknown[0], options[unknown[0]],
                              f"unknown option for policy {policy!r} (known: {sorted(_OPTIONS[policy]) or 'none'})")
    p = check_power(p)  # every policy: gavel and fifo do not use it, but a bad value is still an error
    prep = prepare(tables, cluster, current, jobs)
    if policy == "sia":
        prices = current.info.prices if isinstance(current, Allocation) and current.info.policy == "sia" else None
        return allocate_sia(prep, p, started=started, start_prices=prices, **options)
    if policy == "unaware":
        return allocate_unaware(prep, p, started=started, **options)
    if policy in ("gavel", "gavel-throughput"):
        return allocate_gavel(prep, objective="max_min" if policy == "gavel" else "max_sum", started=started)
    return allocate_fifo(prep, started=started, **options)
