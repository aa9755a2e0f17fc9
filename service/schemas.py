"""Request and response bodies of the service (pydantic), shown at ``/docs``.

The schema of one observation record is derived from the
:class:`goodput.Observation` dataclass's fields, so a field added there is
accepted here too; ``extra="forbid"`` refuses unknown keys, strict types refuse
``"4"`` for 4. The values are then checked by :meth:`goodput.Observation.from_dict`
(the core's own validation), whose errors become 422 answers naming the
record's index, the field and the value (:func:`validation_detail`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from goodput import Observation
from goodput.errors import ValidationError
from goodput.hybrid import check_num_stages
from goodput.validation import JOB_NAME_PATTERN, MAX_BATCH, check_bounds, check_float, check_int, normalize_gpu_type

__all__ = ["JOB_PATTERN", "RECORD_ID_PATTERN", "ObservationRecord", "ObservationBatch", "ObservationsAccepted",
           "JobSettings", "JobOut", "GoodputOut", "TableOut", "AllocateIn", "StoredRecord", "StoredRecords",
           "validation_detail", "MAX_RECORDS", "json_bytes", "json_safe"]

JOB_PATTERN = JOB_NAME_PATTERN  # job names: safe in URLs, file names and label values
RECORD_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
MAX_RECORDS = 100_000  # records per POST (the body limit usually bites first)

_STRICT = ConfigDict(extra="forbid", strict=True)


def _json_annotation(annotation: Any) -> Any:
    """``annotation`` as JSON arrives: tuples become lists (JSON has arrays only; strict mode takes no list for a tuple)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is tuple:
        items = [a for a in args if a is not Ellipsis]
        item = items[0] if len(set(items)) == 1 else typing.Union[tuple(items)]  # noqa: UP007
        if Ellipsis in args or not args:
            return list[item]
        return Annotated[list[item], Field(min_length=len(args), max_length=len(args))]
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_json_annotation(a) for a in args)]  # noqa: UP007
    return annotation


def _observation_record_model() -> type[BaseModel]:
    """A pydantic model with one field per :class:`Observation` field (``job`` optional), plus ``id``."""
    hints = typing.get_type_hints(Observation)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(Observation):
        annotation = _json_annotation(hints[f.name])
        if f.name == "job":
            fields[f.name] = (str | None, Field(None, description="the job; the URL's job when left out (must match it)"))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
            fields[f.name] = (annotation, ...)
        else:
            default = f.default if f.default is not dataclasses.MISSING else None
            fields[f.name] = (annotation, default)
    fields["id"] = (Annotated[str, Field(pattern=RECORD_ID_PATTERN)] | None, Field(
        None, description="the record's id, unique within the job: a record sent twice with one id is stored once "
                          "(default: the SHA-256 of the record's canonical JSON)"))
    return create_model("ObservationRecord", __config__=_STRICT,
                        __doc__="One observation (goodput.Observation.to_dict()), with an optional id.", **fields)


ObservationRecord = _observation_record_model()


class ObservationBatch(BaseModel):
    """``{"observations": [...]}``: a profile's records or a running job's reports."""

    model_config = _STRICT
    observations: list[ObservationRecord] = Field(..., max_length=MAX_RECORDS)  # type: ignore[valid-type]


class ObservationsAccepted(BaseModel):
    accepted: int = Field(..., description="records stored by this request (records stored before are not counted)")
    total: int = Field(..., description="observations of the job in the store")


_Pair = Annotated[list[int], Field(min_length=2, max_length=2)]


class JobSettings(BaseModel):
    """A job's settings (``PUT /v1/jobs/{job}``); see :class:`goodput.JobModel`."""

    model_config = _STRICT
    init_batch_size: int = Field(..., description="the reference batch M0 (samples) the job was tuned at")
    max_batch_size: int | None = Field(None, description="the largest total batch the job tolerates (default: M0)")
    local_bsz_bounds: _Pair | dict[str, _Pair] | None = Field(
        None, description="[min, max] per-replica batch, or {gpu_type: [min, max]}")
    gpu_types: list[str] | None = Field(None, description="the GPU types the job may run on (default: all); "
                                        "allocations and the Kubernetes filter keep to them")
    num_stages: int | dict[str, int] | None = Field(
        None, description="GPUs per data-parallel replica, or {gpu_type: GPUs}: the pipeline stages of a "
        "hybrid-parallel job, scaled in whole pipelines (default 1: data parallel); its observations must "
        "carry the same num_stages")
    model_size: float | None = Field(
        None, description="the job's trainable parameters: with a cluster prior (goodput serve --learn-prior or "
        "--cluster-prior), its size slopes place the job's sync costs (gradient bytes) before it has run multi-GPU")

    def checked(self) -> dict[str, Any]:
        """The settings normalised (lower-case GPU types, bounds as lists), checked as the core checks them."""
        init = check_int("init_batch_size", self.init_batch_size, minimum=1, maximum=MAX_BATCH)
        out: dict[str, Any] = {"init_batch_size": init}
        if self.max_batch_size is not None:
            top = check_int("max_batch_size", self.max_batch_size, minimum=1, maximum=MAX_BATCH)
            if top < init:
                raise ValidationError("max_batch_size", top, f"must be >= init_batch_size ({init})")
            out["max_batch_size"] = top
        bounds = self.local_bsz_bounds
        if isinstance(bounds, Mapping):
            checked: dict[str, list[int]] = {}
            for gpu, pair in bounds.items():
                name = normalize_gpu_type(gpu, "local_bsz_bounds")
                if name in checked:
                    raise ValidationError("local_bsz_bounds", gpu, f"names GPU type {name!r} twice")
                checked[name] = list(check_bounds(f"local_bsz_bounds[{gpu!r}]", pair))
            out["local_bsz_bounds"] = checked
        elif bounds is not None:
            out["local_bsz_bounds"] = list(check_bounds("local_bsz_bounds", bounds))
        if self.gpu_types is not None:
            names = list(dict.fromkeys(normalize_gpu_type(g, "gpu_types") for g in self.gpu_types))
            if not names:
                raise ValidationError("gpu_types", self.gpu_types, "allows no GPU type (leave it out for all)")
            out["gpu_types"] = names
        if self.num_stages is not None:
            stages = check_num_stages(self.num_stages)
            if stages != 1:
                out["num_stages"] = stages
        if self.model_size is not None:
            out["model_size"] = check_float("model_size", self.model_size, positive=True)
        return out


class ModelStatus(BaseModel):
    state: str = Field(..., description="'ready' (answers come from a model), 'rebuilding' (the model is being "
                       "built from the store; goodput queries answer 503), or 'failed' (the last rebuild failed; "
                       "the last good model, if any, still answers)")
    version: int = Field(..., description="the published model's version (0: none yet); answers are cached per version")
    observations: int = Field(..., description="observations in the published model")
    refits: int = Field(..., description="refits of the published model since it was built")
    last_refit: float | None = Field(None, description="Unix time of the published model's last refit (its "
                                     "Pollux fits and GP hyperparameters; between refits it conditions online)")
    published_at: float | None = Field(None, description="Unix time the published model was last updated")
    error: str | None = None
    unreadable: int = Field(0, description="stored records the current Observation could not read (left out)")


class JobOut(BaseModel):
    job: str
    settings: dict[str, Any]
    created: float
    updated: float
    observations: int = Field(..., description="observations stored")
    gpu_types: list[str] = Field(..., description="GPU types seen in the published model")
    model: ModelStatus
    diagnostics: dict[str, Any] | None = Field(None, description="JobModel.diagnostics of the published model")


class GoodputOut(BaseModel):
    job: str
    gpu_type: str
    num_nodes: int
    num_gpus: int
    goodput: float = Field(..., description="samples/s × statistical efficiency (0: no batch fits)")
    std: float = Field(..., description="standard deviation of goodput, same unit")
    batch_size: int
    local_bsz: int
    accum_steps: int
    throughput: float = Field(..., description="samples/s")
    efficiency: float
    step_time: float = Field(..., description="seconds per optimizer step")
    model_version: int


class TableOut(BaseModel):
    job: str
    cluster: str
    model_version: int
    rows: list[dict[str, Any]]
    missing_gpu_types: list[str] = Field(default_factory=list)
    reason: str | None = Field(None, description="why rows is empty (absent when it is not): no whole pipeline "
                               "of a hybrid job fits a pool of its observed types, or no observations for the cluster's types")


class AllocateIn(BaseModel):
    """One scheduling round over the service's jobs (:func:`goodput.allocate`)."""

    model_config = _STRICT  # p=true or p="0.5" refused, as allocate() refuses them
    cluster: str | None = Field(None, description="type:NODESxGPUS,... (default: the server's --cluster)")
    jobs: list[Annotated[str, Field(pattern=JOB_PATTERN)]] | None = Field(
        None, description="the jobs to allocate (default: every job with observations)")
    current: dict[str, dict[str, Any] | None] | None = Field(
        None, description="last round: {job: JobAllocation.to_dict() or null}")
    policy: str = "sia"
    p: float = -0.5
    specs: dict[Annotated[str, Field(pattern=JOB_PATTERN)], dict[str, Any]] | None = Field(
        None, description="per job, JobSpec fields (age, restarts, restart_cost, requested_gpus, min_gpus, max_gpus, "
        "rigid_gpus, preemptible, gpu_types, ...); a job's registered gpu_types still limit it")
    options: dict[str, Any] | None = Field(None, description="further allocate() options: lam, solver, time_limit, "
                                           "mip_rel_gap, goodput_quantile, backfill, ...")


class StoredRecord(BaseModel):
    row: int = Field(..., description="order of arrival in the store")
    id: str
    received: float
    observation: dict[str, Any]


class StoredRecords(BaseModel):
    job: str
    records: list[StoredRecord]
    next_after: int | None = Field(None, description="pass as ?after= for the next page (null: no more)")


_FIELD_PARTS = re.compile(r"\.(?![^\[]*\])")  # a field's dots, not those inside [...] (``limits[nvidia.com/gpu]``)


def validation_detail(exc: ValidationError, loc: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    """A core :class:`~goodput.errors.ValidationError` as FastAPI's 422 ``detail`` list: where, what, which value."""
    return [{"type": "value_error", "loc": [*loc, *_FIELD_PARTS.split(str(exc.field))], "msg": exc.reason,
             "input": json_safe(exc.value)}]


def json_bytes(data: Any) -> bytes:
    """Compact JSON of ``data`` made :func:`json_safe` (an answer's body)."""
    return json.dumps(json_safe(data), separators=(",", ":"), allow_nan=False).encode("utf-8")


def json_safe(value: Any) -> Any:
    """``value`` with everything JSON cannot hold (NaN, infinities, numpy scalars, tuples, objects) made plain."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in value]
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return json_safe(item())
        except (TypeError, ValueError):
            pass
    tolist = getattr(value, "tolist", None)  # numpy arrays
    if callable(tolist):
        return json_safe(tolist())
    return repr(value)
