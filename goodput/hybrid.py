"""Hybrid-parallel jobs: data-parallel replicas that are pipelines of several GPUs.

A hybrid-parallel job splits its model into ``num_stages`` pipeline stages,
one GPU each, and trains ``num_replicas`` data-parallel copies of that
pipeline: it holds ``num_gpus = num_replicas · num_stages`` GPUs. Sia
(Jayaram Subramanya et al., "Sia: Heterogeneity-aware, goodput-optimized
ML-cluster scheduling", SOSP'23, §3) scales such a job in whole pipelines:
its valid configurations on a GPU type are the multiples of that type's stage
count, from a minimum number of replicas up. The stage count may differ by GPU
type (a GPU with more memory holds more of the model: Sia's artifact runs its
GPT job in 8 stages on RTX 2080 Ti nodes and in 2 on A100 nodes).

Vocabulary (DESIGN.md's, extended): ``num_stages`` is the GPUs per
data-parallel replica (1, the default, for a data-parallel job);
``num_replicas`` counts replicas, i.e. pipelines of a hybrid job. The
throughput model keeps its inputs ``(num_nodes, num_replicas, local_bsz,
accum_steps)``: for a hybrid job a replica is a pipeline, ``local_bsz`` its
micro-batch and ``accum_steps + 1`` the micro-batches per optimizer step.

A job's stage count is written as an ``int`` (every GPU type) or a mapping
``{gpu_type: int}``; types a mapping leaves out run 1 stage (data parallel).

Example::

    >>> stages = Stages.parse({"rtx2080ti": 8, "a100": 2})
    >>> stages.of("a100"), stages.of("t4"), stages.replicas("a100", 8), stages.replicas("a100", 7)
    (2, 1, 4, 0)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ValidationError
from .validation import check_int, normalize_gpu_type

__all__ = ["Stages", "check_num_stages", "check_min_replicas", "check_observation_stages", "replicas_of", "stages_of"]


def check_num_stages(value: Any, field: str = "num_stages") -> int | dict[str, int]:
    """An ``int >= 1`` or a mapping ``{gpu_type: int >= 1}`` (GPU types normalised), else :class:`ValidationError`."""
    if isinstance(value, Mapping):
        out: dict[str, int] = {}
        for gpu, stages in value.items():
            name = normalize_gpu_type(gpu, field)
            if name in out:
                raise ValidationError(field, gpu, f"names GPU type {name!r} twice")
            out[name] = check_int(f"{field}[{gpu!r}]", stages, minimum=1)
        return out
    return check_int(field, value, minimum=1)


def check_min_replicas(value: Any, field: str = "min_replicas") -> int:
    """The fewest data-parallel replicas (pipelines) a job runs on: an ``int >= 1``."""
    return check_int(field, value, minimum=1)


@dataclass(frozen=True)
class Stages:
    """A job's stage count per GPU type (see the module docstring); build with :meth:`parse`."""

    default: int = 1
    by_type: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: Any, field: str = "num_stages") -> Stages:
        if isinstance(value, Stages):
            return value
        checked = check_num_stages(value, field)
        if isinstance(checked, dict):
            return cls(1, checked)
        return cls(checked, {})

    def of(self, gpu_type: str) -> int:
        """GPUs per replica on ``gpu_type`` (any spelling :func:`~goodput.validation.normalize_gpu_type` reads)."""
        if not self.by_type:
            return self.default
        stages = self.by_type.get(gpu_type)
        if stages is None:  # the keys are normalized (parse): so is the name asked for
            stages = self.by_type.get(normalize_gpu_type(gpu_type, "gpu_type"), self.default)
        return stages

    @property
    def hybrid(self) -> bool:
        """Whether any GPU type runs more than one stage per replica."""
        return self.default > 1 or any(s > 1 for s in self.by_type.values())

    @property
    def value(self) -> int | dict[str, int]:
        """The stage count as it was given: an ``int`` or ``{gpu_type: int}``."""
        return dict(self.by_type) if self.by_type else self.default

    def replicas(self, gpu_type: str, num_gpus: int) -> int:
        """Replicas (pipelines) on ``num_gpus`` GPUs of ``gpu_type``; 0 when they are not whole pipelines."""
        stages = self.of(gpu_type)
        return num_gpus // stages if num_gpus % stages == 0 else 0

    def valid(self, gpu_type: str, num_gpus: int, min_replicas: int = 1) -> bool:
        """Whether ``num_gpus`` GPUs of ``gpu_type`` are whole pipelines, at least ``min_replicas`` of them."""
        return self.replicas(gpu_type, num_gpus) >= max(min_replicas, 1)


def replicas_of(stages: Stages, gpu_type: str, num_nodes: int, num_replicas: Any = None, num_gpus: Any = None) -> int:
    """Replicas of an allocation given by its replicas or by its GPUs (exactly one of them).

    GPUs that are not whole pipelines give 0 replicas. Raises :class:`ValidationError` when both or
    neither are given, or when the allocation holds fewer GPUs than ``num_nodes``.
    """
    if (num_replicas is None) == (num_gpus is None):
        raise ValidationError("num_replicas", num_replicas, "give the allocation's num_replicas or its num_gpus (one of them)")
    per_replica = stages.of(gpu_type)
    if num_gpus is not None:
        gpus = check_int("num_gpus", num_gpus, minimum=1)
        if gpus < num_nodes:
            raise ValidationError("num_gpus", gpus, f"must be >= num_nodes ({num_nodes})")
        return stages.replicas(gpu_type, gpus)
    replicas = check_int("num_replicas", num_replicas, minimum=1)
    if replicas * per_replica < num_nodes:
        reason = f"must be >= num_nodes ({num_nodes})" if per_replica == 1 else \
            f"{replicas} pipelines of {per_replica} GPUs hold fewer GPUs than num_nodes ({num_nodes})"
        raise ValidationError("num_replicas", replicas, reason)
    return replicas


def check_observation_stages(stages: Stages, observation: Any, index: int) -> None:
    """Raise :class:`ValidationError` when an observation's ``num_stages`` differs from the job's on its GPU type."""
    expected = stages.of(observation.gpu_type)
    if observation.num_stages != expected:
        raise ValidationError(f"observations[{index}].num_stages", observation.num_stages,
                              f"the job runs {expected} stage(s) per replica on {observation.gpu_type} "
                              "(JobModel(num_stages=...))")


def stages_of(observations: Iterable[Any]) -> int | dict[str, int]:
    """The stage count that observations were measured with: ``1`` when every one is data parallel, else
    ``{gpu_type: stages}``. Raises :class:`ValidationError` when one GPU type's observations disagree."""
    seen: dict[str, int] = {}
    for index, obs in enumerate(observations):
        known = seen.setdefault(obs.gpu_type, obs.num_stages)
        if known != obs.num_stages:
            raise ValidationError(f"observations[{index}].num_stages", obs.num_stages,
                                  f"other {obs.gpu_type} observations of the job have {known}")
    return 1 if all(s == 1 for s in seen.values()) else seen
