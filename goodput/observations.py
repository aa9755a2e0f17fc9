"""Observations of a training job's step time, and profiles that store them.

An :class:`Observation` is one measured configuration of one job on one GPU
type (DESIGN.md, "Vocabulary"). A :class:`Profile` is a collection of them plus
what the profiler learned about the job (reference batch size, largest local
batch that fits per GPU type). Profiles are stored as JSON Lines, one record a
line, written append-only with a flush and an ``fsync`` per record, so a process
that dies midway leaves every record it finished; :meth:`Profile.load` tolerates
a torn last line and reports it.

Example::

    >>> obs = Observation(job="cifar10", gpu_type="T4", num_nodes=1, num_replicas=2,
    ...                   local_bsz=64, step_time=0.071, sync_time=0.011)
    >>> obs.gpu_type, obs.batch_size
    ('t4', 128)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import fcntl  # POSIX: writers of one file take turns (ProfileWriter)
except ImportError:  # pragma: no cover - Windows
    fcntl = None

from .errors import DataFormatError, ValidationError
from .validation import (
    check_float,
    check_int,
    check_optional_float,
    check_str,
    is_collection,
    normalize_gpu_type,
)

__all__ = ["Observation", "Profile", "ProfileWriter", "TornRecordWarning", "by_gpu_type", "indices_by_gpu_type", "MIN_STEP_TIME",
           "MAX_STEP_TIME"]

MIN_STEP_TIME = 1e-9  # seconds: the shortest step an observation may record (a kernel launch takes microseconds)
# seconds: the longest (11.6 days for one optimizer step): beyond it a record is a unit error or corrupt, and one
# step_time of 1e300 had been accepted and then made every table of its job fail, for good (found in review)
MAX_STEP_TIME = 1e6


class TornRecordWarning(UserWarning):
    """The last line of a JSON Lines file was cut off (a writer died mid-record)."""


@dataclass(frozen=True)
class Observation:
    """One measured configuration of a job.

    Attributes:
        job: the job's name.
        gpu_type: device type, lower-cased (``"t4"``, ``"a100"``, ``"cpu"``).
        num_nodes: nodes the allocation spans (>= 1).
        num_replicas: data-parallel replicas; for a hybrid-parallel job,
            pipelines of ``num_stages`` GPUs (:mod:`goodput.hybrid`). The
            allocation holds ``num_replicas · num_stages >= num_nodes`` GPUs.
        local_bsz: per-replica micro-batch size, samples.
        step_time: seconds of one optimizer step: ``accum_steps`` local
            micro-batches then one synchronised micro-batch (DESIGN.md ``T_iter``).
        sync_time: seconds of that step spent waiting on gradient
            synchronisation, not hidden behind compute; ``None`` if not measured.
        accum_steps: extra micro-batches accumulated before each synchronised step.
        grad_sqr: squared norm of the true gradient, |g|^2 (Pollux, OSDI'21 §3.1).
        grad_var: trace of the per-sample gradient covariance divided by the
            job's reference batch size, tr(Σ)/M0 (Pollux's normalisation).
        placement: GPUs per node, e.g. ``(4, 4)``; if given it must agree with
            ``num_nodes`` and ``num_replicas``.
        step_time_std: spread (standard deviation, seconds) of the timed steps.
        memory_bytes: peak device memory of the step, bytes.
        source: where the observation came from (``"profile"``, ``"training"``,
            ``"trace:pollux"`` ...).
        timestamp: Unix time of the measurement, seconds.
        num_stages: GPUs per data-parallel replica: 1 for a data-parallel job,
            the pipeline stages of a hybrid-parallel one (whose ``local_bsz`` is
            then the micro-batch and ``accum_steps + 1`` the micro-batches per
            step). Left out of :meth:`to_dict` when 1, so that records written
            before the field existed keep their content (and the service its ids).
    """

    job: str
    gpu_type: str
    num_nodes: int
    num_replicas: int
    local_bsz: int
    step_time: float
    sync_time: float | None = None
    accum_steps: int = 0
    grad_sqr: float | None = None
    grad_var: float | None = None
    placement: tuple[int, ...] | None = None
    step_time_std: float | None = None
    memory_bytes: int | None = None
    source: str | None = None
    timestamp: float | None = None
    num_stages: int = 1

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "job", check_str("job", self.job))
        set_(self, "gpu_type", normalize_gpu_type(self.gpu_type))
        num_nodes = check_int("num_nodes", self.num_nodes, minimum=1)
        num_replicas = check_int("num_replicas", self.num_replicas, minimum=1)
        num_stages = check_int("num_stages", self.num_stages, minimum=1)
        set_(self, "num_stages", num_stages)
        if num_replicas * num_stages < num_nodes:
            if num_stages == 1:
                raise ValidationError(
                    "num_replicas", num_replicas, f"must be >= num_nodes ({num_nodes}): every node holds a replica"
                )
            raise ValidationError("num_replicas", num_replicas, f"{num_replicas} x {num_stages} stages hold fewer GPUs "
                                  f"than num_nodes ({num_nodes}): every node holds a GPU")
        set_(self, "num_nodes", num_nodes)
        set_(self, "num_replicas", num_replicas)
        set_(self, "local_bsz", check_int("local_bsz", self.local_bsz, minimum=1))
        set_(self, "accum_steps", check_int("accum_steps", self.accum_steps, minimum=0))
        step_time = check_float("step_time", self.step_time, positive=True)
        if step_time < MIN_STEP_TIME:
            raise ValidationError("step_time", step_time, f"must be >= {MIN_STEP_TIME:g} s (a shorter one is not a measured step)")
        if step_time > MAX_STEP_TIME:
            raise ValidationError("step_time", step_time, f"must be <= {MAX_STEP_TIME:g} s (11.6 days for one step: a unit error?)")
        set_(self, "step_time", step_time)
        sync_time = check_optional_float("sync_time", self.sync_time, nonnegative=True)
        if sync_time is not None and sync_time > step_time:
            raise ValidationError("sync_time", sync_time, f"must be <= step_time ({step_time})")
        set_(self, "sync_time", sync_time)
        grad_sqr = check_optional_float("grad_sqr", self.grad_sqr, positive=True)
        grad_var = check_optional_float("grad_var", self.grad_var, nonnegative=True)
        if (grad_sqr is None) != (grad_var is None):
            missing = "grad_var" if grad_var is None else "grad_sqr"
            given = grad_sqr if grad_var is None else grad_var
            raise ValidationError(missing, None, f"grad_sqr and grad_var come together (the other is {given})")
        set_(self, "grad_sqr", grad_sqr)
        set_(self, "grad_var", grad_var)
        set_(self, "step_time_std", check_optional_float("step_time_std", self.step_time_std, nonnegative=True))
        if self.memory_bytes is not None:
            set_(self, "memory_bytes", check_int("memory_bytes", self.memory_bytes, minimum=0))
        if self.source is not None:
            set_(self, "source", check_str("source", self.source))
        set_(self, "timestamp", check_optional_float("timestamp", self.timestamp))
        if self.placement is not None:
            set_(self, "placement", _check_placement(self.placement, num_nodes, num_replicas, num_stages))

    # ------------------------------------------------------------------ derived
    @property
    def num_gpus(self) -> int:
        """GPUs of the configuration: ``num_replicas * num_stages``."""
        return self.num_replicas * self.num_stages

    @property
    def batch_size(self) -> int:
        """Samples per optimizer step: ``num_replicas * local_bsz * (accum_steps + 1)``."""
        return self.num_replicas * self.local_bsz * (self.accum_steps + 1)

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.batch_size / self.step_time

    @property
    def compute_time(self) -> float | None:
        """Seconds of one micro-batch of compute, ``(step_time - sync_time) / (accum_steps + 1)``.

        ``None`` when ``sync_time`` was not measured.
        """
        if self.sync_time is None:
            return None
        return (self.step_time - self.sync_time) / (self.accum_steps + 1)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict without ``None`` fields."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or (f.name == "num_stages" and value == 1):
                continue
            out[f.name] = list(value) if f.name == "placement" else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Observation:
        """Build from a mapping; unknown keys are an error, not silently dropped."""
        if not isinstance(data, Mapping):
            raise ValidationError("observation", data, "expected a mapping of field names to values")
        unknown = set(data) - _OBSERVATION_FIELDS
        if unknown:
            name = sorted(unknown)[0]
            raise ValidationError(name, data[name], f"unknown observation field (known: {', '.join(sorted(_OBSERVATION_FIELDS))})")
        values = dict(data)
        if values.get("placement") is not None:
            values["placement"] = tuple(values["placement"]) if isinstance(values["placement"], list) else values["placement"]
        try:
            return cls(**values)
        except TypeError as exc:  # a required field is missing
            raise ValidationError("observation", dict(data), str(exc)) from None


_OBSERVATION_FIELDS = frozenset(f.name for f in dataclasses.fields(Observation))
_REQUIRED_FIELDS = frozenset(
    f.name for f in dataclasses.fields(Observation) if f.default is dataclasses.MISSING
)


def by_gpu_type(observations: Iterable[Observation]) -> dict[str, list[Observation]]:
    """Observations grouped by GPU type, in their order of appearance within each type."""
    out: dict[str, list[Observation]] = {}
    for o in observations:
        out.setdefault(o.gpu_type, []).append(o)
    return out


def indices_by_gpu_type(observations: Sequence[Observation]) -> dict[str, list[int]]:
    """Positions in ``observations`` grouped by GPU type (ascending within each type)."""
    out: dict[str, list[int]] = {}
    for i, o in enumerate(observations):
        out.setdefault(o.gpu_type, []).append(i)
    return out


def _check_placement(placement: Any, num_nodes: int, num_replicas: int, num_stages: int = 1) -> tuple[int, ...]:
    if not is_collection(placement):
        raise ValidationError("placement", placement, "expected a sequence of GPUs per node, e.g. (4, 4)")
    values = tuple(check_int("placement", p, minimum=1) for p in placement)
    if len(values) != num_nodes:
        raise ValidationError("placement", placement, f"has {len(values)} nodes but num_nodes={num_nodes}")
    if sum(values) != num_replicas * num_stages:
        held = f"num_replicas={num_replicas}" if num_stages == 1 else f"num_replicas x num_stages={num_replicas * num_stages}"
        raise ValidationError("placement", placement, f"holds {sum(values)} GPUs but {held}")
    return values


# ====================================================================== profiles

_META_KEYS = ("job", "init_batch_size", "max_batch_size", "max_local_bsz", "metadata")
_JOB_SETTINGS = _META_KEYS[1:]  # what a job's own meta records may set, besides naming it


@dataclass
class Profile:
    """Observations of one job (or several) plus what profiling learned about it.

    Attributes:
        observations: the measurements, in the order they were taken.
        job: the job's name (``None`` if the profile mixes jobs).
        init_batch_size: the job's reference batch size M0, samples.
        max_batch_size: the largest total batch size the job allows, samples.
        max_local_bsz: per GPU type, the largest local batch known to fit in memory
            (the memory limit where a profile's sweep ran out of memory or
            reached its cap; the largest size measured where it stopped earlier).
            :meth:`goodput.JobModel.from_profile` takes it as the upper bound.
        metadata: free-form facts (device names, batch-size grid, seconds spent).
        load_warnings: problems tolerated by :meth:`load` (a torn last line).
        job_meta: per job, its own settings (``init_batch_size``, ``max_batch_size``,
            ``max_local_bsz``, ``metadata``) where the profile holds several jobs; a
            setting a job leaves out falls back to the profile-level one.
            :meth:`select` with ``job=`` returns a profile with that job's settings.
            Empty for a profile of one job (its settings are the fields above).
    """

    observations: list[Observation] = field(default_factory=list)
    job: str | None = None
    init_batch_size: int | None = None
    max_batch_size: int | None = None
    max_local_bsz: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    load_warnings: list[str] = field(default_factory=list, compare=False, repr=False)
    job_meta: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not is_collection(self.observations, mappings=False):
            raise ValidationError("observations", self.observations, "expected a sequence of Observations")
        self.observations = [self._check_observation(o, i) for i, o in enumerate(self.observations)]
        if self.job is not None:
            self.job = check_str("job", self.job)
        if self.init_batch_size is not None:
            self.init_batch_size = check_int("init_batch_size", self.init_batch_size, minimum=1)
        if self.max_batch_size is not None:
            self.max_batch_size = check_int("max_batch_size", self.max_batch_size, minimum=1)
        if not isinstance(self.max_local_bsz, Mapping):
            raise ValidationError("max_local_bsz", self.max_local_bsz, "expected a mapping gpu_type -> int")
        self.max_local_bsz = {
            normalize_gpu_type(k, "max_local_bsz"): check_int(f"max_local_bsz[{k!r}]", v, minimum=1)
            for k, v in self.max_local_bsz.items()
        }
        if not isinstance(self.metadata, Mapping):
            raise ValidationError("metadata", self.metadata, "expected a mapping")
        try:  # it is saved as JSON: refused here, not by a save that has opened the file
            text = json.dumps(self.metadata, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValidationError("metadata", self.metadata, f"must be JSON (strings, finite numbers, booleans, "
                                                             f"None, lists and mappings of them): {exc}") from None
        # kept as it will load back: a tuple is a list and a key a string in JSON (a profile loaded again
        # had compared unequal to the one saved)
        self.metadata = json.loads(text)
        self.job_meta = _check_job_meta(self.job_meta)

    @staticmethod
    def _check_observation(obs: Any, index: int) -> Observation:
        if not isinstance(obs, Observation):
            raise ValidationError(f"observations[{index}]", obs, "expected an Observation")
        return obs

    # ------------------------------------------------------------------ collection protocol
    def __len__(self) -> int:
        return len(self.observations)

    def __iter__(self) -> Iterator[Observation]:
        return iter(self.observations)

    def append(self, obs: Observation) -> None:
        self.observations.append(self._check_observation(obs, len(self.observations)))

    def extend(self, observations: Iterable[Observation]) -> None:
        for obs in observations:
            self.append(obs)

    @property
    def gpu_types(self) -> list[str]:
        """GPU types observed, in first-seen order."""
        return list(dict.fromkeys(o.gpu_type for o in self.observations))

    @property
    def jobs(self) -> list[str]:
        """Jobs observed, in first-seen order."""
        return list(dict.fromkeys(o.job for o in self.observations))

    def select(self, *, job: str | None = None, gpu_type: str | None = None) -> Profile:
        """A profile with only the observations of one job and/or GPU type.

        Selecting a job of ``job_meta`` gives that job's own settings (the
        profile-level ones where it sets none) and names it ``job``.
        """
        gpu = normalize_gpu_type(gpu_type) if gpu_type is not None else None
        kept = [o for o in self.observations if (job is None or o.job == job) and (gpu is None or o.gpu_type == gpu)]
        if job is not None and job in self.job_meta:
            return dataclasses.replace(self, observations=kept, load_warnings=[], job_meta={}, **self._settings_of(job))
        return dataclasses.replace(self, observations=kept, load_warnings=[])

    def _settings_of(self, job: str) -> dict[str, Any]:
        """``job``'s settings: the profile-level ones overridden by its own in ``job_meta``."""
        settings = {k: copy.deepcopy(getattr(self, k)) for k in _JOB_SETTINGS}
        _merge_meta(settings, {"job": job, **copy.deepcopy(self.job_meta.get(job, {}))})
        return settings

    def meta_dict(self) -> dict[str, Any]:
        """The profile-level facts as a JSON-ready dict (``None`` and empty values left out)."""
        meta = {k: getattr(self, k) for k in _META_KEYS}
        return {k: v for k, v in meta.items() if v not in (None, {}, [])}

    # ------------------------------------------------------------------ pandas
    def to_frame(self):
        """A pandas DataFrame, one row per observation, one column per field."""
        import pandas as pd

        columns = [f.name for f in dataclasses.fields(Observation)]
        rows = [[getattr(o, c) for c in columns] for o in self.observations]
        return pd.DataFrame(rows, columns=columns)

    @classmethod
    def from_frame(cls, frame, **meta: Any) -> Profile:
        """Build from a DataFrame with Observation columns; a bad row raises naming its index."""
        observations = []
        for index, row in frame.iterrows():
            # Missing optional values are left out; a missing required one stays
            # (NaN) so that validation names it.
            values = {}
            for key, value in row.items():
                plain = _from_pandas(value)
                if plain is not None:
                    values[key] = plain
                elif key in _REQUIRED_FIELDS:
                    values[key] = value
            try:
                observations.append(Observation.from_dict(values))
            except ValidationError as exc:
                raise ValidationError(f"row {index}: {exc.field}", exc.value, exc.reason) from None
        return cls(observations, **meta)

    # ------------------------------------------------------------------ JSON Lines
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Append this profile's records to ``path`` (JSON Lines), never rewriting old ones.

        Records already in the file are not written again (as a multiset: two
        identical measurements stay two), and a meta record only if it adds
        to the meta that its job's records in the file merge to, so saving
        twice, or saving a profile loaded from the same file, adds nothing. A
        profile of several jobs writes a meta record per job of ``job_meta``,
        naming the job, with all of its settings (see :meth:`load`). Each
        record is flushed and ``fsync``-ed before the next is written. Returns
        the path.
        """
        with ProfileWriter(path) as writer:
            already = Counter(writer.existing_records)
            records = [{"record": "meta", **meta} for meta in self._meta_records(writer.existing_meta)
                       if not _meta_known(writer.existing_meta, meta)]
            records.extend({"record": "observation", **obs.to_dict()} for obs in self.observations)
            for record in records:
                key = _canonical(record)
                if already[key] > 0:
                    already[key] -= 1
                else:
                    writer._append(record)
        return Path(path)

    def _meta_records(self, existing_meta: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The meta records that :meth:`save` offers a file whose meta records are ``existing_meta``.

        One job: :meth:`meta_dict`. Several: the profile-level settings (only
        while the file names no job yet: a record without ``job`` belongs to
        the job named last), then each job's settings under its name.
        """
        if not self.job_meta:
            meta = self.meta_dict()
            return [meta] if meta else []
        records = []
        shared = {k: v for k, v in self.meta_dict().items() if k != "job"}
        if shared and not any(record.get("job") is not None for record in existing_meta):
            records.append(shared)
        records.extend(self.select(job=job).meta_dict() for job in self.job_meta)
        return records

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """Read a JSON Lines profile.

        Meta records merge in order, later values overriding earlier ones. A
        meta record without ``job`` belongs to the job named last before it;
        a file whose meta records name several jobs (two profiles appended to
        one file) keeps each job's settings in ``job_meta`` (``job`` is then
        ``None``; :meth:`select` picks a job), the records before the first
        job is named being profile-level.

        A torn last line (a writer killed mid-record) is skipped with a
        :class:`TornRecordWarning` and noted in ``load_warnings``; a malformed
        line anywhere else raises :class:`~goodput.errors.DataFormatError`
        naming the line number.
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"profile not found: {path}")
        records, torn = _read_jsonl(path)
        observations: list[Observation] = []
        metas: list[dict[str, Any]] = []
        for line_no, record in records:
            kind = record.pop("record", "observation")
            try:
                if kind == "observation":
                    observations.append(Observation.from_dict(record))
                elif kind == "meta":
                    metas.append(_check_meta_record(record))
                    cls([], **record)  # its values as a Profile checks them, so that an error names this line
                else:
                    raise ValidationError("record", kind, "expected 'observation' or 'meta'")
            except ValidationError as exc:
                raise DataFormatError(path, line_no, exc.field, exc.value, exc.reason) from None
        try:
            loaded = cls(observations, **_profile_meta(metas))
        except ValidationError as exc:
            raise DataFormatError(path, None, exc.field, exc.value, exc.reason) from None
        if torn is not None:
            message = f"{path}:{torn}: torn last record skipped (a writer stopped mid-line)"
            warnings.warn(message, TornRecordWarning, stacklevel=2)
            loaded.load_warnings.append(message)
        return loaded


def _check_job_meta(job_meta: Any) -> dict[str, dict[str, Any]]:
    """``Profile.job_meta`` checked: job name -> its settings, validated as a Profile's (empty ones left out)."""
    if not isinstance(job_meta, Mapping):
        raise ValidationError("job_meta", job_meta, "expected a mapping job -> settings")
    checked: dict[str, dict[str, Any]] = {}
    for job, settings in job_meta.items():
        job = check_str("job_meta", job)
        if not isinstance(settings, Mapping):
            raise ValidationError(f"job_meta[{job!r}]", settings, "expected a mapping of the job's settings")
        unknown = set(settings) - set(_JOB_SETTINGS)
        if unknown:
            name = sorted(unknown)[0]
            raise ValidationError(f"job_meta[{job!r}].{name}", settings[name],
                                  f"unknown job setting (known: {', '.join(_JOB_SETTINGS)})")
        try:
            own = Profile(job=job, **copy.deepcopy(dict(settings))).meta_dict()
        except ValidationError as exc:
            raise ValidationError(f"job_meta[{job!r}].{exc.field}", exc.value, exc.reason) from None
        checked[job] = {k: v for k, v in own.items() if k != "job"}
    return checked


def _meta_by_job(records: Iterable[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], dict[str, list[Mapping[str, Any]]], str | None]:
    """A file's meta records split by job: ``(shared, {job: its records}, the job named last)``.

    ``shared`` are the records before any names a job; a record without
    ``job`` belongs to the job named last before it.
    """
    shared: list[Mapping[str, Any]] = []
    own: dict[str, list[Mapping[str, Any]]] = {}
    current: str | None = None
    for record in records:
        if record.get("job") is not None:
            current = check_str("job", record["job"])
        if current is None:
            shared.append(record)
        else:
            own.setdefault(current, []).append(record)
    return shared, own, current


def _merged(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The meta that ``records`` merge to, in order (copies: the records are left as they are)."""
    meta: dict[str, Any] = {"max_local_bsz": {}, "metadata": {}}
    for record in records:
        _merge_meta(meta, copy.deepcopy(record))
    return meta


def _profile_meta(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """:class:`Profile` keyword arguments from a file's meta records (see :meth:`Profile.load`)."""
    shared, own, _ = _meta_by_job(records)
    if len(own) <= 1:  # one job (or none named): every record is its
        return _merged(records)
    job_meta = {job: {k: v for k, v in _merged([*shared, *mine]).items() if k != "job"} for job, mine in own.items()}
    return {**_merged(shared), "job_meta": job_meta}


def _meta_known(existing_meta: Iterable[Mapping[str, Any]], meta: Mapping[str, Any]) -> bool:
    """Whether merging ``meta`` into the meta that its job's records in a file merge to changes nothing."""
    try:
        shared, own, current = _meta_by_job(existing_meta)
        job = meta.get("job", current)
        merged = _merged([*shared, *own.get(job, [])]) if job is not None else _merged(shared)
    except ValidationError:
        return False
    before = _canonical(merged)
    updated = json.loads(before)
    _merge_meta(updated, json.loads(_canonical(meta)))
    return _canonical(updated) == before


def _check_meta_record(record: dict[str, Any]) -> dict[str, Any]:
    """A meta record's fields checked (known names, mappings where expected, a job's name); returns it."""
    for key, value in record.items():
        if key not in _META_KEYS:
            raise ValidationError(key, value, f"unknown profile field (known: {', '.join(_META_KEYS)})")
        if key in ("max_local_bsz", "metadata") and not isinstance(value, Mapping):
            raise ValidationError(key, value, "expected a mapping")
    if record.get("job") is not None:
        check_str("job", record["job"])
    return record


def _merge_meta(meta: dict[str, Any], record: Mapping[str, Any]) -> None:
    """Merge one meta record into ``meta``: mappings are updated, other values replaced."""
    for key, value in _check_meta_record(dict(record)).items():
        if key in ("max_local_bsz", "metadata"):
            meta[key].update(value)
        else:
            meta[key] = value


def _from_pandas(value: Any) -> Any:
    """Turn pandas' missing values and numpy scalars into plain Python."""
    if value is None:
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    if hasattr(value, "item") and not isinstance(value, (tuple, list)):
        try:
            value = value.item()
        except (ValueError, AttributeError):
            pass
    try:
        import pandas as pd

        if value is pd.NA or value is pd.NaT:
            return None
    except ImportError:  # pragma: no cover - pandas is a dependency
        pass
    return value


def _first_non_finite(record: Any, prefix: str = "") -> tuple[str, Any]:
    """The first field (dotted path) of a JSON record holding NaN or ±inf, and its value."""
    items = record.items() if isinstance(record, Mapping) else enumerate(record) if isinstance(record, list) else ()
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, float) and not math.isfinite(value):
            return name, value
        if isinstance(value, (Mapping, list)):
            found = _first_non_finite(value, f"{name}.")
            if found[0]:
                return found
    return "", None


def _canonical(record: Mapping[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _read_jsonl(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], int | None]:
    """Parse a JSON Lines file; return ``[(line_no, record)]`` and the torn line's number or None."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    ends_cleanly = data.endswith(b"\n") or not data
    if ends_cleanly:
        lines = lines[:-1]
    records: list[tuple[int, dict[str, Any]]] = []
    torn: int | None = None
    for index, raw in enumerate(lines):
        line_no = index + 1
        is_last = index == len(lines) - 1
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            if not isinstance(record, dict):
                raise TypeError("not a JSON object")
        except (ValueError, UnicodeDecodeError, TypeError) as exc:
            # torn: a record cut mid-write (the last line, without its newline, an object that does not parse);
            # a complete value that is not an object, or a line that is not one, makes a file that is not a profile
            if is_last and not ends_cleanly and not isinstance(exc, TypeError) and raw.lstrip().startswith(b"{"):
                torn = line_no
                break
            snippet = raw[:80].decode("utf-8", "replace")
            reason = "not a JSON object" if isinstance(exc, TypeError) else f"not a JSON object ({exc})"
            raise DataFormatError(path, line_no, "line", snippet, reason) from None
        # A complete JSON object without its newline (the writer died after the
        # record but before the newline) is whole: it is kept like any other.
        records.append((line_no, record))
    return records, torn


class ProfileWriter:
    """Appends records to a JSON Lines profile, durably, one at a time.

    Opening an existing file reads it (``existing``: the observations already
    there, so a rerun can skip what is measured) and cuts off a torn last line,
    which would otherwise corrupt the next record. Every ``write`` appends.
    Writers of one file take turns (an exclusive ``flock`` around that check
    and each append): a second writer opening the file while another appends
    had taken the record being written for a torn one and cut it, after the
    other had fsynced it. A file that is not a profile is refused before
    anything in it changes.

    Example::

        with ProfileWriter("job.jsonl") as writer:
            writer.write_meta(job="cifar10", init_batch_size=128)
            writer.write(observation)        # on disk when this returns
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.existing_records: list[str] = []
        self.existing: list[Observation] = []
        self.existing_meta: list[dict[str, Any]] = []  # the meta records already there, in order
        existed = self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")
        if existed:
            try:
                with self._turn():
                    self._load_existing()
            except BaseException:
                self._file.close()
                raise

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """This writer's turn at the file: an exclusive lock other ProfileWriters wait for (POSIX)."""
        if fcntl is None:
            yield
            return
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)

    def _load_existing(self) -> None:
        self._read_existing()  # first: a file that is not a profile raises before its tail is touched
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            tail = data[cut:]
            try:
                json.loads(tail)
                complete = True
            except ValueError:
                complete = False
            if complete:  # a whole record missing only its newline
                with open(self.path, "ab") as f:
                    f.write(b"\n")
                    f.flush()
                    os.fsync(f.fileno())
            else:
                warnings.warn(
                    f"{self.path}: cutting a torn last record ({len(tail)} bytes) before appending",
                    TornRecordWarning,
                    stacklevel=3,
                )
                with open(self.path, "r+b") as f:
                    f.truncate(cut)
                    f.flush()
                    os.fsync(f.fileno())

    def _read_existing(self) -> None:
        records, _ = _read_jsonl(self.path)
        for line_no, record in records:
            try:
                key = _canonical(record)
            except ValueError:  # NaN or inf, which Python's json writes by default and this file format refuses
                field, value = _first_non_finite(record)
                raise DataFormatError(self.path, line_no, field, value, "must be finite") from None
            if record.get("record") == "meta":
                self.existing_meta.append({k: v for k, v in record.items() if k != "record"})
            elif record.get("record", "observation") == "observation":
                body = {k: v for k, v in record.items() if k != "record"}
                try:
                    observation = Observation.from_dict(body)
                except ValidationError as exc:
                    raise DataFormatError(self.path, line_no, exc.field, exc.value, exc.reason) from None
                self.existing.append(observation)
                # as this writer would write it: a record written by hand (no "record" key, "T4", a step
                # time of 1) is the same observation as the one it loads as
                key = _canonical({"record": "observation", **observation.to_dict()})
            self.existing_records.append(key)

    def _append(self, record: dict[str, Any]) -> None:
        with self._turn():
            self._file.write(_canonical(record).encode() + b"\n")
            self._file.flush()
            os.fsync(self._file.fileno())

    def write(self, obs: Observation) -> None:
        """Append one observation; it is on disk when this returns."""
        if not isinstance(obs, Observation):
            raise ValidationError("observation", obs, "expected an Observation")
        self._append({"record": "observation", **obs.to_dict()})

    def write_meta(self, **meta: Any) -> None:
        """Append profile-level facts (see :class:`Profile`); later records override earlier ones.

        A record without ``job`` belongs to the job named last (see :meth:`Profile.load`).
        """
        unknown = set(meta) - set(_META_KEYS)
        if unknown:
            name = sorted(unknown)[0]
            raise ValidationError(name, meta[name], f"unknown profile field (known: {', '.join(_META_KEYS)})")
        checked = Profile([], **meta)  # the values as a Profile checks them: a bad one would make the file unloadable
        self._append({"record": "meta", **{key: getattr(checked, key) for key in meta}})

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> ProfileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
