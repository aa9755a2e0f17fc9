"""Allocating GPUs to jobs by goodput: Sia's ILP with placement, and the policies it is compared with.

Modules, one job each:

- :mod:`.spec` — :class:`JobSpec`, per-job facts (age, restarts, options);
- :mod:`.problem` — validation and Sia's options/costs from goodput tables;
- :mod:`.sia` — the exact MILP (scipy/HiGHS) and the policy driver;
- :mod:`.lagrangian` — the fast path for thousands of GPUs;
- :mod:`.placement` — Sia's placement rules onto nodes;
- :mod:`.policies` — Gavel (max-min fairness, max-sum-throughput), a
  heterogeneity-unaware goodput policy, FIFO;
- :mod:`.result` — :class:`Allocation`, :class:`JobAllocation`, :class:`SolverInfo`;
- :mod:`.api` — :func:`allocate`.

Example::

    from goodput import Cluster, allocate
    allocation = allocate(tables, Cluster.parse("t4:6x4,a100:2x8"), current=last_round,
                          jobs={"bert-3": JobSpec(age=900, restarts=1, rigid_gpus=8)})
    for job, alloc in allocation.items():
        print(job, alloc and alloc.placement, allocation.unallocated.get(job))
    allocation.info    # solver, objective, bound, gap, wall time
"""

from .api import POLICIES, allocate
from .result import Allocation, JobAllocation, SolverInfo
from .spec import JobSpec, restart_factor

__all__ = ["allocate", "POLICIES", "Allocation", "JobAllocation", "SolverInfo", "JobSpec", "restart_factor"]
