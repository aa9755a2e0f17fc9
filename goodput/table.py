"""Goodput tables: one job's goodput on each (GPU type, nodes, GPUs) configuration.

A :class:`GoodputTable` is what a scheduler consumes. Its rows are usually
Sia's configuration set (:meth:`goodput.cluster.Cluster.configurations`); its
columns are::

    gpu_type, num_nodes, num_gpus, goodput            required
    batch_size, local_bsz, accum_steps, throughput,    when known
    efficiency, step_time, std, num_replicas
    normalized_goodput                                 derived

``num_replicas`` is given for a hybrid-parallel job (:mod:`goodput.hybrid`): the
data-parallel replicas, i.e. pipelines, of the row's GPUs, which must be a whole
multiple of them; without it a row's replicas are its GPUs.
``goodput`` is samples/s × statistical efficiency; 0 marks a configuration on
which no batch within the job's limits fits. ``std`` is the standard deviation
of goodput (same unit); goodput is log-normal and ``goodput`` its median, so
:meth:`GoodputTable.at_quantile` gives a cautious or an optimistic table.
``normalized_goodput`` divides the row by the job's smallest positive
goodput, so its minimum over feasible rows is 1 (Sia,
SOSP'23 §3.3: the normalized goodput matrix). Tables are written atomically as
CSV or JSON; :func:`save_tables` / :func:`load_tables` keep several jobs' tables
in one JSON file (the input of ``goodput allocate``, which also reads one table's JSON).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .errors import DataFormatError, ValidationError
from .io import atomic_write_text, not_utf8, read_json
from .lognormal import lognormal_log_std, lognormal_quantile
from .validation import check_quantile, check_str, is_collection, normalize_gpu_type

__all__ = ["GoodputTable", "save_tables", "load_tables"]

KEY_COLUMNS = ("gpu_type", "num_nodes", "num_gpus")
REQUIRED_COLUMNS = (*KEY_COLUMNS, "goodput")
OPTIONAL_COLUMNS = ("batch_size", "local_bsz", "accum_steps", "throughput", "efficiency", "step_time", "std",
                    "num_replicas")
_INT_COLUMNS = ("num_nodes", "num_gpus", "batch_size", "local_bsz", "accum_steps", "num_replicas")
_MAX_COUNT = 2.0**53  # largest integer a float64 holds exactly; larger counts would not survive validation
_TEXT_COLUMNS = ("job", "gpu_type", "missing_gpu_types")  # read from CSV as text: '007', '1e3', 'nan' are names


class GoodputTable:
    """One job's goodput per configuration.

    Args:
        job: the job's name.
        frame: a pandas DataFrame (or a list of row dicts) with at least
            ``gpu_type, num_nodes, num_gpus, goodput``.
        missing_gpu_types: GPU types the table could not cover (no
            observations yet); kept so that nothing is dropped silently.
        quantile: which quantile of each row's goodput distribution the
            ``goodput`` column holds: 0.5 (the median, as
            :meth:`goodput.JobModel.table` writes it) unless the table came
            from :meth:`at_quantile`. Saved with the table.

    Example::

        table = GoodputTable("cifar10", [
            {"gpu_type": "t4", "num_nodes": 1, "num_gpus": 1, "goodput": 410.0},
            {"gpu_type": "t4", "num_nodes": 1, "num_gpus": 2, "goodput": 760.0},
        ])
        table.normalized()          # 1.0, 1.85...
        table.to_csv("cifar10.csv")
    """

    def __init__(self, job: str, frame: Any, missing_gpu_types: Iterable[str] = (), quantile: float = 0.5) -> None:
        self.job = check_str("job", job)
        self.quantile = check_quantile("quantile", quantile)
        if not isinstance(frame, pd.DataFrame):
            try:
                rows = list(frame)
                frame = pd.DataFrame(rows, columns=_columns_of(rows))
            except TypeError:
                raise ValidationError("frame", frame, "expected a DataFrame or a list of row dicts") from None
        self._arrays = self._validated({column: frame[column] for column in frame.columns})
        self._frame_cache: pd.DataFrame | None = None
        self.missing_gpu_types = _missing_types(missing_gpu_types)

    @classmethod
    def from_columns(cls, job: str, columns: Mapping[str, Any], missing_gpu_types: Iterable[str] = (),
                     quantile: float = 0.5, like: GoodputTable | None = None, checked: bool = False) -> GoodputTable:
        """A table from ``{column: array}`` (same columns and checks as a DataFrame), without building
        a DataFrame until :attr:`frame` is read: what a scheduler making many tables per round wants.

        ``like``: a table whose configurations (``gpu_type, num_nodes, num_gpus``, in its order) this one
        has too; ``columns`` then holds the other columns only, and the configurations are not checked again.
        ``checked`` (with ``like``): the caller has checked the other columns already (numpy arrays of
        finite numbers >= 0, integers in the count columns; e.g. many tables' columns at once), so they are
        taken as they are.
        """
        table = object.__new__(cls)
        table.job = check_str("job", job)
        table.quantile = check_quantile("quantile", quantile)
        if not isinstance(columns, Mapping):
            raise ValidationError("columns", type(columns).__name__, "expected {column: array}")
        if like is not None:
            if not isinstance(like, GoodputTable):
                raise ValidationError("like", type(like).__name__, "expected a GoodputTable")
            given = [c for c in KEY_COLUMNS if c in columns]
            if given:
                raise ValidationError("columns", given, "come from `like`; give the other columns only")
            keys = {c: like._arrays[c] for c in KEY_COLUMNS}
            if checked:
                values = {c: np.asarray(v) for c, v in columns.items() if c != "normalized_goodput"}
                unknown = [c for c in values if c not in REQUIRED_COLUMNS + OPTIONAL_COLUMNS]
                if unknown or "goodput" not in values or any(v.shape != keys["num_nodes"].shape for v in values.values()):
                    raise ValidationError("columns", unknown or sorted(values), "do not fit `like`'s configurations")
                values["normalized_goodput"] = _normalize(values["goodput"])
                for array in values.values():
                    array.flags.writeable = False
                table._arrays = {**keys, **values}
            else:
                table._arrays = {**keys, **table._validated({**columns, **keys}, keys_checked=True)}
        elif checked:
            raise ValidationError("checked", checked, "needs `like` (a table with the same configurations)")
        else:
            table._arrays = table._validated(columns)
        table._frame_cache = None
        table.missing_gpu_types = _missing_types(missing_gpu_types)
        return table

    # ------------------------------------------------------------------ validation
    def _validated(self, source: Mapping[str, Any], keys_checked: bool = False) -> dict[str, np.ndarray]:
        """The checked, typed columns (with ``normalized_goodput``) as read-only numpy arrays.

        Schedulers build a table per job and round, so this is a hot path: columns
        already numeric skip pandas' coercion, and the DataFrame is built only when read.
        """
        names = list(source)
        missing = [c for c in REQUIRED_COLUMNS if c not in names]
        if missing:
            raise ValidationError("columns", names, f"missing required column(s) {missing}")
        unknown = [c for c in names if c not in REQUIRED_COLUMNS + OPTIONAL_COLUMNS + ("normalized_goodput",)]
        if unknown:
            raise ValidationError("columns", unknown, f"unknown column(s); known: {REQUIRED_COLUMNS + OPTIONAL_COLUMNS}")
        lengths = {len(source[c]) if np.ndim(source[c]) else None for c in names} - {None}
        if len(lengths) > 1:
            raise ValidationError("columns", {c: len(source[c]) for c in names if np.ndim(source[c])},
                                  "columns of different lengths")
        size = lengths.pop() if lengths else 0
        columns: dict[str, Any] = {}
        for column in names:
            if column == "normalized_goodput":
                continue
            series = source[column]
            if keys_checked and column in KEY_COLUMNS:
                columns[column] = series  # a validated table's configurations
                continue
            if column == "gpu_type":
                if isinstance(series, (pd.Series, np.ndarray)):
                    values = series.tolist()
                    values = values * size if np.ndim(series) == 0 else values
                else:
                    values = [series] * size if isinstance(series, str) or np.ndim(series) == 0 else list(series)
                columns[column] = np.array(_gpu_types(values, f"{self.job}: gpu_type"), dtype=object)
                continue
            if isinstance(series, np.ndarray) and series.ndim == 1 and series.dtype.kind in "iuf":
                pass  # numeric numpy column: checked below without pandas
            elif isinstance(series, (int, float, np.integer, np.floating)) and not isinstance(series, (bool, np.bool_)):
                series = np.full(size, series)  # one number for every row
            elif np.ndim(series) == 0:
                series = pd.Series([series] * size, dtype=object)
            elif not isinstance(series, pd.Series):
                series = pd.Series(list(series), dtype=object if not isinstance(series, np.ndarray) else None)
            if series.dtype.kind in "iuf":  # numeric already: no booleans, no text to coerce
                values = np.array(series, dtype=float)  # a copy: the caller's frame or array may change later
            else:
                _reject_booleans(f"{self.job}: {column}", series)
                # a 0-d array in a cell is its number (pandas' coercion had raised TypeError on it)
                series = series.map(lambda v: v.item() if isinstance(v, np.ndarray) and v.ndim == 0 else v)
                numeric = pd.to_numeric(series, errors="coerce")
                if numeric.dtype.kind == "c":  # to float, numpy would drop the imaginary part with a warning
                    row = int(np.argmax(np.asarray(numeric).imag != 0))
                    raise ValidationError(f"{self.job}: {column}[{row}]", _at(series, row), "must be a real number")
                values = numeric.to_numpy(dtype=float)
            bad = ~np.isfinite(values) | (values < 0)
            if column in ("num_nodes", "num_gpus"):
                bad |= values < 1
            if bad.any():
                row = int(np.flatnonzero(bad)[0])
                raise ValidationError(
                    f"{self.job}: {column}[{row}]", _at(series, row), "must be a finite number >= 0 (>= 1 for counts)"
                )
            if column in _INT_COLUMNS:
                if np.any(values > _MAX_COUNT):
                    row = int(np.flatnonzero(values > _MAX_COUNT)[0])
                    raise ValidationError(f"{self.job}: {column}[{row}]", _at(series, row),
                                          "too large: counts must be <= 2**53 (exact as a float)")
                if np.any(values != np.round(values)):
                    row = int(np.flatnonzero(values != np.round(values))[0])
                    raise ValidationError(f"{self.job}: {column}[{row}]", values[row], "must be an integer")
                columns[column] = values.astype(int)
            else:
                columns[column] = values
        nodes, gpus = columns["num_nodes"], columns["num_gpus"]
        if "num_replicas" in columns:
            replicas = columns["num_replicas"]
            partial = (replicas < 1) | (np.asarray(gpus) % np.maximum(replicas, 1) != 0)
            if partial.any():
                row = int(np.flatnonzero(partial)[0])
                raise ValidationError(f"{self.job}: num_replicas[{row}]", int(replicas[row]),
                                      f"must be >= 1 and divide num_gpus ({int(gpus[row])}): "
                                      "a replica is a whole pipeline of GPUs")
        if keys_checked:
            if len(nodes) != size:
                raise ValidationError("columns", size, f"rows, but `like` has {len(nodes)} configurations")
            columns = {c: columns[c] for c in names if c != "normalized_goodput"}
            columns["normalized_goodput"] = _normalize(columns["goodput"])
            for values in columns.values():
                values.flags.writeable = False
            return {c: v for c, v in columns.items() if c not in KEY_COLUMNS}
        over = nodes > gpus
        if over.any():
            row = int(np.flatnonzero(over)[0])
            raise ValidationError(f"{self.job}: num_nodes[{row}]", int(nodes[row]), "exceeds num_gpus")
        duplicate = _first_duplicate(columns["gpu_type"], nodes, gpus)
        if duplicate is not None:
            key = (columns["gpu_type"][duplicate], int(nodes[duplicate]), int(gpus[duplicate]))
            raise ValidationError(f"{self.job}: configuration", key, "appears twice")
        columns["normalized_goodput"] = _normalize(columns["goodput"])
        for values in columns.values():
            values.flags.writeable = False
        return columns

    # ------------------------------------------------------------------ access
    @property
    def _frame(self) -> pd.DataFrame:
        """The table as a DataFrame, built on first use (package-internal: do not modify it)."""
        if self._frame_cache is None:
            self._frame_cache = pd.DataFrame({c: (v.tolist() if c == "gpu_type" else v) for c, v in self._arrays.items()})
        return self._frame_cache

    def column_arrays(self) -> dict[str, np.ndarray]:
        """The columns as read-only numpy arrays (``gpu_type`` an object array of names).

        For schedulers that read many tables each round (:func:`goodput.allocate`): no pandas
        access per call.
        """
        return self._arrays

    @property
    def frame(self) -> pd.DataFrame:
        """A copy of the table as a DataFrame (with ``normalized_goodput``)."""
        return self._frame.copy()

    def __len__(self) -> int:
        return len(self._arrays["goodput"])

    def __repr__(self) -> str:
        at = "" if self.quantile == 0.5 else f", quantile={self.quantile:g}"
        return f"GoodputTable(job={self.job!r}, rows={len(self)}, gpu_types={self.gpu_types}{at})"

    @property
    def gpu_types(self) -> list[str]:
        return list(dict.fromkeys(self._arrays["gpu_type"].tolist()))

    def normalized(self) -> pd.Series:
        """Goodput divided by the job's smallest positive goodput (0 stays 0)."""
        return self._frame["normalized_goodput"].copy()

    def configurations(self) -> list[tuple[str, int, int]]:
        a = self._arrays
        return list(zip(a["gpu_type"].tolist(), a["num_nodes"].tolist(), a["num_gpus"].tolist()))

    def lookup(self, gpu_type: str, num_nodes: int, num_gpus: int) -> dict[str, Any] | None:
        """The row of one configuration as a dict, or ``None`` if the table lacks it."""
        gpu = normalize_gpu_type(gpu_type)
        f = self._frame
        match = f[(f["gpu_type"] == gpu) & (f["num_nodes"] == num_nodes) & (f["num_gpus"] == num_gpus)]
        if match.empty:
            return None
        return {k: _plain(v) for k, v in match.iloc[0].items()}

    def best(self) -> dict[str, Any] | None:
        """The row of highest goodput, or ``None`` if nothing is feasible."""
        f = self._frame
        if f.empty or not (f["goodput"] > 0).any():
            return None
        return {k: _plain(v) for k, v in f.loc[f["goodput"].idxmax()].items()}

    def at_quantile(self, q: float) -> GoodputTable:
        """The table with each row's goodput at its q-quantile: cautious below 0.5, optimistic above.

        ``goodput`` is the median of a log-normal whose standard deviation is
        ``std`` (:meth:`goodput.JobModel.table`; :mod:`goodput.lognormal`), so
        its q-quantile is ``goodput · e^{Φ⁻¹(q)·s}``. ``throughput`` moves by
        the same factor and ``step_time`` by its inverse; ``std``,
        ``efficiency`` and the batch columns stay. Rows without a ``std`` (or
        with ``std`` 0, e.g. measured tables) keep their goodput, and so does
        every row at q = 0.5. An allocator that reads the result prefers
        configurations it is sure of (q < 0.5) or those that may be better
        than their median (q > 0.5, exploration). The result records ``q`` in
        :attr:`quantile`.

        Args:
            q: the quantile, in (0, 1).

        Raises:
            ValidationError: ``q`` outside (0, 1), or a table that is not at
                its median already (moving it again would compound).

        Example::

            >>> t = GoodputTable("a", [{"gpu_type": "t4", "num_nodes": 1, "num_gpus": 1, "goodput": 100.0, "std": 10.075}])
            >>> round(t.at_quantile(0.05).lookup("t4", 1, 1)["goodput"], 1)
            84.8
        """
        q = check_quantile("q", q)
        if self.quantile != 0.5:
            raise ValidationError("quantile", self.quantile,
                                  f"{self.job}: the table is at a quantile already; move the median table (0.5) instead")
        arrays = dict(self._arrays)
        if "std" in arrays and q != 0.5:
            median = arrays["goodput"]
            factor = lognormal_quantile(1.0, lognormal_log_std(median, arrays["std"]), q)
            arrays["goodput"] = median * factor
            if "throughput" in arrays:
                arrays["throughput"] = arrays["throughput"] * factor
            if "step_time" in arrays:
                arrays["step_time"] = arrays["step_time"] / factor
            arrays["normalized_goodput"] = _normalize(arrays["goodput"])
            for values in arrays.values():
                values.flags.writeable = False
        # a positive finite factor keeps every validated value valid: no second validation (allocators call this each round)
        moved = object.__new__(GoodputTable)
        moved.job, moved._arrays, moved.missing_gpu_types, moved.quantile = self.job, arrays, self.missing_gpu_types, q
        moved._frame_cache = None
        return moved

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        rows = [{k: _plain(v) for k, v in row.items() if k != "normalized_goodput"} for row in self._frame.to_dict("records")]
        out: dict[str, Any] = {"job": self.job, "rows": rows}
        if self.missing_gpu_types:
            out["missing_gpu_types"] = list(self.missing_gpu_types)
        if self.quantile != 0.5:
            out["quantile"] = self.quantile
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GoodputTable:
        if not isinstance(data, Mapping) or "job" not in data or "rows" not in data:
            raise ValidationError("table", data, "expected {'job': ..., 'rows': [...]}")
        if not isinstance(data["rows"], list) or not all(isinstance(row, Mapping) for row in data["rows"]):
            raise ValidationError("rows", data["rows"], "expected a list of row mappings")
        return cls(data["job"], pd.DataFrame(list(data["rows"]), columns=_columns_of(data["rows"])),
                   data.get("missing_gpu_types", ()), data.get("quantile", 0.5))

    def to_json(self, path: str | os.PathLike[str]) -> Path:
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> GoodputTable:
        data = read_json(path)
        try:
            return cls.from_dict(data)
        except ValidationError as exc:
            raise DataFormatError(path, None, exc.field, exc.value, exc.reason) from None

    def to_csv(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`csv_text` atomically."""
        return atomic_write_text(path, self.csv_text())

    def csv_text(self, placeholder: bool = True) -> str:
        """CSV with a ``job`` column first (one table per file), then the row columns
        (``gpu_type,num_nodes,num_gpus,goodput,…``), then ``quantile`` when not 0.5 and
        ``missing_gpu_types`` (space-separated) when the table could not cover some types: the
        leading columns stay where a script reading them by position expects them. ``placeholder``: an empty
        table's file holds one row with the job's name alone, so that :meth:`from_csv` reads it back; a
        consumer that reads rows as configurations (``goodput table``'s output) wants the header alone."""
        frame = self._frame.drop(columns=["normalized_goodput"])
        frame.insert(0, "job", self.job)
        if frame.empty and placeholder:  # one row with only the job's name, so that an empty table reads back
            frame = pd.DataFrame([{"job": self.job}], columns=frame.columns)
        if self.quantile != 0.5:
            frame["quantile"] = self.quantile
        if self.missing_gpu_types:
            frame["missing_gpu_types"] = " ".join(self.missing_gpu_types)
        return frame.to_csv(index=False)

    @classmethod
    def from_csv(cls, path: str | os.PathLike[str]) -> GoodputTable:
        """Read a table written by :meth:`to_csv` (``job`` and ``gpu_type`` are read as text)."""
        try:
            frame = pd.read_csv(path, dtype={c: str for c in _TEXT_COLUMNS}, keep_default_na=False)
        except UnicodeDecodeError as exc:
            raise not_utf8(path, exc) from None
        except (pd.errors.ParserError, pd.errors.EmptyDataError) as exc:  # ragged rows, an empty file
            raise DataFormatError(path, None, "csv", str(exc)[:120], "not a table CSV") from None
        if "job" not in frame.columns:
            raise DataFormatError(path, None, "job", [], "expected one job per CSV")
        job = str(_one_per_csv(frame, "job", path))
        quantile = _one_per_csv(frame, "quantile", path, 0.5)
        missing = str(_one_per_csv(frame, "missing_gpu_types", path, "")).split()
        rows = frame.drop(columns=["job", "quantile", "missing_gpu_types"], errors="ignore")
        if len(rows) == 1 and (rows.iloc[0] == "").all():
            rows = rows.iloc[:0]  # only the job's name: an empty table (see to_csv)
        try:
            return cls(job, rows, missing, quantile=quantile)
        except ValidationError as exc:
            raise DataFormatError(path, None, exc.field, exc.value, exc.reason) from None


def _one_per_csv(frame: pd.DataFrame, column: str, path: Any, default: Any = None) -> Any:
    """The value a table's CSV repeats on every row of ``column`` (``default`` without the column)."""
    if column not in frame.columns:
        return default
    if frame[column].nunique() != 1:
        raise DataFormatError(path, None, column, list(frame[column]), f"expected one {column} per CSV")
    return frame[column].iloc[0]


def _missing_types(value: Any) -> tuple[str, ...]:
    if not is_collection(value):
        raise ValidationError("missing_gpu_types", value, "expected a list of GPU type names")
    return tuple(normalize_gpu_type(t, "missing_gpu_types") for t in value)


def _columns_of(rows: Iterable[Mapping[str, Any]]) -> list[str] | None:
    rows = list(rows)
    if rows:
        return None
    return list(REQUIRED_COLUMNS)


def _gpu_types(values: list[Any], field: str) -> list[str]:
    """The GPU type names, normalized (each distinct name checked once)."""
    names: dict[str, str] = {}
    for value in dict.fromkeys(v for v in values if type(v) is str):
        names[value] = normalize_gpu_type(value, field)
    if all(type(v) is str for v in values) and len(names) == len(set(values)) and all(k == v for k, v in names.items()):
        return values  # all plain, already normalized names (the usual case)
    out = []
    for value in values:
        name = names.get(value) if type(value) is str else None
        out.append(normalize_gpu_type(value, field) if name is None else name)  # raises for anything but a name
    return out


def _first_duplicate(types: np.ndarray, nodes: np.ndarray, gpus: np.ndarray) -> int | None:
    """The first row whose (gpu_type, num_nodes, num_gpus) an earlier row holds, or ``None``."""
    if len(types) < 2:
        return None
    codes: dict[str, int] = {}
    code = np.fromiter((codes.setdefault(t, len(codes)) for t in types), dtype=np.int64, count=len(types))
    columns = np.stack([code, np.asarray(nodes, dtype=np.int64), np.asarray(gpus, dtype=np.int64)])
    order = np.lexsort(columns[::-1])  # stable: equal configurations stay in row order
    ordered = columns[:, order]
    same = (ordered[:, 1:] == ordered[:, :-1]).all(axis=0)
    if not same.any():
        return None
    return int(order[1:][same].min())  # the earliest row that repeats an earlier one


def _at(column: Any, row: int) -> Any:
    """A column's value at a row (a Series or an array)."""
    return column.iloc[row] if isinstance(column, pd.Series) else column[row]


def _reject_booleans(field: str, column: pd.Series) -> None:
    """``True`` is not a count or a goodput (pandas would read it as 1)."""
    if column.dtype == bool or (column.dtype == object and any(isinstance(v, (bool, np.bool_)) for v in column)):
        row = int(np.flatnonzero([isinstance(v, (bool, np.bool_)) for v in column])[0])
        raise ValidationError(f"{field}[{row}]", column.iloc[row], "expected a number, not a boolean")


def _normalize(goodput: np.ndarray) -> np.ndarray:
    positive = goodput[goodput > 0]
    if positive.size == 0:
        return np.zeros_like(goodput, dtype=float)
    with np.errstate(over="ignore"):  # a subnormal smallest goodput: the ratio held at the largest float, not inf
        ratio = np.minimum(goodput / positive.min(), np.finfo(float).max)
    return np.where(goodput > 0, ratio, 0.0)


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    return value


def save_tables(tables: Mapping[str, GoodputTable] | Iterable[GoodputTable], path: str | os.PathLike[str]) -> Path:
    """Write several jobs' tables to one JSON file, atomically.

    Raises:
        ValidationError: a value that is not a table, two tables of one job, or a mapping's key that is
            not its table's job (:func:`load_tables` keys tables by job: such a file would not read back).
    """
    if not is_collection(tables):
        raise ValidationError("tables", tables, "expected GoodputTables, or a mapping job -> GoodputTable")
    pairs = list(tables.items()) if isinstance(tables, Mapping) else [(None, t) for t in tables]
    items, seen = [], set()
    for key, item in pairs:
        if not isinstance(item, GoodputTable):
            raise ValidationError("tables", item, "expected GoodputTable values")
        if key is not None and key != item.job:
            raise ValidationError(f"tables[{key!r}]", item.job, "a table's key must be its job")
        if item.job in seen:
            raise ValidationError("tables", item.job, "two tables of one job")
        seen.add(item.job)
        items.append(item)
    payload = {"tables": [t.to_dict() for t in items]}
    return atomic_write_text(path, json.dumps(payload, indent=2, allow_nan=False) + "\n")


def load_tables(path: str | os.PathLike[str]) -> dict[str, GoodputTable]:
    """Read a file written by :func:`save_tables` (``{"tables": [...]}``), or one table's JSON as
    :meth:`GoodputTable.to_json` writes it (``goodput fit --out``): ``{job: GoodputTable}``."""
    data = read_json(path)
    if isinstance(data, Mapping) and "tables" not in data and "job" in data and "rows" in data:
        try:
            table = GoodputTable.from_dict(data)
        except ValidationError as exc:
            raise DataFormatError(path, None, exc.field, exc.value, exc.reason) from None
        return {table.job: table}
    if not isinstance(data, Mapping) or not isinstance(data.get("tables"), list):
        raise DataFormatError(path, None, "tables", type(data).__name__,
                              "expected {'tables': [...]} (save_tables) or one table {'job': ..., 'rows': [...]}")
    out: dict[str, GoodputTable] = {}
    for index, entry in enumerate(data["tables"]):
        try:
            table = GoodputTable.from_dict(entry)
        except ValidationError as exc:
            raise DataFormatError(path, None, f"tables[{index}].{exc.field}", exc.value, exc.reason) from None
        if table.job in out:
            raise DataFormatError(path, None, f"tables[{index}].job", table.job, "appears twice")
        out[table.job] = table
    return out

