"""Readers for published measurements (see ``../shared/data/README.md``).

Every reader validates row by row and raises
:class:`~goodput.errors.DataFormatError` naming the file, the line and the
column of the first bad value; nothing is skipped silently (rows that are
legitimately unusable, like Gavel's 0.0 "infeasible" entries, are returned in
a ``skipped`` list with the reason).

Formats:

* **placements CSV** (Pollux, OSDI'21 artifact): ``placement,local_bsz,step_time,sync_time``;
  ``placement`` is a digit string of GPUs per node (``"22"`` = 2 nodes × 2 GPUs).
* **scalability CSV** (Pollux): ``num_nodes,num_replicas,local_bsz,step_time,sync_time``.
* **validation CSV** (Pollux): ``progress,iteration,metric,grad_sqr,grad_var`` per epoch.
* **Gavel throughputs JSON** (Narayanan et al., OSDI'20 artifact): steps/s of
  ``'<model> (batch size B)'`` on 1/2/4/8 GPUs per GPU type.
"""

from __future__ import annotations

import ast
import csv
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from goodput.errors import DataFormatError, ValidationError
from goodput.observations import Observation, Profile

__all__ = [
    "read_csv_rows",
    "read_placements",
    "read_scalability",
    "read_validation",
    "read_pollux_trace",
    "read_gavel_throughputs",
    "GavelData",
    "parse_placement",
    "default_data_dir",
]


def default_data_dir() -> Path | None:
    """``../shared/data`` beside the project checkout, or ``$GOODPUT_DATA_DIR``; ``None`` if absent."""
    env = os.environ.get("GOODPUT_DATA_DIR")
    candidates = [Path(env)] if env else []
    root = Path(__file__).resolve().parents[1]
    candidates += [root.parent / "shared" / "data", root / "shared" / "data"]
    for path in candidates:
        if path.is_dir():
            return path
    return None


# ====================================================================== generic CSV


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError("must be finite and > 0")
    return value


def _nonnegative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError("must be finite and >= 0")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("must be finite")
    return value


def _nonempty_str(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text.strip()


def parse_placement(text: str) -> tuple[int, ...]:
    """``"1234"`` → ``(1, 2, 3, 4)``: GPUs per node; zeros (empty nodes) are dropped."""
    text = text.strip()
    if not text or not text.isdigit():
        raise ValueError("expected a digit string of GPUs per node, e.g. '22'")
    placement = tuple(int(c) for c in text if c != "0")
    if not placement:
        raise ValueError("places no GPU")
    return placement


PARSERS: dict[str, Callable[[str], Any]] = {
    "int+": _positive_int,
    "int0": _nonnegative_int,
    "float+": _positive_float,
    "float0": _nonnegative_float,
    "float": _finite_float,
    "placement": parse_placement,
    "str": _nonempty_str,
}


def read_csv_rows(
    path: str | os.PathLike[str], schema: Mapping[str, str], optional: Mapping[str, str] | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_no, row)`` with each column parsed by its schema type.

    ``schema`` maps required columns to a parser name (``"int+"``, ``"float+"``,
    ``"float0"``, ``"placement"``, ``"str"`` …); ``optional`` columns may be
    absent from the header or empty in a row (then ``None``). A missing column,
    a short row or a bad value raises :class:`DataFormatError` with the line number.
    """
    path = Path(path)
    optional = dict(optional or {})
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise DataFormatError(path, 1, "header", "", "empty file") from None
        missing = [c for c in schema if c not in header]
        if missing:
            raise DataFormatError(path, 1, "header", header, f"missing column(s) {missing}")
        index = {name: header.index(name) for name in list(schema) + [c for c in optional if c in header]}
        for line_no, raw in enumerate(reader, start=2):
            if not raw or all(not cell.strip() for cell in raw):
                continue
            if len(raw) != len(header):
                raise DataFormatError(path, line_no, "row", raw, f"has {len(raw)} fields, header has {len(header)}")
            row: dict[str, Any] = {}
            for name, col in index.items():
                cell = raw[col].strip()
                kind = schema.get(name) or optional[name]
                if name in optional and not cell:
                    row[name] = None
                    continue
                try:
                    row[name] = PARSERS[kind](cell)
                except (ValueError, TypeError) as exc:
                    raise DataFormatError(path, line_no, name, cell, str(exc) or f"expected {kind}") from None
            yield line_no, row


def _observation(path: Path, line_no: int | None, **values: Any) -> Observation:
    try:
        return Observation(**values)
    except ValidationError as exc:
        raise DataFormatError(path, line_no, exc.field, exc.value, exc.reason) from None


# ====================================================================== Pollux


def read_placements(
    path: str | os.PathLike[str], job: str, gpu_type: str, source: str = "trace:placements"
) -> list[Observation]:
    """Observations from a placements CSV (``placement,local_bsz,step_time,sync_time``)."""
    path = Path(path)
    schema = {"placement": "placement", "local_bsz": "int+", "step_time": "float+", "sync_time": "float0"}
    out = []
    for line_no, row in read_csv_rows(path, schema):
        placement = row["placement"]
        out.append(
            _observation(
                path,
                line_no,
                job=job,
                gpu_type=gpu_type,
                num_nodes=len(placement),
                num_replicas=sum(placement),
                placement=placement,
                local_bsz=row["local_bsz"],
                step_time=row["step_time"],
                sync_time=row["sync_time"],
                source=source,
            )
        )
    return out


def read_scalability(
    path: str | os.PathLike[str], job: str, gpu_type: str, source: str = "trace:scalability"
) -> list[Observation]:
    """Observations from a scalability CSV (``num_nodes,num_replicas,local_bsz,step_time,sync_time``)."""
    path = Path(path)
    schema = {"num_nodes": "int+", "num_replicas": "int+", "local_bsz": "int+", "step_time": "float+", "sync_time": "float0"}
    return [
        _observation(path, line_no, job=job, gpu_type=gpu_type, source=source, **row)
        for line_no, row in read_csv_rows(path, schema)
    ]


@dataclass(frozen=True)
class ValidationRow:
    """One epoch of a Pollux validation trace."""

    progress: float  # scale-invariant iterations completed
    iteration: int
    metric: float
    grad_sqr: float  # |g|² (0 where the estimate vanished late in training)
    grad_var: float  # tr(Σ)/M0


def read_validation(path: str | os.PathLike[str]) -> list[ValidationRow]:
    """Rows of a validation CSV (``progress,iteration,metric,grad_sqr,grad_var``)."""
    schema = {"progress": "float0", "iteration": "int0", "metric": "float", "grad_sqr": "float0", "grad_var": "float0"}
    return [ValidationRow(**row) for _, row in read_csv_rows(path, schema)]


def read_pollux_trace(trace_dir: str | os.PathLike[str], gpu_type: str = "t4", job: str | None = None) -> Profile:
    """A model's placements and scalability traces as one :class:`Profile`.

    ``job`` defaults to the directory name (``cifar10``, ``bert`` …).
    """
    trace_dir = Path(trace_dir)
    job = job or trace_dir.name
    observations: list[Observation] = []
    for name, reader in (("placements.csv", read_placements), ("scalability.csv", read_scalability)):
        path = trace_dir / name
        if path.exists():
            observations.extend(reader(path, job, gpu_type))
    if not observations:
        raise FileNotFoundError(f"no placements.csv or scalability.csv in {trace_dir}")
    return Profile(observations, job=job, metadata={"source": str(trace_dir)})


# ====================================================================== Gavel

_GAVEL_KEY = re.compile(r"^(?P<model>.+?)(?: \(batch size (?P<batch>\d+)\))?$")


@dataclass
class GavelData:
    """Observations read from a Gavel throughputs file, and the entries left out."""

    observations: list[Observation]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (entry, reason)


def _gavel_job(model: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")


def read_gavel_throughputs(
    path: str | os.PathLike[str],
    gpu_types: list[str] | None = None,
    include_unconsolidated: bool = True,
) -> GavelData:
    """Observations from Gavel's ``simulation_throughputs.json`` / ``physical_cluster_throughputs.json``.

    Gavel reports steps/s of a job of ``scale_factor`` workers, each at batch
    size B, summed over the workers (ResNet-50 at B=32 on V100: 7.8 steps/s on
    1 GPU, 24.1 on 8). So ``local_bsz = B``, ``num_replicas = scale_factor``
    and the seconds of one synchronised step are ``scale_factor / steps_per_s``.
    ``<type>`` entries are consolidated on one server (``num_nodes = 1``);
    ``<type>_unconsolidated`` entries are spread across servers, read here as
    one GPU per node (``num_nodes = scale_factor``), which is an assumption:
    the artifact does not say how many servers they spanned.

    Entries of 0.0 (infeasible, e.g. out of memory) and models without a batch
    size (A3C, CycleGAN) are returned in ``skipped``. Only isolated
    throughputs (the ``"null"`` entry) are read, not co-location pairs.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataFormatError(path, exc.lineno, "json", exc.msg, "not valid JSON") from None
    if not isinstance(data, Mapping):
        raise DataFormatError(path, None, "root", type(data).__name__, "expected an object keyed by GPU type")
    wanted = {t.lower() for t in gpu_types} if gpu_types else None
    result = GavelData([])
    for type_key, entries in data.items():
        unconsolidated = type_key.endswith("_unconsolidated")
        gpu_type = type_key.removesuffix("_unconsolidated").lower()
        if (wanted is not None and gpu_type not in wanted) or (unconsolidated and not include_unconsolidated):
            continue
        if not isinstance(entries, Mapping):
            raise DataFormatError(path, None, type_key, type(entries).__name__, "expected an object of jobs")
        for key, value in entries.items():
            try:
                name, scale = ast.literal_eval(key)
                scale = int(scale)
                steps_per_s = float(value["null"])
            except (ValueError, SyntaxError, TypeError, KeyError):
                raise DataFormatError(path, None, f"{type_key}[{key!r}]", value, "expected ('<model>', scale) -> {'null': steps/s}") from None
            match = _GAVEL_KEY.match(name)
            if match is None or match.group("batch") is None:
                result.skipped.append((f"{type_key}:{key}", "no batch size in the job name"))
                continue
            if steps_per_s <= 0:
                result.skipped.append((f"{type_key}:{key}", "0.0 = infeasible (e.g. out of memory)"))
                continue
            if unconsolidated and scale == 1:
                continue  # identical to the consolidated 1-GPU entry
            result.observations.append(
                _observation(
                    path,
                    None,
                    job=_gavel_job(match.group("model")),
                    gpu_type=gpu_type,
                    num_nodes=scale if unconsolidated else 1,
                    num_replicas=scale,
                    local_bsz=int(match.group("batch")),
                    step_time=scale / steps_per_s,
                    source=f"gavel:{path.name}",
                )
            )
    return result
