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
  In both, ``sync_time`` may be absent or empty (not measured), and extra
  columns are ignored.
* **validation CSV** (Pollux): ``progress,iteration,metric,grad_sqr,grad_var`` per epoch.
* **Gavel throughputs JSON** (Narayanan et al., OSDI'20 artifact): steps/s of
  ``'<model> (batch size B)'`` on 1/2/4/8 GPUs per GPU type.
* **Zeus power traces** (You et al., NSDI'23 artifact): seconds per epoch of
  six workloads on one GPU per type, across batch sizes and power limits.
* **Measurement directories** (:func:`read_measurements`): ``<model>/placements-<gpu_type>.csv``
  (and ``scalability-<gpu_type>.csv``) per model and GPU type; Pollux's own
  ``<model>/placements.csv``; a Gavel or Zeus folder; or JSON Lines profiles.
"""

from __future__ import annotations

import ast
import csv
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from goodput.errors import DataFormatError, ValidationError
from goodput.io import not_utf8, read_json
from goodput.observations import Observation, Profile

__all__ = [
    "read_csv_rows",
    "read_placements",
    "read_scalability",
    "read_validation",
    "read_pollux_trace",
    "table_files",
    "gpu_slug",
    "read_gavel_throughputs",
    "GavelData",
    "parse_placement",
    "default_data_dir",
    "read_zeus",
    "ZeusData",
    "ZEUS_DATASET_SIZES",
    "read_measurements",
    "read_model_tables",
    "Measurements",
    "read_model_sizes",
    "KNOWN_SIZES_DIR",
    "ModelSizes",
    "resolve_model_sizes",
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


def _integer(text: str) -> int:
    """``"32"`` → 32; also ``"32.0"``, as spreadsheets and pandas write integers beside missing values."""
    try:
        return int(text)
    except ValueError:
        value = float(text)
        if not value.is_integer():
            raise ValueError("must be an integer") from None
        return int(value)


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def _nonnegative_int(text: str) -> int:
    value = _integer(text)
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
    text = text.strip().removesuffix(".0")  # "22.0": the digit string written as a number
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
    path: str | os.PathLike[str],
    schema: Mapping[str, str],
    optional: Mapping[str, str] | None = None,
    *,
    skip: Callable[[Mapping[str, str]], str | None] | None = None,
    skipped: list[tuple[str, str]] | None = None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_no, row)`` with each column parsed by its schema type.

    ``schema`` maps required columns to a parser name (``"int+"``, ``"float+"``,
    ``"float0"``, ``"placement"``, ``"str"`` …); ``optional`` columns may be
    absent from the header or empty in a row (then ``None``). A missing column,
    a short row or a bad value raises :class:`DataFormatError` with the line number.

    ``skip`` sees a row's raw cells by column name before they are parsed and
    returns why the row is not a measurement (e.g. an infeasible marker), or
    ``None``; such rows are appended to ``skipped`` as ``("file:line", reason)``
    instead of being parsed. A UTF-8 byte-order mark before the header is ignored.
    """
    path = Path(path)
    optional = dict(optional or {})
    if skip is not None and skipped is None:
        raise TypeError("skip needs a skipped list to report the rows it leaves out")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
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
                if skip is not None:
                    reason = skip({name: raw[col].strip() for name, col in index.items()})
                    if reason is not None:
                        skipped.append((f"{path.name}:{line_no}", reason))
                        continue
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
                for name in optional:
                    row.setdefault(name, None)  # absent from the header
                yield line_no, row
    except UnicodeDecodeError as exc:
        raise not_utf8(path, exc) from None
    except csv.Error as exc:  # an unclosed quote that swallows the rest of the file, a NUL byte
        raise DataFormatError(path, getattr(reader, "line_num", None), "csv", str(exc)[:120], "not a CSV table") from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise not_utf8(path, exc) from None


def _observation(path: Path, line_no: int | None, **values: Any) -> Observation:
    try:
        return Observation(**values)
    except ValidationError as exc:
        raise DataFormatError(path, line_no, exc.field, exc.value, exc.reason) from None


# ====================================================================== Pollux


def _unmeasured_step(cells: Mapping[str, str]) -> str | None:
    """Why a row's ``step_time`` marks a configuration that was not measured, or ``None``.

    Empty cells, 0, NaN and infinity are how published tables mark infeasible
    configurations (Gavel writes 0.0 for out of memory). Negative or non-numeric
    values are not markers: they are left to the parser, which raises.
    """
    text = cells["step_time"]
    if not text:
        return "step_time empty: not measured"
    try:
        value = float(text)
    except ValueError:
        return None
    if value == 0 or value != value or value == float("inf"):
        return f"step_time={text}: infeasible or not measured"
    return None


def _timed_rows(
    path: Path, schema: dict[str, str], skipped: list[tuple[str, str]] | None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Rows of a step-time table; ``sync_time`` is optional (absent or empty: not measured).

    Strict when ``skipped`` is ``None`` (every value must be valid). Otherwise
    rows whose step time marks an unmeasured configuration are left out, and a
    ``sync_time`` above its ``step_time`` (sync is part of the step) is dropped
    from its row, each reported in ``skipped``.
    """
    rows = read_csv_rows(path, schema, {"sync_time": "float0", **{c: "str" for c in _LABEL_COLUMNS}},
                         skip=_unmeasured_step if skipped is not None else None, skipped=skipped)
    for line_no, row in rows:
        sync, step = row["sync_time"], row["step_time"]
        if skipped is not None and sync is not None and sync > step:
            skipped.append((f"{path.name}:{line_no}", f"sync_time={sync} > step_time={step}: sync_time not used"))
            row["sync_time"] = None
        yield line_no, row


# Columns that would label a row's GPU type or model. The format takes both from the file's place
# (<model>/placements-<gpu_type>.csv), one type and one model per file: a table holding several types or
# models in such a column had been read as one, every row under the file's type. A column with one value
# throughout (a device's full name, say) is left alone.
_LABEL_COLUMNS = ("gpu_type", "gpu", "model", "job")


def _check_labels(path: Path, line_no: int, row: dict[str, Any], first: dict[str, tuple[int, str]]) -> None:
    """Refuse a row whose ``gpu_type``/``gpu``/``model``/``job`` cell (:data:`_LABEL_COLUMNS`) differs from the
    file's first such cell (``first``: column → its line and value); drop those cells from ``row``."""
    for column in _LABEL_COLUMNS:
        value = row.pop(column, None)
        if value is None:
            continue
        seen = first.setdefault(column, (line_no, value))
        same = gpu_slug(value) == gpu_slug(seen[1]) if column.startswith("gpu") else value.strip().lower() == seen[1].strip().lower()
        if not same:
            raise DataFormatError(path, line_no, column, value, f"differs from line {seen[0]}'s {seen[1]!r}: one GPU type and "
                                  "one model per file (<model>/placements-<gpu_type>.csv, the type from the name)")


def read_placements(
    path: str | os.PathLike[str], job: str, gpu_type: str, source: str = "trace:placements",
    skipped: list[tuple[str, str]] | None = None,
) -> list[Observation]:
    """Observations from a placements CSV (``placement,local_bsz,step_time[,sync_time]``).

    With a ``skipped`` list, unmeasured rows are left out and reported there
    instead of raising (see :func:`_timed_rows`).
    """
    path = Path(path)
    schema = {"placement": "placement", "local_bsz": "int+", "step_time": "float+"}
    out = []
    labels: dict[str, tuple[int, str]] = {}
    for line_no, row in _timed_rows(path, schema, skipped):
        _check_labels(path, line_no, row, labels)
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
    path: str | os.PathLike[str], job: str, gpu_type: str, source: str = "trace:scalability",
    skipped: list[tuple[str, str]] | None = None,
) -> list[Observation]:
    """Observations from a scalability CSV (``num_nodes,num_replicas,local_bsz,step_time[,sync_time]``).

    With a ``skipped`` list, unmeasured rows are left out and reported there
    instead of raising (see :func:`_timed_rows`).
    """
    path = Path(path)
    schema = {"num_nodes": "int+", "num_replicas": "int+", "local_bsz": "int+", "step_time": "float+"}
    out, labels = [], {}
    for line_no, row in _timed_rows(path, schema, skipped):
        _check_labels(path, line_no, row, labels)
        out.append(_observation(path, line_no, job=job, gpu_type=gpu_type, source=source, **row))
    return out


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
    data = read_json(path)
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


# ====================================================================== Zeus

# Training samples per epoch of Zeus's six workloads (You et al., "Zeus: Understanding and
# Optimizing GPU Energy Consumption of DNN Training", NSDI'23, Table 3 datasets), from the
# datasets' own papers. Step time = time_per_epoch × batch_size / samples: the size is one
# constant per workload, so the APE of step time equals the APE of epoch time, and a wrong
# size would change no error figure (only the absolute seconds).
ZEUS_DATASET_SIZES: dict[str, int] = {
    "cifar100": 50_000,  # CIFAR-100 training images (Krizhevsky, 2009)
    "imagenet": 1_281_167,  # ILSVRC-2012 training images (Russakovsky et al., IJCV 2015)
    "librispeech": 281_241,  # LibriSpeech train-960 utterances (Panayotov et al., ICASSP 2015)
    "movielens-1m": 1_000_209,  # MovieLens-1M ratings (Harper & Konstan, TiiS 2015); nominal for NCF's sampled epochs
    "squad": 87_599,  # SQuAD v1.1 training questions (Rajpurkar et al., EMNLP 2016)
    "sentiment140": 1_600_000,  # Sentiment140 training tweets (Go et al., 2009); nominal if Zeus subsampled
}

_ZEUS_FILE = re.compile(r"^summary_power_(?P<gpu>[A-Za-z0-9_.-]+)\.csv$")


@dataclass
class ZeusData:
    """Observations read from Zeus's power traces and the choices made (power limit, optimizer per workload)."""

    observations: list[Observation]
    choices: dict[str, dict[str, Any]] = field(default_factory=dict)  # job -> {optimizer, power_limit per type}


def read_zeus(zeus_dir: str | os.PathLike[str]) -> ZeusData:
    """1-GPU step times from Zeus's ``summary_power_<gpu>.csv`` files.

    One configuration per workload and GPU type: the **largest power limit**
    listed for that type (the GPU's default, unthrottled limit) and **one
    optimizer** per workload, the one measured on the most GPU types (ties: by
    name; e.g. cifar100/shufflenetv2 has Adadelta on all four types and Adam on
    V100 only, so Adadelta). ``step_time = time_per_epoch × batch_size /
    ZEUS_DATASET_SIZES[dataset]`` seconds; ``local_bsz = batch_size`` on 1 GPU.
    The job is ``<dataset>-<network>``.
    """
    zeus_dir = Path(zeus_dir)
    files = sorted(p for p in zeus_dir.glob("summary_power_*.csv") if _ZEUS_FILE.match(p.name))
    if not files:
        raise FileNotFoundError(f"no summary_power_<gpu>.csv in {zeus_dir}")
    schema = {"dataset": "str", "network": "str", "batch_size": "int+", "optimizer": "str", "power_limit": "float+",
              "time_per_epoch": "float+"}
    rows: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for path in files:
        gpu = _ZEUS_FILE.match(path.name).group("gpu").lower()
        rows[gpu] = list(read_csv_rows(path, schema, optional={"average_power": "float0"}))
    optimizers: dict[str, dict[str, set[str]]] = {}
    for gpu, items in rows.items():
        for _, row in items:
            job = f"{row['dataset'].lower()}-{row['network'].lower()}"
            optimizers.setdefault(job, {}).setdefault(row["optimizer"].lower(), set()).add(gpu)
    chosen = {job: sorted(opts, key=lambda o: (-len(opts[o]), o))[0] for job, opts in optimizers.items()}
    result = ZeusData([], {job: {"optimizer": opt, "power_limit": {}} for job, opt in chosen.items()})
    for path, (gpu, items) in zip(files, rows.items()):
        limits: dict[str, float] = {}
        for _, row in items:
            job = f"{row['dataset'].lower()}-{row['network'].lower()}"
            if row["optimizer"].lower() == chosen[job]:
                limits[job] = max(limits.get(job, 0.0), row["power_limit"])
        for line_no, row in items:
            job = f"{row['dataset'].lower()}-{row['network'].lower()}"
            if row["optimizer"].lower() != chosen[job] or row["power_limit"] != limits[job]:
                continue
            size = ZEUS_DATASET_SIZES.get(row["dataset"].lower())
            if size is None:
                raise DataFormatError(path, line_no, "dataset", row["dataset"], f"no dataset size known (have {sorted(ZEUS_DATASET_SIZES)})")
            result.choices[job]["power_limit"][gpu] = limits[job]
            result.observations.append(
                _observation(path, line_no, job=job, gpu_type=gpu, num_nodes=1, num_replicas=1, local_bsz=row["batch_size"],
                             step_time=row["time_per_epoch"] * row["batch_size"] / size, source=f"zeus:{path.name}")
            )
    return result


# ====================================================================== measurement directories

_TYPED_FILE = re.compile(r"^(?P<kind>placements|scalability)(?:-(?P<gpu>.+))?\.(?i:csv)$")


def _csv_files(folder: Path) -> list[Path]:
    """The CSV files of a folder, sorted by name, whatever the case of their suffix (``.csv``, ``.CSV``)."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() == ".csv")


@dataclass
class Measurements:
    """Observations per model read from a directory, and what the reader assumed or left out."""

    kind: str  # "placements", "gavel", "zeus" or "profiles"
    models: dict[str, list[Observation]]
    notes: list[str] = field(default_factory=list)
    sizes: dict[str, float] = field(default_factory=dict)  # trainable parameters per model, where the data say


def gpu_slug(text: str) -> str:
    """A GPU type name as table file names give it: ``"RTX 6000"`` and ``"RTX_6000"`` → ``"rtx-6000"`` (runs of
    anything but letters, digits and '.' are one '-')."""
    return re.sub(r"[^a-z0-9.]+", "-", text.strip().lower()).strip("-")


_gpu_slug = gpu_slug


def read_measurements(path: str | os.PathLike[str], default_gpu_type: str = "t4") -> Measurements:
    """Observations per model from any supported layout (see the module docstring).

    * ``<model>/placements-<gpu_type>.csv`` and ``<model>/scalability-<gpu_type>.csv``
      (several GPU types per model; a model may lack a type); files without a
      type suffix (Pollux's artifact) are read as ``default_gpu_type``;
      ``validation-*.csv`` files are not step times and are left out (noted).
      Tables directly in ``path`` are one model named after the directory.
      Rows that mark unmeasured configurations (empty, 0 or NaN step time) are
      left out and a ``sync_time`` above its step time is not used; both are
      counted in the notes, with their lines. Exact copies of a row are read
      once, a ``gpu_type``/``model`` column must hold one value throughout a
      file, a sub-folder with no such table is named, and so are types that
      differ only in separators (``rtx6000``, ``rtx-6000``).
    * a folder holding ``simulation_throughputs.json`` (Gavel) or
      ``summary_power_<gpu>.csv`` (Zeus);
    * JSON Lines profiles (``*.jsonl``), grouped by job.
    """
    root = Path(path)
    if root.is_file() and root.suffix == ".jsonl":
        return _read_profiles([root])
    if not root.is_dir():
        raise FileNotFoundError(f"no such directory: {root}")
    if (root / "simulation_throughputs.json").exists():
        data = read_gavel_throughputs(root / "simulation_throughputs.json")
        models: dict[str, list[Observation]] = {}
        for o in data.observations:
            models.setdefault(o.job, []).append(o)
        notes = [f"gavel: {len(data.skipped)} entries left out (infeasible or no batch size)",
                 "gavel: *_unconsolidated entries read as one GPU per node (num_nodes = GPUs)"]
        return _some("gavel", models, notes, root / "simulation_throughputs.json")
    if any(root.glob("summary_power_*.csv")):
        zeus = read_zeus(root)
        models = {}
        for o in zeus.observations:
            models.setdefault(o.job, []).append(o)
        notes = [f"zeus: {job}: optimizer {c['optimizer']}, power limit {c['power_limit']}" for job, c in sorted(zeus.choices.items())]
        return _some("zeus", models, notes, root)
    profiles = sorted(root.glob("*.jsonl"))
    if profiles:
        return _read_profiles(profiles)
    models = {}
    notes: list[str] = []
    # <root>/<model>/placements-<type>.csv; tables directly in <root> are one model, named after it
    holds_tables = any(_TYPED_FILE.match(p.name) for p in _csv_files(root))
    for model_dir in [root] * holds_tables + sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        name = model_dir.resolve().name if model_dir == root else model_dir.name
        observations = read_model_tables(model_dir, name, default_gpu_type, notes)
        if not observations and any(_TYPED_FILE.match(p.name) for p in _csv_files(model_dir)):
            notes.append(f"{name}: no measured rows in its tables, left out")
        elif not observations:  # a folder the reader found nothing in had been dropped without a word
            held = sorted(p.name + "/" * p.is_dir() for p in model_dir.iterdir() if not p.name.startswith("."))
            shown = ", ".join(held[:5]) + (f" (and {len(held) - 5} more)" if len(held) > 5 else "")
            notes.append(f"{name}/: no placements[-<gpu_type>].csv or scalability[-<gpu_type>].csv in it, left out "
                         f"(it holds: {shown or 'nothing'})")
        if observations:
            if name in models:
                raise DataFormatError(model_dir, None, "model", name, "tables both in the directory and in a sub-folder of that name")
            models[name] = observations
    if not models:
        raise FileNotFoundError(f"no <model>/placements-<gpu_type>.csv, Gavel, Zeus or *.jsonl data in {root}")
    spellings: dict[str, set[str]] = {}
    for observations in models.values():
        for o in observations:
            spellings.setdefault(o.gpu_type.replace("-", ""), set()).add(o.gpu_type)
    for names in spellings.values():  # "RTX6000" and "RTX 6000" in two folders are two types to the model
        if len(names) > 1:
            notes.append(f"GPU types {', '.join(sorted(names))} differ only in separators: read as {len(names)} types "
                         "(name their files alike to make them one)")
    return Measurements("placements", models, notes)


def _some(kind: str, models: dict[str, list[Observation]], notes: list[str], where: Path) -> Measurements:
    """The measurements read, or a FileNotFoundError when the data hold none (every format alike)."""
    if not models:
        raise FileNotFoundError(f"no measurements in {where} ({kind} data without a usable row)")
    return Measurements(kind, models, notes)


def table_files(model_dir: str | os.PathLike[str], default_gpu_type: str = "t4") -> list[tuple[Path, str, str, bool]]:
    """A model folder's step-time tables: ``(path, kind, gpu_type, typed)`` per ``placements[-<gpu_type>].csv``
    or ``scalability[-<gpu_type>].csv``, sorted by name; ``kind`` is ``"placements"`` or ``"scalability"``, the
    GPU type the slug of the name's suffix (``placements-RTX 6000.csv`` → ``rtx-6000``), else
    ``default_gpu_type`` with ``typed`` False."""
    out = []
    for csv_path in _csv_files(Path(model_dir)):
        match = _TYPED_FILE.match(csv_path.name)
        if match is not None:
            gpu = match.group("gpu")
            out.append((csv_path, match.group("kind"), _gpu_slug(gpu) if gpu else _gpu_slug(default_gpu_type), bool(gpu)))
    return out


def read_model_tables(model_dir: str | os.PathLike[str], model: str, default_gpu_type: str = "t4",
                      notes: list[str] | None = None, *, strict: bool = False) -> list[Observation]:
    """One model's ``placements[-<gpu_type>].csv`` and ``scalability[-<gpu_type>].csv`` tables in ``model_dir``.

    A file's GPU type is the slug of its name's suffix (``placements-RTX 6000.csv`` → ``rtx-6000``), or
    ``default_gpu_type`` without one. What was assumed or left out goes to ``notes``: other CSV files
    (``validation-*.csv`` silently), a file without a type, and, unless ``strict``, the rows whose step
    time is empty, 0 or NaN (:func:`read_placements`' ``skipped``). ``strict`` raises
    :class:`~goodput.errors.DataFormatError` on the first such row instead.
    """
    model_dir = Path(model_dir)
    notes = [] if notes is None else notes
    default_gpu = _gpu_slug(default_gpu_type)
    observations: list[Observation] = []
    seen: dict[tuple[Any, ...], str] = {}  # each row's values -> the file it was first read from
    for other in sorted(p for p in model_dir.iterdir() if p.is_file() and p.suffix.lower() != ".csv"
                        and not p.name.startswith(".") and p.name != "model-sizes.json"):
        if other.name.lower().startswith(("placements", "scalability")):  # e.g. placements-a100.csv.gz
            notes.append(f"{model}/{other.name}: not a plain .csv table, left out")
    for csv_path in _csv_files(model_dir):
        where = f"{model}/{csv_path.name}"
        match = _TYPED_FILE.match(csv_path.name)
        if match is None:
            if not csv_path.name.startswith("validation"):
                notes.append(f"{where}: not a placements/scalability file, left out")
            continue
        gpu = _gpu_slug(match.group("gpu")) if match.group("gpu") else default_gpu
        if not match.group("gpu"):
            notes.append(f"{where}: no GPU type in the name, read as {gpu!r}")
        reader = read_placements if match.group("kind") == "placements" else read_scalability
        skipped: list[tuple[str, str]] | None = None if strict else []
        read = reader(csv_path, model, gpu, source=f"{match.group('kind')}:{csv_path.name}", skipped=skipped)
        repeated = []
        for observation in read:  # an exact copy of a row is one measurement (copies had counted as repeats)
            key = (observation.gpu_type, observation.placement, observation.num_nodes, observation.num_replicas,
                   observation.local_bsz, observation.accum_steps, observation.step_time, observation.sync_time)
            if key in seen:
                repeated.append(seen[key])
            else:
                seen[key] = csv_path.name
                observations.append(observation)
        if repeated:
            first = ", ".join(sorted(set(repeated)))
            notes.append(f"{where}: {len(repeated)} row(s) exact copies of rows read before (in {first}: same "
                         "configuration, step and sync time), each read once")
        if not read and not skipped:
            notes.append(f"{where}: no rows")
        if skipped:
            first = "; ".join(f"line {entry.rsplit(':', 1)[1]}: {reason}" for entry, reason in skipped[:3])
            more = f" (and {len(skipped) - 3} more)" if len(skipped) > 3 else ""
            notes.append(f"{where}: {len(skipped)} row(s) not used as read: {first}{more}")
    return observations


def _read_profiles(paths: list[Path]) -> Measurements:
    models: dict[str, list[Observation]] = {}
    sizes: dict[str, float] = {}
    for path in paths:
        profile = Profile.load(path)
        for o in profile.observations:
            models.setdefault(o.job, []).append(o)
        for job in profile.jobs:  # each job's own settings where the file holds several (Profile.job_meta)
            own = profile.select(job=job) if profile.job_meta else profile
            size = _parameter_count((own.metadata or {}).get("num_parameters"))  # recorded by profile_job
            if size is not None and own.job == job:
                sizes[job] = size
    if not models:
        raise FileNotFoundError(f"no measurements in {', '.join(map(str, paths))} (profiles without an observation)")
    return Measurements("profiles", models, [f"profiles: {len(paths)} file(s)"], sizes)


def read_model_sizes(path: str | os.PathLike[str]) -> dict[str, float]:
    """Trainable parameter counts per model from a JSON file, for ``goodput accuracy --model-sizes``.

    The file maps each model's name to its count, either a number or an object
    with ``num_parameters`` (and anything else, e.g. a ``source`` saying where
    the count comes from)::

        {"bert": {"num_parameters": 108893186, "source": "bert-base-uncased, SQuAD head"},
         "cifar10": 11173962}

    Raises:
        DataFormatError: not a JSON object, or a count that is not a positive number (names the model).
    """
    path = Path(path)
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise DataFormatError(path, exc.lineno, "model sizes", exc.msg, "not valid JSON") from exc
    if not isinstance(data, dict) or not data:
        raise DataFormatError(path, None, "model sizes", type(data).__name__, "expected a JSON object {model: num_parameters}")
    sizes: dict[str, float] = {}
    for name, entry in data.items():
        value = entry.get("num_parameters") if isinstance(entry, dict) else entry
        count = _parameter_count(value)
        if count is None:
            raise DataFormatError(path, None, f"{name}.num_parameters", value, "expected a positive number of parameters")
        sizes[str(name)] = count
    return sizes


KNOWN_SIZES_DIR = Path(__file__).resolve().parent / "data" / "model-sizes"
SIZES_FILE_NAME = "model-sizes.json"  # a data directory's own counts, read by ``--model-sizes auto``
KNOWN_SIZES_MIN_MATCHES = 2  # models a bundled file must share with the data (a lone name could be another network)


@dataclass(frozen=True)
class ModelSizes:
    """Trainable parameter counts per model, and where they come from (for the notes and settings)."""

    sizes: dict[str, float]
    source: str  # "none", "auto: <file>", "<file>", "given", ...


def resolve_model_sizes(spec: str | os.PathLike[str] | Mapping[str, float] | None, data_dir: str | os.PathLike[str],
                        models: Sequence[str]) -> ModelSizes:
    """The parameter counts ``goodput accuracy --model-sizes SPEC`` uses for ``models`` of ``data_dir``.

    * ``"auto"`` (the default): ``data_dir/model-sizes.json`` if it exists, else the bundled
      file of :data:`KNOWN_SIZES_DIR` (counts of published models, with their sources) that
      names most of ``models``, if it names at least :data:`KNOWN_SIZES_MIN_MATCHES` of them;
      else none. Names match exactly, then ignoring case.
    * ``"none"`` or ``None``: none (profiles' own ``num_parameters`` still count).
    * a path: that file (:func:`read_model_sizes`); a mapping: those counts.

    Counts for models that are not in ``models`` are kept (the notes list them).
    """
    if spec is None or spec == "none":
        return ModelSizes({}, "none")
    if isinstance(spec, Mapping):
        return ModelSizes(dict(spec), "given")
    if spec == "auto":
        own = Path(data_dir) / SIZES_FILE_NAME
        if own.is_file():
            return ModelSizes(_matched(read_model_sizes(own), models), f"auto: {own}")
        best: tuple[int, str, dict[str, float]] = (0, "", {})
        for path in sorted(KNOWN_SIZES_DIR.glob("*.json")):
            matched = {name: count for name, count in _matched(read_model_sizes(path), models).items() if name in models}
            if len(matched) > best[0]:
                best = (len(matched), f"auto: bundled {path.name}", matched)
        if best[0] >= KNOWN_SIZES_MIN_MATCHES:
            return ModelSizes(best[2], best[1])
        return ModelSizes({}, f"auto: none (no {SIZES_FILE_NAME} in the data, no bundled file names {KNOWN_SIZES_MIN_MATCHES}+ of its models)")
    return ModelSizes(read_model_sizes(spec), str(spec))


def _matched(sizes: Mapping[str, float], models: Sequence[str]) -> dict[str, float]:
    """``sizes`` renamed to ``models``' spelling where a name matches only ignoring case."""
    by_lower = {m.lower(): m for m in models}
    return {(name if name in models else by_lower.get(name.lower(), name)): count for name, count in sizes.items()}


def _parameter_count(value: Any) -> float | None:
    """``value`` as a parameter count (a positive finite number, not a bool), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)
