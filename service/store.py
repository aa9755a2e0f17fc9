"""The service's durable store: jobs and their observations, in any SQLAlchemy database.

Observations are the source of truth: a job's model is a function of them, and
the service rebuilds every model from the store when it starts. Three tables:

- ``goodput_jobs`` — one row per job: its settings as JSON (``init_batch_size``,
  ``max_batch_size``, ``local_bsz_bounds``, ``gpu_types``), created/updated times;
- ``goodput_observations`` — one row per observation: the job, a ``record_id``,
  the record as JSON (:meth:`goodput.Observation.to_dict`), the time it was
  received. ``(job, record_id)`` is unique, which makes posting idempotent: a
  record sent twice is stored once. The id is the one the sender gave, else
  the SHA-256 of the record's canonical JSON (:func:`record_id`). The
  auto-increment ``id`` gives the order of arrival;
- ``goodput_cluster_priors`` — the last cluster prior the service learned from
  them (``goodput serve --learn-prior``): its JSON
  (:meth:`goodput.ClusterPrior.to_dict`), what it was learned from and the
  store's :meth:`Store.change_stamp` then. Derived state, recomputable from the
  other two; kept so a restarted service answers with it from the start.

Durability. :meth:`Store.add_observations` returns only after its transaction
has committed. The default store is ``sqlite:///goodput.db`` in the working
directory, in WAL mode with ``synchronous=FULL``: every commit waits for an
``fsync`` of the write-ahead log, so a commit survives a kill -9 of the server
and also a power cut or kernel crash (as far as the disk honours ``fsync``).
``synchronous=NORMAL`` (``Store(url, sqlite_synchronous="NORMAL")``) would
still survive a kill -9 (the WAL is in the OS's page cache) but could lose the
last commits on a power cut; FULL costs one ``fsync`` per POST, which the
service's batches make cheap (``experiments/bench_service.py``). PostgreSQL
(``postgresql+psycopg://user@host/db``, the ``postgres`` extra) commits
durably with its defaults (``synchronous_commit=on``).

Writes are serialised within the process (SQLite allows one writer; it also
keeps the ``id`` order equal to the commit order, which the registry's
watermark relies on), and grouped: POSTs that arrive while a commit is under
way are written together in the next transaction, so concurrent senders share
one ``fsync`` (each still answered only after its records are committed). One server process per store: two servers on one
PostgreSQL database would each hold models of only what they received.

No pickle: records are JSON text.

Example::

    store = Store("sqlite:///goodput.db")
    store.put_job("cifar10", {"init_batch_size": 128})
    added = store.add_observations("cifar10", [(record_id(rec), rec) for rec in records])
    added.inserted, added.total
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

from goodput.errors import ValidationError
from goodput.io import try_lock_file

__all__ = ["Store", "StoreBusyError", "sqlite_file", "JobRecord", "StoredObservation", "StoredPrior", "AddResult", "UnknownJobError", "record_id",
           "canonical_json", "SQLITE_SYNCHRONOUS"]

log = logging.getLogger("goodput.service")

_SERVER_LOCK_KEY = 0x676F6F64707574  # "goodput": PostgreSQL's advisory lock of the store's one server


class StoreBusyError(ValidationError):
    """Another server process holds the store (:meth:`Store.claim`)."""


@dataclass
class _Descriptor:
    """A held lock file's descriptor, closed as a connection is (:meth:`Store.close`)."""

    fd: int

    def close(self) -> None:
        os.close(self.fd)


def sqlite_file(url: Any) -> Path | None:
    """The file of a SQLite URL (``sqlite:///goodput.db``, ``…?timeout=5``, ``sqlite:///file:x.db?uri=true``),
    ``None`` for an in-memory database."""
    try:
        parsed = sa.engine.make_url(url)
    except sa.exc.ArgumentError as exc:
        raise ValidationError("store", str(url), f"not a SQLAlchemy URL ({exc})") from None
    database = parsed.database or ""
    if parsed.query.get("mode") == "memory" or database in ("", ":memory:"):
        return None
    if database.startswith("file:"):  # a SQLite URI filename (uri=true): file:PATH[?query]
        database = database[len("file:"):].split("?", 1)[0]
        if database in ("", ":memory:"):
            return None
    return Path(database)


SQLITE_SYNCHRONOUS = ("FULL", "NORMAL", "EXTRA")
MAX_NAME = 128  # job names and record ids, characters

metadata = sa.MetaData()
jobs_table = sa.Table(
    "goodput_jobs", metadata,
    sa.Column("name", sa.String(MAX_NAME), primary_key=True),
    sa.Column("settings", sa.Text, nullable=False),
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("updated", sa.Float, nullable=False),
)
observations_table = sa.Table(
    "goodput_observations", metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("job", sa.String(MAX_NAME), nullable=False),
    sa.Column("record_id", sa.String(MAX_NAME), nullable=False),
    sa.Column("data", sa.Text, nullable=False),
    sa.Column("received", sa.Float, nullable=False),
    sa.UniqueConstraint("job", "record_id", name="uq_goodput_observation_record"),
    sa.Index("ix_goodput_observation_job_id", "job", "id"),
)
priors_table = sa.Table(
    "goodput_cluster_priors", metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("data", sa.Text, nullable=False),
    sa.Column("info", sa.Text, nullable=False),
    sa.Column("learned", sa.Float, nullable=False),
)


@dataclass(frozen=True)
class StoredPrior:
    """A cluster prior as stored: its JSON (:meth:`goodput.ClusterPrior.to_dict`), what the service said of
    it (jobs, cells, seconds, the :meth:`Store.change_stamp` it was learned at) and when (Unix seconds)."""

    data: dict[str, Any]
    info: dict[str, Any]
    learned: float


class UnknownJobError(ValidationError):
    """A job the store does not hold (register it first: ``PUT /v1/jobs/{job}``)."""

    def __init__(self, job: str) -> None:
        super().__init__("job", job, "unknown job: register it first (PUT /v1/jobs/{job})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.value,), self.__dict__)


def canonical_json(record: Mapping[str, Any]) -> str:
    """The record as compact JSON with sorted keys (what :func:`record_id` hashes)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False)


def record_id(record: Mapping[str, Any]) -> str:
    """The id of a record sent without one: ``sha256:`` + the SHA-256 of its canonical JSON."""
    return "sha256:" + hashlib.sha256(canonical_json(record).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class JobRecord:
    """A registered job: its settings (JSON-ready) and when it was created and last changed (Unix seconds)."""

    name: str
    settings: dict[str, Any]
    created: float
    updated: float
    changed: bool = False  # set by put_job: whether the settings differ from the stored ones


@dataclass(frozen=True)
class StoredObservation:
    """One stored record: its row id (order of arrival), record id, the record, when it was received."""

    row_id: int
    record_id: str
    data: dict[str, Any]
    received: float


@dataclass(frozen=True)
class AddResult:
    """What :meth:`Store.add_observations` stored: ``(row_id, record_id)`` of each new record, and the job's total."""

    inserted: list[tuple[int, str]]
    total: int

    @property
    def accepted(self) -> int:
        return len(self.inserted)


@dataclass(eq=False)
class _Request:
    """One caller's records waiting for a (group) commit, and what became of them."""

    job: str
    records: dict[str, str]
    after_commit: Callable[[list[tuple[int, str]]], None] | None
    inserted: list[tuple[int, str]] = field(default_factory=list)
    result: AddResult | None = None
    error: BaseException | None = None
    done: bool = False


class Store:
    """Jobs and observations in a SQLAlchemy database (see the module docstring).

    Args:
        url: any SQLAlchemy URL; ``sqlite:///goodput.db`` (relative to the working directory) by default.
        sqlite_synchronous: SQLite's ``synchronous`` setting in WAL mode: ``"FULL"`` (default; durable
            across power cuts), ``"NORMAL"`` (durable across a killed process only) or ``"EXTRA"``.
        create: create the store's tables where they are missing (default). ``False`` for a reader
            (``goodput prior --store``): a database without them is refused, not changed (nor is a SQLite
            file's journal mode).
    """

    def __init__(self, url: str = "sqlite:///goodput.db", *, sqlite_synchronous: str = "FULL", create: bool = True) -> None:
        if not isinstance(url, str) or not url.strip():
            raise ValidationError("store", url, "expected a SQLAlchemy URL, e.g. sqlite:///goodput.db")
        try:
            parsed = sa.engine.make_url(url)
        except sa.exc.ArgumentError as exc:
            raise ValidationError("store", url, f"not a SQLAlchemy URL ({exc})") from None
        synchronous = str(sqlite_synchronous).upper()
        if synchronous not in SQLITE_SYNCHRONOUS:
            raise ValidationError("sqlite_synchronous", sqlite_synchronous, f"expected one of {SQLITE_SYNCHRONOUS}")
        self.url = parsed
        self.dialect = parsed.get_backend_name()
        options: dict[str, Any] = {}
        if self.dialect == "sqlite":
            if sqlite_file(parsed) is None:  # sqlite://, :memory:, file::memory:?uri=true, ?mode=memory
                raise ValidationError("store", url, "an in-memory SQLite store would lose everything; name a file")
            options["connect_args"] = {"timeout": 30.0}
        else:
            options.update(pool_pre_ping=True, pool_size=8, max_overflow=8)
        try:
            self.engine = sa.create_engine(parsed, **options)
        except (ImportError, sa.exc.NoSuchModuleError) as exc:
            raise ValidationError("store", url, f"no driver for it ({exc}); for PostgreSQL install the "
                                  "'postgres' extra: pip install 'goodput[postgres]'") from None
        if self.dialect == "sqlite":
            @event.listens_for(self.engine, "connect")
            def _pragmas(dbapi_connection: Any, _record: Any) -> None:
                cursor = dbapi_connection.cursor()
                if create:  # persistent in the file: a reader leaves it as it found it
                    cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute(f"PRAGMA synchronous={synchronous}")
                cursor.execute("PRAGMA busy_timeout=30000")
                cursor.close()
        self.sqlite_synchronous = synchronous if self.dialect == "sqlite" else None
        self._write_lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._queue: list[_Request] = []
        # observations stored per job, counted once and then advanced by this process's commits (one server per
        # store, claim()): a POST's total had been a count(*) over the job's history inside the write lock
        self._counts: dict[str, int] = {}
        self._claim: Any = None  # what holds the server's claim on the store (claim())
        try:
            if create:
                metadata.create_all(self.engine)
            else:
                needed = {jobs_table.name, observations_table.name}  # a store older than the priors' table is read
                missing = sorted(needed - set(sa.inspect(self.engine).get_table_names()))
                if missing:
                    self.engine.dispose()
                    raise ValidationError("store", self.url.render_as_string(hide_password=True),
                                          f"is not a goodput store (no {' or '.join(missing)} table)")
        except sa.exc.SQLAlchemyError as exc:  # a file that is no database, a folder that is missing, a server down
            self.engine.dispose()
            cause = getattr(exc, "orig", None) or exc  # the driver's error, without SQLAlchemy's statement
            raise ValidationError("store", self.url.render_as_string(hide_password=True),
                                  f"cannot be opened: {type(cause).__name__}: {str(cause).splitlines()[0]}") from None

    def __repr__(self) -> str:
        return f"Store({self.url.render_as_string(hide_password=True)!r})"

    def close(self) -> None:
        if self._claim is not None:
            self._claim.close()  # the lock file's descriptor, or PostgreSQL's session holding the advisory lock
            self._claim = None
        self.engine.dispose()

    def claim(self) -> None:
        """Hold this store for one server process until :meth:`close` (a second ``goodput serve`` on it would
        answer from models that miss the other's writes): a ``flock`` on ``<database>.server.lock`` for SQLite,
        a session-level advisory lock on PostgreSQL. Raises :class:`StoreBusyError` when another holds it;
        does nothing twice, or on other databases."""
        if self._claim is not None:
            return
        where = self.url.render_as_string(hide_password=True)
        if self.dialect == "sqlite":
            lock = Path(f"{sqlite_file(self.url)}.server.lock")
            fd = try_lock_file(lock)
            if fd is None:
                raise StoreBusyError("store", where, f"another goodput serve holds it ({lock} is locked)")
            self._claim = _Descriptor(fd)
        elif self.dialect == "postgresql":
            conn = self.engine.connect()
            if not conn.execute(sa.text("SELECT pg_try_advisory_lock(:key)"), {"key": _SERVER_LOCK_KEY}).scalar():
                conn.close()
                raise StoreBusyError("store", where, "another goodput serve holds it (its advisory lock is taken)")
            conn.commit()
            self._claim = conn

    # ------------------------------------------------------------------ jobs
    def put_job(self, name: str, settings: Mapping[str, Any]) -> JobRecord:
        """Register ``name`` or replace its settings; ``changed`` says whether they differ from the stored ones."""
        text = canonical_json(settings)
        now = time.time()
        with self._write_lock, self.engine.begin() as conn:
            row = conn.execute(sa.select(jobs_table).where(jobs_table.c.name == name)).first()
            if row is None:
                conn.execute(jobs_table.insert().values(name=name, settings=text, created=now, updated=now))
                return JobRecord(name, json.loads(text), now, now, changed=True)
            if row.settings == text:
                return JobRecord(name, json.loads(text), row.created, row.updated, changed=False)
            conn.execute(jobs_table.update().where(jobs_table.c.name == name).values(settings=text, updated=now))
            return JobRecord(name, json.loads(text), row.created, now, changed=True)

    def get_job(self, name: str) -> JobRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(jobs_table).where(jobs_table.c.name == name)).first()
        return None if row is None else JobRecord(row.name, json.loads(row.settings), row.created, row.updated)

    def jobs(self) -> list[JobRecord]:
        """Every registered job, by name."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(jobs_table).order_by(jobs_table.c.name)).all()
        return [JobRecord(r.name, json.loads(r.settings), r.created, r.updated) for r in rows]

    # ------------------------------------------------------------------ observations
    def add_observations(
        self,
        job: str,
        records: Sequence[tuple[str, Mapping[str, Any]]],
        *,
        after_commit: Callable[[list[tuple[int, str]]], None] | None = None,
    ) -> AddResult:
        """Store ``(record_id, record)`` pairs of ``job`` that are not stored yet; return after the commit.

        Records whose id is stored already (or repeated within ``records``) are skipped.
        ``after_commit(inserted)`` runs after the commit, still inside the store's write
        lock: anything it queues is ordered as the rows are.

        Group commit: requests that arrive while a commit is under way wait for it, and
        the first of them then writes all of them in one transaction (one ``fsync``); each
        still returns only once its records are committed.

        Raises:
            UnknownJobError: ``job`` is not registered.
        """
        unique: dict[str, str] = {}
        for rid, record in records:
            if rid not in unique:
                unique[rid] = json.dumps(record, separators=(",", ":"), allow_nan=False)
        request = _Request(job, unique, after_commit)
        with self._queue_lock:
            self._queue.append(request)
        with self._write_lock:
            if not request.done:  # nobody wrote it yet: write everything queued, this request's included
                with self._queue_lock:
                    group, self._queue = self._queue, []
                self._commit_group(group)
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def _commit_group(self, group: list[_Request]) -> None:
        """One transaction for the queued requests; each gets its result or its error. Holds the write lock."""
        now = time.time()
        try:
            with self.engine.begin() as conn:
                names = sorted({r.job for r in group})
                known = set(conn.execute(sa.select(jobs_table.c.name).where(jobs_table.c.name.in_(names))).scalars())
                rows, owner = [], {}
                for request in group:
                    if request.job not in known:
                        request.error = UnknownJobError(request.job)
                        continue
                    for rid, data in request.records.items():
                        if (request.job, rid) not in owner:  # the first request to send an id owns it
                            owner[(request.job, rid)] = request
                            rows.append({"job": request.job, "record_id": rid, "data": data, "received": now})
                for row_id, job, rid in (self._insert_new(conn, rows) if rows else []):
                    owner[(job, rid)].inserted.append((row_id, rid))
                uncounted = sorted((known & set(names)) - set(self._counts))
                counted = dict(conn.execute(  # the first write of each job in this process (its own rows included)
                    sa.select(observations_table.c.job, sa.func.count()).where(
                        observations_table.c.job.in_(uncounted)).group_by(observations_table.c.job)).all()) if uncounted else {}
        except Exception as exc:  # the transaction rolled back: nothing of the group is stored
            for request in group:
                request.error = request.error or exc
                request.done = True
            return
        for job in uncounted:
            self._counts[job] = int(counted.get(job, 0))
        for request in group:
            if request.error is None and request.job not in uncounted:
                self._counts[request.job] = self._counts.get(request.job, 0) + len(request.inserted)
        for request in group:
            request.done = True
            if request.error is not None:
                continue
            request.inserted.sort()
            request.result = AddResult(request.inserted, self._counts.get(request.job, 0))
            if request.after_commit is not None and request.inserted:
                try:
                    request.after_commit(request.inserted)
                except Exception:  # noqa: BLE001 - stored is stored; the caller's hook must not undo the answer
                    log.exception("goodput store: after_commit of job %r failed", request.job)

    def _insert_new(self, conn: sa.Connection, rows: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
        """Insert the rows whose (job, record_id) is not stored yet: ``(row id, job, record_id)`` of each inserted."""
        if self.dialect in ("sqlite", "postgresql"):
            if self.dialect == "sqlite":
                from sqlalchemy.dialects.sqlite import insert
            else:
                from sqlalchemy.dialects.postgresql import insert
            statement = (insert(observations_table)
                         .on_conflict_do_nothing(index_elements=["job", "record_id"])
                         .returning(observations_table.c.id, observations_table.c.job, observations_table.c.record_id))
            return [(int(r.id), r.job, r.record_id) for r in conn.execute(statement, rows)]
        # other databases: skip the ids stored already, insert the rest (writes are serialised in this process)
        out = []
        for job in sorted({row["job"] for row in rows}):
            mine = [row for row in rows if row["job"] == job]
            ids = [row["record_id"] for row in mine]
            stored = set()
            for start in range(0, len(ids), 500):
                stored.update(conn.execute(sa.select(observations_table.c.record_id).where(
                    observations_table.c.job == job, observations_table.c.record_id.in_(ids[start:start + 500]))).scalars())
            fresh = [row for row in mine if row["record_id"] not in stored]
            if not fresh:
                continue
            conn.execute(observations_table.insert(), fresh)
            new_ids = [row["record_id"] for row in fresh]
            for start in range(0, len(new_ids), 500):
                found = conn.execute(sa.select(observations_table.c.id, observations_table.c.record_id).where(
                    observations_table.c.job == job, observations_table.c.record_id.in_(new_ids[start:start + 500])))
                out += [(int(r.id), job, r.record_id) for r in found]
        return out

    def count(self, job: str) -> int:
        """Observations stored for ``job`` (kept by this process's writes once counted)."""
        known = self._counts.get(job)
        if known is not None:
            return known
        with self.engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(observations_table)
                                    .where(observations_table.c.job == job)).scalar_one())

    def observations(self, job: str, *, after: int = 0, limit: int | None = None) -> list[StoredObservation]:
        """``job``'s records with row id > ``after``, in order of arrival (at most ``limit``)."""
        return list(self.iter_observations(job, after=after, limit=limit))

    def iter_observations(self, job: str, *, after: int = 0, limit: int | None = None,
                          chunk: int = 5000) -> Iterator[StoredObservation]:
        """Like :meth:`observations`, read ``chunk`` rows at a time."""
        remaining = limit
        while remaining is None or remaining > 0:
            size = chunk if remaining is None else min(chunk, remaining)
            query = (sa.select(observations_table.c.id, observations_table.c.record_id, observations_table.c.data,
                               observations_table.c.received)
                     .where(observations_table.c.job == job, observations_table.c.id > after)
                     .order_by(observations_table.c.id).limit(size))
            with self.engine.connect() as conn:
                rows = conn.execute(query).all()
            for row in rows:
                yield StoredObservation(int(row.id), row.record_id, json.loads(row.data), float(row.received))
            if len(rows) < size:
                return
            after = int(rows[-1].id)
            if remaining is not None:
                remaining -= len(rows)

    def change_stamp(self) -> list[float]:
        """``[last observation row id, last settings change (Unix seconds)]``, 0 for none: equal stamps, no
        observation stored and no setting changed in between."""
        # under the write lock: a write is then either not committed or committed and handed to its
        # after_commit callback (the registry's queue), never in between
        with self._write_lock, self.engine.connect() as conn:
            row = conn.execute(sa.select(sa.func.max(observations_table.c.id))).scalar()
            updated = conn.execute(sa.select(sa.func.max(jobs_table.c.updated))).scalar()
        return [float(row or 0), float(updated or 0.0)]

    # ------------------------------------------------------------------ the learned cluster prior
    def save_prior(self, data: Mapping[str, Any], info: Mapping[str, Any]) -> None:
        """Keep ``data`` (a :meth:`goodput.ClusterPrior.to_dict`) and ``info`` as the last learned prior, in
        place of the one before (one transaction: a crash leaves the old one or the new one)."""
        text, info_text, now = json.dumps(data), canonical_json(info), time.time()  # as ClusterPrior.save writes it
        with self._write_lock, self.engine.begin() as conn:
            new = conn.execute(priors_table.insert().values(data=text, info=info_text, learned=now)).inserted_primary_key[0]
            conn.execute(priors_table.delete().where(priors_table.c.id < new))

    def latest_prior(self) -> StoredPrior | None:
        """The last prior :meth:`save_prior` kept, else ``None``."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(priors_table).order_by(priors_table.c.id.desc()).limit(1)).first()
        return None if row is None else StoredPrior(json.loads(row.data), json.loads(row.info), float(row.learned))

    def ping(self) -> None:
        """Raise if the database cannot be reached."""
        with self.engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
