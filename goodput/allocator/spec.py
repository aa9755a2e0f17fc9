"""Per-job scheduling facts the allocator needs beside a goodput table.

A :class:`JobSpec` says how old a job is and how often it restarted (Sia's
restart factor), which GPU counts and types it accepts (rigid, minimum,
maximum, granularity, type restriction), whether it may be preempted, and what
it requested (FIFO and Gavel schedule the requested GPU count). The default is
an elastic, preemptible job of age 0 that accepts any configuration of its
table.

Hybrid-parallel jobs (data-parallel replicas that are pipelines of several
GPUs, :mod:`goodput.hybrid`) set ``granularity`` to their GPUs per replica, an
``int`` or ``{gpu_type: int}``, and optionally ``min_replicas``: every policy
then gives them whole pipelines only, at least that many (Sia, SOSP'23).
:meth:`goodput.JobModel.table` of such a job lists only those rows already.

Strong-scaling jobs (fixed total batch) get their tables from
``JobModel(job, init_batch_size=M, max_batch_size=M)``: goodput is then
throughput at batch M. Setting ``fixed_batch_size=M`` makes the allocator
check that the table was computed that way (every row's batch is M, up to the
rounding of one sample per micro-batch that :mod:`goodput.optimize` allows) and
offer no configuration with more data-parallel replicas than samples in the
batch; otherwise a strong-scaling job is scheduled exactly like an elastic one
(Sia, SOSP'23 §3.3, treats them the same: its goodput matrix simply holds
throughputs at the fixed batch).

Example::

    >>> spec = JobSpec(age=600.0, restarts=2, restart_cost=30.0, min_gpus=2, gpu_types=("a100",))
    >>> round(spec.restart_factor, 4)
    0.8571
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..errors import ValidationError
from ..hybrid import check_min_replicas, check_num_stages
from ..validation import check_float, check_int, is_collection, normalize_gpu_type

__all__ = ["JobSpec", "restart_factor", "DEFAULT_RESTART_COST"]

#: Sia's default restart (checkpoint + restore) cost in seconds; its measured
#: per-model values range from 25 s (DeepSpeech2) to 250 s (ImageNet).
DEFAULT_RESTART_COST = 30.0


def restart_factor(age: float, restarts: int, restart_cost: float) -> float:
    """Sia's re-allocation factor ``r = max(age − restarts·S, 0) / (age + S)``.

    The goodput of every configuration other than a running job's current
    one is multiplied by ``r`` (Sia, SOSP'23 §3.3; Pollux's formula). Jobs
    younger than one restart cost are not penalised (``r = 1``), as in Sia.

    Args:
        age: seconds since the job was submitted.
        restarts: how many times it has been restarted (re-allocated) so far.
        restart_cost: S, seconds one restart costs (checkpoint + restore).

    Example::

        >>> restart_factor(20.0, 0, 30.0)      # younger than S
        1.0
        >>> restart_factor(600.0, 2, 30.0)
        0.8571428571428571
    """
    age = check_float("age", age, nonnegative=True)
    restarts = check_int("restarts", restarts, minimum=0)
    cost = check_float("restart_cost", restart_cost, nonnegative=True)
    if age < cost or age + cost == 0.0:
        return 1.0
    return max(age - restarts * cost, 0.0) / (age + cost)


@dataclass(frozen=True)
class JobSpec:
    """What the allocator knows about one job besides its goodput table.

    Attributes:
        age: seconds since submission (Sia's restart factor, FIFO order when
            ``arrival`` is not given).
        restarts: restarts so far (Sia's restart factor).
        restart_cost: S, seconds lost per restart.
        attained: seconds the job has held GPUs so far (Gavel's round
            priorities: a job that received less than its share goes first);
            at most ``age``.
        rigid_gpus: run on exactly this many GPUs (any allowed type); ``None``
            for elastic jobs.
        min_gpus, max_gpus: bounds on the GPU count (``max_gpus=None``: none).
        granularity: the GPU count must be a multiple of this: an ``int``, or
            ``{gpu_type: int}`` (types left out: 1) for a hybrid-parallel job
            whose data-parallel replicas are pipelines of that many GPUs on
            each type (:mod:`goodput.hybrid`; Sia, SOSP'23, scales such jobs
            in whole pipelines).
        min_replicas: the fewest replicas (pipelines of ``granularity`` GPUs):
            on each type at least ``min_replicas × granularity`` GPUs (Sia's
            minimum for hybrid jobs; 1 by default).
        gpu_types: the GPU types the job may run on (``None``: all).
        preemptible: ``False`` pins a running job to its current allocation
            (e.g. while it checkpoints or restores); a job that is not running
            is scheduled normally.
        requested_gpus: the GPU count the user asked for (FIFO and Gavel
            schedule exactly this; Sia and the unaware policy ignore it);
            ``None``: ``rigid_gpus`` if set, else the smallest count allowed.
        arrival: submission time in seconds on any clock (FIFO and Gavel order
            ties by it); ``None``: derived from ``age`` (older first).
        fixed_batch_size: the total batch of a strong-scaling job (see the
            module docstring); ``None`` for adaptive-batch jobs.
    """

    age: float = 0.0
    restarts: int = 0
    restart_cost: float = DEFAULT_RESTART_COST
    attained: float = 0.0
    rigid_gpus: int | None = None
    min_gpus: int = 1
    max_gpus: int | None = None
    granularity: int | Mapping[str, int] = 1
    min_replicas: int = 1
    gpu_types: tuple[str, ...] | None = None
    preemptible: bool = True
    requested_gpus: int | None = None
    arrival: float | None = None
    fixed_batch_size: int | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "age", check_float("age", self.age, nonnegative=True))
        set_(self, "restarts", check_int("restarts", self.restarts, minimum=0))
        set_(self, "restart_cost", check_float("restart_cost", self.restart_cost, nonnegative=True))
        attained = check_float("attained", self.attained, nonnegative=True)
        if attained > self.age * (1 + 1e-9) + 1e-9:
            raise ValidationError("attained", attained, f"cannot exceed age ({self.age} s)")
        set_(self, "attained", attained)
        set_(self, "min_gpus", check_int("min_gpus", self.min_gpus, minimum=1))
        granularity = check_num_stages(self.granularity, "granularity")
        set_(self, "granularity", granularity if isinstance(granularity, int) else _FrozenMapping(granularity))
        set_(self, "min_replicas", check_min_replicas(self.min_replicas))
        if self.max_gpus is not None:
            set_(self, "max_gpus", check_int("max_gpus", self.max_gpus, minimum=self.min_gpus))
        if self.rigid_gpus is not None:
            rigid = check_int("rigid_gpus", self.rigid_gpus, minimum=self.min_gpus)
            if self.max_gpus is not None and rigid > self.max_gpus:
                raise ValidationError("rigid_gpus", rigid, f"exceeds max_gpus ({self.max_gpus})")
            if isinstance(self.granularity, int) and rigid % self.granularity:
                raise ValidationError("rigid_gpus", rigid, f"is not a multiple of granularity ({self.granularity})")
            set_(self, "rigid_gpus", rigid)
        if self.gpu_types is not None:
            types = (self.gpu_types,) if isinstance(self.gpu_types, str) else self.gpu_types
            if not is_collection(types):
                raise ValidationError("gpu_types", self.gpu_types, "expected GPU type names")
            names = tuple(dict.fromkeys(normalize_gpu_type(t, "gpu_types") for t in types))
            if not names:
                raise ValidationError("gpu_types", self.gpu_types, "allows no GPU type (use None for all)")
            set_(self, "gpu_types", names)
        if not isinstance(self.preemptible, bool):
            raise ValidationError("preemptible", self.preemptible, "expected True or False")
        if self.requested_gpus is not None:
            requested = check_int("requested_gpus", self.requested_gpus, minimum=1)
            if self.rigid_gpus is not None and requested != self.rigid_gpus:
                raise ValidationError("requested_gpus", requested, f"differs from rigid_gpus ({self.rigid_gpus})")
            set_(self, "requested_gpus", requested)
        if self.arrival is not None:
            set_(self, "arrival", check_float("arrival", self.arrival))
        if self.fixed_batch_size is not None:
            set_(self, "fixed_batch_size", check_int("fixed_batch_size", self.fixed_batch_size, minimum=1))

    # ------------------------------------------------------------------ derived
    @property
    def restart_factor(self) -> float:
        """Sia's factor for configurations other than the current one (see :func:`restart_factor`)."""
        return restart_factor(self.age, self.restarts, self.restart_cost)

    @property
    def received_share(self) -> float:
        """Fraction of its lifetime the job has held GPUs (0 for a job of age 0)."""
        return 0.0 if self.age == 0.0 else min(self.attained / self.age, 1.0)

    @property
    def order_key(self) -> float:
        """FIFO order: ``arrival`` if given, else ``-age`` (older first)."""
        return self.arrival if self.arrival is not None else -self.age

    def granularity_of(self, gpu_type: str) -> int:
        """GPUs per replica on ``gpu_type`` (the ``granularity`` of that type)."""
        if isinstance(self.granularity, int):
            return self.granularity
        return self.granularity.get(normalize_gpu_type(gpu_type), 1)

    def allows(self, num_gpus: int, gpu_type: str | None = None) -> bool:
        """Whether a GPU count satisfies the rigid/min/max/granularity/min_replicas options (on ``gpu_type``:
        needed when ``granularity`` differs by type)."""
        if self.rigid_gpus is not None and num_gpus != self.rigid_gpus:
            return False
        if num_gpus < self.min_gpus or (self.max_gpus is not None and num_gpus > self.max_gpus):
            return False
        if gpu_type is None and not isinstance(self.granularity, int):
            raise ValidationError("gpu_type", None, "this job's granularity differs by GPU type: name the type")
        step = self.granularity_of(gpu_type) if gpu_type is not None else self.granularity
        return num_gpus % step == 0 and num_gpus >= self.min_replicas * step

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        default = JobSpec()
        out = {k: v for k, v in asdict(self).items() if v != getattr(default, k)}
        if "gpu_types" in out:
            out["gpu_types"] = list(out["gpu_types"])
        if isinstance(self.granularity, Mapping):
            out["granularity"] = dict(self.granularity)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], job: str | None = None) -> JobSpec:
        """Build from a mapping; errors name ``job`` when given."""
        prefix = f"jobs[{job}]." if job is not None else ""
        if not isinstance(data, Mapping):
            raise ValidationError(prefix.rstrip(".") or "spec", data, "expected a mapping of JobSpec fields")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValidationError(f"{prefix}{unknown[0]}", data[unknown[0]], f"unknown JobSpec field (known: {sorted(known)})")
        try:
            return cls(**dict(data))
        except ValidationError as exc:
            raise ValidationError(f"{prefix}{exc.field}", exc.value, exc.reason) from None


class _FrozenMapping(Mapping):
    """A read-only, hashable ``{gpu_type: int}`` (a frozen dataclass's field stays immutable)."""

    def __init__(self, data: Mapping[str, int]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> int:
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._data) == dict(other)

    def __repr__(self) -> str:
        return repr(self._data)


#: the spec of a job given none: elastic, preemptible, age 0
DEFAULT_SPEC = JobSpec()


def coerce_spec(job: str, value: Any) -> JobSpec:
    """A :class:`JobSpec` from a JobSpec, a mapping or ``None`` (the default), naming ``job`` in errors."""
    if value is None:
        return DEFAULT_SPEC
    if isinstance(value, JobSpec):
        return value
    return JobSpec.from_dict(value, job=job)
