"""What :func:`goodput.allocate` returns: per-job allocations, reasons, solver facts.

``allocation[job]`` is ``None`` (no GPUs this round; ``allocation.unallocated[job]``
says why) or a :class:`JobAllocation` ``(gpu_type, num_nodes, num_gpus,
placement={node_id: gpus})``. ``allocation.info`` is a :class:`SolverInfo`:
which policy and solver ran, its objective, the bound and gap that certify how
good the answer is, and the wall time.

Example::

    >>> a = JobAllocation("t4", 2, 8, {"t4-0": 4, "t4-1": 4})
    >>> a.configuration
    ('t4', 2, 8)
    >>> JobAllocation.from_dict(a.to_dict()) == a
    True
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import DataFormatError, ValidationError
from ..io import atomic_write_text, read_json
from ..validation import check_float, check_int, check_str, normalize_gpu_type

__all__ = ["JobAllocation", "SolverInfo", "Allocation"]


@dataclass(frozen=True)
class JobAllocation:
    """One job's GPUs: a configuration of Sia's set and where its GPUs are.

    Attributes:
        gpu_type: the GPU type (every GPU of an allocation is of one type).
        num_nodes: nodes spanned.
        num_gpus: GPUs in all.
        placement: ``{node_id: gpus}`` with node ids from
            :meth:`goodput.cluster.NodePool.node_ids` (``"t4-0"``, …); empty
            when not known (e.g. a ``current`` allocation given without one).
            Treat it as read-only.
    """

    gpu_type: str
    num_nodes: int
    num_gpus: int
    placement: dict[str, int] = field(default_factory=dict, compare=True)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "gpu_type", normalize_gpu_type(self.gpu_type))
        nodes = check_int("num_nodes", self.num_nodes, minimum=1)
        gpus = check_int("num_gpus", self.num_gpus, minimum=nodes)
        set_(self, "num_nodes", nodes)
        set_(self, "num_gpus", gpus)
        if not isinstance(self.placement, Mapping):
            raise ValidationError("placement", self.placement, "expected {node_id: gpus}")
        placement = {}
        for node, count in self.placement.items():
            placement[check_str("placement node", node)] = check_int(f"placement[{node}]", count, minimum=1)
        if placement:
            if len(placement) != nodes:
                raise ValidationError("placement", placement, f"spans {len(placement)} nodes, expected num_nodes={nodes}")
            if sum(placement.values()) != gpus:
                raise ValidationError("placement", placement, f"holds {sum(placement.values())} GPUs, expected num_gpus={gpus}")
        set_(self, "placement", placement)

    def __hash__(self) -> int:
        return hash((self.gpu_type, self.num_nodes, self.num_gpus, tuple(sorted(self.placement.items()))))

    @classmethod
    def _checked(cls, gpu_type: str, num_nodes: int, num_gpus: int, placement: dict[str, int]) -> JobAllocation:
        """An allocation the allocator built itself from validated inputs (its placement holds num_gpus on
        num_nodes nodes by construction): skips the checks, which cost more than the rest of a large round."""
        alloc = object.__new__(cls)
        set_ = object.__setattr__
        set_(alloc, "gpu_type", gpu_type)
        set_(alloc, "num_nodes", int(num_nodes))
        set_(alloc, "num_gpus", int(num_gpus))
        set_(alloc, "placement", placement)
        return alloc

    @property
    def configuration(self) -> tuple[str, int, int]:
        """``(gpu_type, num_nodes, num_gpus)``, a row key of a goodput table."""
        return (self.gpu_type, self.num_nodes, self.num_gpus)

    def to_dict(self) -> dict[str, Any]:
        return {"gpu_type": self.gpu_type, "num_nodes": self.num_nodes, "num_gpus": self.num_gpus,
                "placement": dict(self.placement)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobAllocation:
        if not isinstance(data, Mapping):
            raise ValidationError("allocation", data, "expected {'gpu_type', 'num_nodes', 'num_gpus', 'placement'}")
        missing = [k for k in ("gpu_type", "num_nodes", "num_gpus") if k not in data]
        if missing:
            raise ValidationError(missing[0], None, "missing")
        return cls(data["gpu_type"], data["num_nodes"], data["num_gpus"], data.get("placement") or {})


@dataclass(frozen=True)
class SolverInfo:
    """How an allocation was computed.

    Attributes:
        policy: ``"sia"``, ``"gavel"``, ``"gavel-throughput"``, ``"unaware"`` or ``"fifo"``.
        solver: ``"milp"`` (scipy/HiGHS branch and bound), ``"lagrangian"``
            (the fast path), ``"lagrangian+milp"`` (the fast path, then the
            MILP over the options its reduced costs leave: exact),
            ``"unconstrained"`` (every job's best option fits: optimal, no
            solver), ``"linprog"`` (Gavel's LP, then rounding), ``"greedy"``
            (FIFO) or ``"none"`` (nothing to decide).
        status: ``"optimal"``, ``"time_limit"`` (best found within the limit),
            ``"heuristic"`` (a feasible answer with a bound), ``"lp+rounding"``.
        objective: the policy's objective at the answer (Sia: the sum of
            utilities plus λ per unallocated job, see :mod:`goodput.allocator.sia`).
        bound: a proven bound on the optimum (lower for minimisation, upper
            for maximisation), when the solver gives one.
        gap: ``|objective − bound| / max(|objective|, 1e-9)``; 0 means proven optimal.
        sense: ``"minimize"`` or ``"maximize"``.
        wall_time: seconds of the whole :func:`~goodput.allocate` call.
        solve_time: seconds inside the solver(s).
        num_jobs: jobs in the tables; num_variables: binaries (or LP variables)
            after pruning dominated configurations.
        attempts: solves needed (more than 1 when a placement failed and the
            configuration was excluded).
        notes: anything worth knowing (fallbacks, retries).
        prices: the fast path's price per GPU of each type (its Lagrange
            multipliers), when it ran; a later round's :func:`~goodput.allocate`
            given this allocation as ``current`` starts from them.
    """

    policy: str
    solver: str
    status: str
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    sense: str = "minimize"
    wall_time: float = 0.0
    solve_time: float = 0.0
    num_jobs: int = 0
    num_variables: int = 0
    attempts: int = 1
    notes: tuple[str, ...] = ()
    prices: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["notes"] = list(self.notes)
        if self.prices is None:
            del out["prices"]
        return out


class Allocation(Mapping):
    """The decision of one scheduling round: ``{job: JobAllocation | None}``.

    Attributes:
        unallocated: ``{job: reason}`` for every job without GPUs.
        info: a :class:`SolverInfo`.
        details: ``{job: {...}}`` per allocated job: ``goodput``,
            ``normalized_goodput``, ``changed`` (configuration differs from
            ``current``), ``moved`` (same configuration, other GPUs).
    """

    def __init__(
        self,
        allocations: Mapping[str, JobAllocation | None],
        unallocated: Mapping[str, str],
        info: SolverInfo,
        details: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self._allocations = dict(allocations)
        self.unallocated = dict(unallocated)
        self.info = info
        self.details = {k: dict(v) for k, v in (details or {}).items()}
        for job, value in self._allocations.items():
            if value is None and job not in self.unallocated:
                raise ValidationError(f"allocation[{job}]", None, "unallocated without a reason")

    def __getitem__(self, job: str) -> JobAllocation | None:
        return self._allocations[job]

    def __iter__(self) -> Iterator[str]:
        return iter(self._allocations)

    def __len__(self) -> int:
        return len(self._allocations)

    def __repr__(self) -> str:
        return (f"Allocation(policy={self.info.policy!r}, solver={self.info.solver!r}, jobs={len(self)}, "
                f"allocated={len(self.allocated)}, gpus={self.gpus_used()})")

    @property
    def allocated(self) -> dict[str, JobAllocation]:
        """Jobs with GPUs this round."""
        return {k: v for k, v in self._allocations.items() if v is not None}

    def gpus_used(self) -> dict[str, int]:
        """GPUs allocated per type."""
        used: dict[str, int] = {}
        for value in self.allocated.values():
            used[value.gpu_type] = used.get(value.gpu_type, 0) + value.num_gpus
        return used

    def to_frame(self) -> Any:
        """A pandas frame, one row per job: configuration, placement, goodput, reason."""
        import pandas as pd

        rows = []
        for job, value in self._allocations.items():
            detail = self.details.get(job, {})
            if value is None:
                rows.append({"job": job, "gpu_type": None, "num_nodes": 0, "num_gpus": 0, "placement": "",
                             "normalized_goodput": None, "changed": None, "reason": self.unallocated.get(job, "")})
            else:
                placement = " ".join(f"{node}:{gpus}" for node, gpus in value.placement.items())
                rows.append({"job": job, "gpu_type": value.gpu_type, "num_nodes": value.num_nodes,
                             "num_gpus": value.num_gpus, "placement": placement,
                             "normalized_goodput": detail.get("normalized_goodput"),
                             "changed": detail.get("changed"), "reason": ""})
        columns = ["job", "gpu_type", "num_nodes", "num_gpus", "placement", "normalized_goodput", "changed", "reason"]
        return pd.DataFrame(rows, columns=columns)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "allocations": {k: (None if v is None else v.to_dict()) for k, v in self._allocations.items()},
            "unallocated": dict(self.unallocated),
            "info": self.info.to_dict(),
            "details": self.details,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Allocation:
        if not isinstance(data, Mapping) or not isinstance(data.get("allocations"), Mapping):
            raise ValidationError("allocation", type(data).__name__, "expected {'allocations': {...}, ...}")
        allocations = {}
        for job, value in data["allocations"].items():
            try:
                allocations[job] = None if value is None else JobAllocation.from_dict(value)
            except ValidationError as exc:
                raise ValidationError(f"allocations[{job}].{exc.field}", exc.value, exc.reason) from None
        info = data.get("info") or {"policy": "unknown", "solver": "unknown", "status": "unknown"}
        if not isinstance(info, Mapping):
            raise ValidationError("info", info, "expected a mapping of SolverInfo's fields")
        known = {f.name for f in fields(SolverInfo)}
        odd = sorted(set(info) - known) or sorted({"policy", "solver", "status"} - set(info))  # unknown, else missing
        if odd:
            raise ValidationError(f"info.{odd[0]}", info.get(odd[0]), f"unknown or missing (fields: {sorted(known)})")
        notes, prices, unallocated = info.get("notes", ()), info.get("prices"), data.get("unallocated", {})
        if not isinstance(notes, (list, tuple)) or not all(isinstance(n, str) for n in notes):
            raise ValidationError("info.notes", notes, "expected a list of strings")
        if prices is not None:
            if not isinstance(prices, Mapping):
                raise ValidationError("info.prices", prices, "expected {gpu_type: price per GPU}")
            prices = {check_str("info.prices", t): check_float(f"info.prices[{t}]", v) for t, v in prices.items()}
        if not isinstance(unallocated, Mapping):
            raise ValidationError("unallocated", unallocated, "expected {job: reason}")
        info_data = {**info, "notes": tuple(notes), "prices": prices}
        return cls(allocations, unallocated, SolverInfo(**info_data), data.get("details"))

    def to_json(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (the ``--current`` input of ``goodput allocate``)."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Allocation:
        data = read_json(path)
        try:
            return cls.from_dict(data)
        except ValidationError as exc:
            raise DataFormatError(path, None, exc.field, exc.value, exc.reason) from None
