"""Every job's model, kept current by one background worker; queries read published snapshots.

Concurrency (``JobModel`` is not thread-safe, and a refit takes up to seconds):

- The **worker thread** owns a private working model per job. It builds it from
  the store (at start-up, or after the job's settings change), conditions it on
  newly stored observations, lets it refit when its own policy says a refit is
  due (``JobModel.diagnostics`` runs a due refit; when it has nothing else to do it
  also refits a model that holds observations conditioned online since its last
  refit, so that a service at rest answers as a restarted one, which fits every
  stored observation afresh, does), then **publishes** a copy: an
  immutable :class:`Published` snapshot with a version number. The copy shares
  the (frozen) observations and the cluster prior; it still walks the job's
  history (about 2 ms at 1,000 observations, 7 ms at 10,000 and 100 ms at
  100,000 on the 2-core VM), and the models hold every stored observation of
  their job (about 0.5 KB each: 540 MB of memory at 1,000,000 observations).
- **Queries** read the job's current snapshot and never wait on a refit: they
  answer from the last published model. Each snapshot caches its answers
  (goodput per configuration, tables per cluster; the server's ``--cluster``
  table is computed by the worker after it publishes, once no update is
  waiting: while jobs keep reporting, the first query after a publish computes
  it, 16-55 ms measured for 20 jobs on 2 cores), and computes a missing
  one under the snapshot's own lock, so the model is never used by two threads at once.
- **Writes** go to the store first; once committed, the new rows are queued for
  the worker (inside the store's write lock, so the queue is in row order). A
  rebuild reads the store up to a row id (its watermark) and drops queued rows
  at or below it: nothing is counted twice and nothing is missed.

The **cluster prior** (what other jobs teach a job's model, :mod:`goodput.hierarchy`): a
given one (``goodput prior``'s file) serves every job without the job's own cells; with
``learn_prior`` it is learned from every job's working model when stored observations
or settings changed, at most once per ``prior_interval_s``: when nothing else waits, the worker
copies the jobs' observations to a child process (:mod:`.learner`) and goes on absorbing
observations while it learns; once the prior is back the worker adopts it and queues every job
for a **refresh**: the job takes the prior without its own cells (a refit
of the hierarchy, not of the cells), refits and is republished. The store keeps the last
learned prior (:meth:`Store.save_prior`): a restarted service rebuilds its jobs with it, and
learns a new one only if observations or settings changed since. Refreshes come after updates
with new observations, so a job that reports while the cluster's jobs are refreshed is not
kept waiting behind them (each takes a refit, ~0.2 s on 2 cores). The residual GP's
hyperprior and the sync shapes keep the job's own data: they pool every job's residuals and
shapes.

At start-up every job is queued for a rebuild and the service answers at once:
job records, observation counts and writes work immediately; a goodput, table
or allocation query for a job whose model is not built yet raises
:class:`NotReadyError` (HTTP 503 with ``Retry-After``) and moves that job to the
front of the rebuild queue. A failed rebuild or update (a bug, a record the
current code cannot read) is recorded in the job's status and the metrics; the
last good model keeps answering.

Example::

    registry = Registry(Store("sqlite:///goodput.db"), cluster=Cluster.parse("t4:6x4"))
    registry.start()
    registry.register("cifar10", {"init_batch_size": 128})
    registry.add("cifar10", observations, ids)
    registry.published("cifar10").goodput("t4", 1, 4)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from goodput import Allocation, Cluster, ClusterPrior, GoodputTable, JobAllocation, JobModel, JobSpec, Observation, allocate
from goodput.errors import ValidationError
from goodput.hybrid import Stages
from goodput.parametric import COORDS
from goodput.validation import check_float, check_int, normalize_gpu_type

from .learner import PriorLearner
from .metrics import Metrics
from .schemas import json_bytes, json_safe
from .store import AddResult, JobRecord, Store, UnknownJobError

__all__ = ["Registry", "Published", "NotReadyError", "build_model", "check_export_dir", "read_observations", "StoredObservations"]

log = logging.getLogger("goodput.service")

CACHE_LIMIT = 20_000  # cached answers per published model
# Clusters whose tables a published model caches (the server's --cluster is warmed first): any query may
# name a cluster, and a table over a large one is megabytes, so others beyond these are computed each time.
CACHED_CLUSTERS = 8
# Answers cached per such cluster: its table, and its JSON under each spelling of the query asked (the
# fast path reads the query as written: "t4:02x4" and " T4:2x4" are the cluster t4:2x4 too, and each
# spelling beyond these is computed each time, else respelling one cluster grew memory by 1 MB a query)
ANSWERS_PER_CLUSTER = 8
# A failed update (the store unreachable, say) is retried from the store after this many seconds, doubling
# each time it fails again up to the second figure; without it, a job with no model yet answered 503 until
# its next write.
FAILED_RETRY_S = (1.0, 60.0)


# A learned prior needs this many jobs with a parameter count (``model_size``; the reporter registers the model's
# trainable parameters): with sizes, a prior from one other job already beats the weak default (P1 and P3 median
# APE, Pollux's traces 16.5 and 10.3 against 35.4 and 20.3, Gavel 18.5 and 17.2 against 22.7 and 25.0); without
# them (each job's size read off its 1-GPU compute, goodput.cells.one_gpu_log_proxy), Gavel's P1 is worse
# than the weak default with 1, 2 or 3 other jobs (41.6 / 31.5 / 33.2 against 22.7; with all four, the harness's
# 28.3 against 27.0) and Pollux's better by the median, worse by the mean (python -m experiments.small_clusters;
# experiments/results/accuracy.md).
# A job without a size under a prior with them gets its size imputed, calibrated on theirs.
MIN_SIZED_JOBS = 2


class NotReadyError(Exception):
    """The job's model is not built yet (start-up or a settings change); retry shortly."""

    def __init__(self, job: str, done: int, total: int, error: str | None = None, what: str | None = None) -> None:
        self.job, self.done, self.total, self.error = job, done, total, error
        what = what or f"the model of job {job!r} is being rebuilt from the store ({done} of {total} jobs ready)"
        super().__init__(what if error is None else f"{what}; its last rebuild failed: {error}")


def build_model(job: str, settings: Mapping[str, Any], **options: Any) -> JobModel:
    """A fresh :class:`JobModel` of ``job`` with the stored ``settings`` (and model ``options``, e.g. ``bayesian``)."""
    bounds = settings.get("local_bsz_bounds")
    if isinstance(bounds, Mapping):
        bounds = {gpu: tuple(pair) for gpu, pair in bounds.items()}
    elif bounds is not None:
        bounds = tuple(bounds)
    return JobModel(job, settings["init_batch_size"], settings.get("max_batch_size"), bounds,
                    num_stages=settings.get("num_stages", 1), model_size=settings.get("model_size"), **options)


@dataclass
class StoredObservations:
    """A job's stored records read back as observations, in order: ``watermark`` is the last row read,
    ``unreadable`` counts the records this version cannot read (left out), ``first_unreadable`` says why."""

    observations: list[Observation]
    watermark: int = 0
    unreadable: int = 0
    first_unreadable: str | None = None


def read_observations(store: Store, job: str) -> StoredObservations:
    """Every stored record of ``job`` as an :class:`~goodput.Observation`, the unreadable ones counted and left out."""
    out = StoredObservations([])
    for row in store.iter_observations(job):
        try:
            out.observations.append(Observation.from_dict(row.data))
        except (ValidationError, TypeError) as exc:  # e.g. a field this version's Observation does not know
            out.unreadable += 1
            out.first_unreadable = out.first_unreadable or f"record {row.record_id}: {exc}"
        out.watermark = row.row_id
    return out


class Published:
    """An immutable snapshot of one job's model, with its answers cached.

    Attributes:
        job, version: the job and the snapshot's version (1, 2, … since the server started).
        observations: observations in the model.
        gpu_types: GPU types the model has seen.
        refits: the model's refits so far; refit_at: Unix time of the last of them (``None``: none yet);
        published_at: Unix time of this snapshot.
        diagnostics: ``JobModel.diagnostics`` (JSON-safe).
    """

    def __init__(self, job: str, version: int, model: JobModel, diagnostics: dict[str, Any], refits: int,
                 refit_at: float | None = None) -> None:
        self.job = job
        self.version = version
        self._model = model
        self.observations = len(model.observations)
        self.gpu_types = list(model.gpu_types)
        self.refits = refits
        self.refit_at = refit_at
        self.published_at = time.time()
        self.diagnostics = diagnostics
        self._cache: dict[Any, Any] = {}
        self._clusters: dict[str, int] = {}  # the clusters whose tables are cached (CACHED_CLUSTERS at most): answers of each
        self._lock = threading.RLock()  # an answer may be built from another (a table's JSON from the table)

    def cached(self, key: Any) -> Any:
        """A cached answer or ``None`` (lock-free: a dict read)."""
        return self._cache.get(key)

    def answer(self, key: Any, compute: Callable[[JobModel], Any], cluster: str | None = None, reserved: bool = False) -> Any:
        """The cached answer for ``key``, else ``compute(model)`` under the snapshot's lock, cached (an answer
        over ``cluster`` only while that cluster is among the :data:`CACHED_CLUSTERS` first asked for, and
        :data:`ANSWERS_PER_CLUSTER` answers over it at most; ``reserved``: the server's own answers, which the
        worker computes ahead, are kept whatever the queries before them asked)."""
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                hit = compute(self._model)
                if cluster is not None and not reserved:
                    answers = self._clusters.get(cluster)
                    if answers is None and len(self._clusters) >= CACHED_CLUSTERS or (answers or 0) >= ANSWERS_PER_CLUSTER:
                        return hit
                    self._clusters[cluster] = (answers or 0) + 1
                if len(self._cache) < CACHE_LIMIT:
                    self._cache[key] = hit
        return hit

    def stages(self, gpu_type: str) -> int:
        """GPUs per data-parallel replica on ``gpu_type`` (``JobModel.stages``; 1 unless hybrid-parallel)."""
        return self._model.stages(gpu_type)

    def goodput(self, gpu_type: str, num_nodes: int, num_gpus: int) -> dict[str, Any]:
        """The best configuration of an allocation (``JobModel.goodput``) as a JSON-ready dict."""
        gpu = normalize_gpu_type(gpu_type)
        return self.answer(("goodput", gpu, num_nodes, num_gpus), lambda m: _choice_dict(m.goodput(gpu, num_nodes, num_gpus=num_gpus), num_gpus))

    def table(self, cluster: Cluster, reserved: bool = False) -> GoodputTable:
        """The goodput table over ``cluster``'s configuration set (``JobModel.table``); ``reserved``: the
        server's own, kept whatever was asked before (:meth:`answer`)."""
        return self.answer(("table", str(cluster)), lambda m: m.table(cluster), str(cluster), reserved)

    def goodput_json(self, gpu_type: str, num_nodes: int, num_gpus: int) -> bytes:
        """The ``GET goodput`` answer's body, cached under the query as given (``gpu_type`` before normalising)."""
        return self.answer(("goodput-json", gpu_type, num_nodes, num_gpus), lambda _: json_bytes(
            {"job": self.job, **self.goodput(gpu_type, num_nodes, num_gpus), "model_version": self.version}))

    def table_json(self, cluster: Cluster, spec: str | None, reserved: bool = False) -> bytes:
        """The ``GET table`` answer's body, cached under the query's ``cluster`` as given (``None``: the server's)."""
        def encode(model: JobModel) -> bytes:
            data = self.table(cluster, reserved).to_dict()
            body = {"job": self.job, "cluster": str(cluster), "model_version": self.version,
                    "rows": data["rows"], "missing_gpu_types": data.get("missing_gpu_types", [])}
            if not data["rows"]:  # say why, as `goodput fit` does: a scheduler's log should not show a bare []
                body["reason"] = model.empty_table_reason(cluster)
            return json_bytes(body)

        return self.answer(("table-json", spec), encode, str(cluster), reserved)


def _unsettled(model: Any) -> bool:
    """Whether a model holds observations conditioned online since its last refit (:attr:`JobModel.unrefitted`)."""
    return bool(getattr(model, "unrefitted", 0))


def _choice_dict(choice: Any, num_gpus: int) -> dict[str, Any]:
    return {"gpu_type": choice.gpu_type, "num_nodes": choice.num_nodes, "num_gpus": num_gpus,
            "goodput": choice.goodput, "std": choice.std, "batch_size": choice.batch_size,
            "local_bsz": choice.local_bsz, "accum_steps": choice.accum_steps, "throughput": choice.throughput,
            "efficiency": choice.efficiency, "step_time": choice.step_time}


_ROW_KEYS = ("goodput", "std", "batch_size", "local_bsz", "accum_steps", "throughput", "efficiency", "step_time")


@dataclass
class _JobState:
    record: JobRecord
    published: Published | None = None
    state: str = "rebuilding"
    error: str | None = None
    unreadable: int = 0
    version: int = 0
    pending_types: set[str] = field(default_factory=set)  # GPU types stored but not in the published model yet
    failures: int = 0  # updates failed in a row (each retried after a doubling wait, FAILED_RETRY_S)


@dataclass
class _Working:
    """The worker's private model of one job and the last store row it holds."""

    model: JobModel
    watermark: int
    unreadable: int = 0
    first_unreadable: str | None = None
    refits_seen: int = 0
    refit_at: float | None = None
    pending: list[Observation] = field(default_factory=list)
    prior_version: int = 0  # the learned prior its model has (Registry._prior_version)


def check_export_dir(export_dir: str | Path | None, cluster: Cluster | None) -> Path | None:
    """``export_dir`` as a folder this server may write (made if missing), or ``None``; it needs a cluster.

    Raises:
        ValidationError: no cluster to tabulate, or a path that is a file or a folder it may not write
            (they fail at start-up, not per job).
    """
    if export_dir is None:
        return None
    if cluster is None:
        raise ValidationError("export_dir", str(export_dir), "needs a cluster (--cluster) to tabulate")
    path = Path(export_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValidationError("export_dir", str(export_dir), f"cannot be made a folder: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValidationError("export_dir", str(export_dir), "is not a folder this server may write")
    return path


class _SharedLock:
    """A lock many may hold shared, or one exclusive (a readers-writer lock; writers wait for the readers)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._exclusive)
            self._shared += 1
        try:
            yield
        finally:
            with self._condition:
                self._shared -= 1
                self._condition.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._exclusive and not self._shared)
            self._exclusive = True
        try:
            yield
        finally:
            with self._condition:
                self._exclusive = False
                self._condition.notify_all()


class Registry:
    """The jobs' published models and the worker that keeps them current (see the module docstring).

    Args:
        store: the durable store.
        cluster: the server's cluster: its table is computed at every publish (cached) and is the
            default of table and allocation queries that name none.
        export_dir: if given, ``<job>.csv`` there is rewritten (atomically) with the job's table over
            ``cluster`` at every publish: a file a Slurm ``job_submit`` plugin or a wrapper can read.
        metrics: the service's :class:`~service.metrics.Metrics`.
        model_options: passed to every :class:`JobModel` (e.g. ``{"bayesian": False}``).
        cluster_prior: what other jobs on the cluster teach a job's model
            (:class:`~goodput.hierarchy.ClusterPrior`, e.g. ``goodput prior``'s file): every job's
            model takes it, without the job's own cells when the prior holds them (its data would
            count twice), and the job's ``model_size`` setting places it on the prior's size slopes.
        learn_prior: the cluster prior is learned from the jobs' own stored observations
            (and ``model_size`` settings) whenever they changed, at most once per ``prior_interval_s``,
            started when nothing else waits and learned in a child process (:mod:`.learner`) while the
            worker goes on; every job's model then takes it (refitted, republished, after the jobs with
            new observations), and the store keeps it for a restart.
            A given ``cluster_prior`` serves until the first is learned; the first needs two jobs with
            observations and :data:`MIN_SIZED_JOBS` with a ``model_size`` setting.
        prior_jobs: a learned prior holds the ``prior_jobs`` jobs that reported last (a rolling window, as
            the simulator's: its cost grows with its jobs, about 0.5 s each on 2 cores, in the learning process); the others take it whole.
        coalesce_s: after an idle wait the worker waits this long for more observations before updating.
        min_interval_s: a job's model is updated at most once per this many seconds while observations
            stream in (rebuilds are not held back): the worker's CPU goes to requests during bursts.
        yield_s, max_defer_s: the worker starts no task while POSTs of observations arrive less than
            ``yield_s`` apart, for at most ``max_defer_s`` at a time (0: never wait).
    """

    def __init__(self, store: Store, *, cluster: Cluster | None = None, export_dir: str | Path | None = None,
                 metrics: Metrics | None = None, model_options: Mapping[str, Any] | None = None,
                 cluster_prior: ClusterPrior | None = None, learn_prior: bool = False,
                 prior_interval_s: float = 600.0, prior_jobs: int = 64, coalesce_s: float = 0.05, min_interval_s: float = 1.0, yield_s: float = 0.05,
                 max_defer_s: float = 2.0) -> None:
        self.store = store
        self.cluster = cluster
        self.export_dir = check_export_dir(export_dir, cluster)
        self.metrics = metrics or Metrics()
        self.model_options = dict(model_options or {})
        if "cluster_prior" in self.model_options:
            raise ValidationError("model_options.cluster_prior", "...", "is an argument of its own (cluster_prior=)")
        if cluster_prior is not None and not isinstance(cluster_prior, ClusterPrior):
            raise ValidationError("cluster_prior", cluster_prior, "expected a goodput.ClusterPrior")
        if not isinstance(learn_prior, bool):
            raise ValidationError("learn_prior", learn_prior, "expected True or False")
        if (cluster_prior is not None or learn_prior) and self.model_options.get("bayesian") is False:
            raise ValidationError("cluster_prior", "learn" if learn_prior else "given",
                                  "needs the Bayesian model (the plain Pollux fit takes no prior)")
        if cluster_prior is not None and len(cluster_prior):
            cluster_prior.fitted()  # here, not in a request thread
        self.cluster_prior = cluster_prior
        self.learn_prior = learn_prior
        self.prior_interval_s = check_float("prior_interval_s", prior_interval_s, nonnegative=True)
        self.prior_jobs = check_int("prior_jobs", prior_jobs, minimum=2)
        self._learned: ClusterPrior | None = None
        self._prior_version = 0  # learned priors so far; a working model behind it is due a refresh
        self._learner = PriorLearner() if learn_prior else None
        self._learning = False  # a learning was started and its result not adopted yet (under the lock)
        # back from the learner, to adopt: what the learning was started on (jobs, sized jobs, the store's change
        # stamp or None), the prior or None, the error or None, seconds
        self._learned_result: tuple[dict[str, Any], ClusterPrior | None, str | None, float] | None = None
        # observations stored and settings changed (under the lock); 1 at the start: the stored jobs teach one
        self._prior_changes = 1 if learn_prior else 0
        self._prior_seen = 0  # _prior_changes when the last prior was learned
        self._prior_at = -float("inf")  # time.monotonic() of the last learning
        self._prior_info: dict[str, Any] = ({"source": "given", "jobs": len(cluster_prior.jobs), "cells": len(cluster_prior)}
                                            if cluster_prior is not None
                                            else {"source": "none", "jobs": 0})
        build_model("options-check", {"init_batch_size": 1}, **self.model_options)  # a bad option fails now
        self.coalesce_s = coalesce_s
        self.min_interval_s = min_interval_s
        self.yield_s = yield_s
        self.max_defer_s = max_defer_s
        self._last_write = -float("inf")  # time.monotonic() of the last POST of observations
        self._updated: dict[str, float] = {}  # time.monotonic() of each job's last update (the worker's)
        self._retry: dict[str, float] = {}  # time.monotonic() when a job whose update failed is retried
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._jobs: dict[str, _JobState] = {}
        self._settings_locks: dict[str, _SharedLock] = {}  # per job: settings changes apart from writes checked against them
        self._pending: dict[str, list[tuple[int, Observation]]] = {}
        self._rebuild: dict[str, None] = {}  # ordered sets of job names
        self._dirty: dict[str, None] = {}
        self._warm: dict[str, None] = {}  # jobs whose new snapshot's server-cluster answers are not computed yet
        self._refresh: dict[str, None] = {}  # jobs due the new learned prior, no new observations
        # jobs whose published model holds observations conditioned online since its last refit: refitted when the
        # worker has nothing else to do, so that a service at rest answers as a restarted one (a fresh fit of every
        # stored observation) does; streamed, the two had differed by up to 13% (found in review)
        self._settle: dict[str, None] = {}
        self._working: dict[str, _Working] = {}  # the worker thread's alone
        self._busy: str | None = None
        self._rebuilding: str | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle
    def start(self) -> Registry:
        """Claim the store for this server (:meth:`Store.claim`: a second server on it is refused), queue every
        stored job for a rebuild and start the worker; returns at once."""
        self.store.claim()
        records = self.store.jobs()
        with self._lock:
            for record in records:
                self._jobs[record.name] = _JobState(record)
                self._rebuild[record.name] = None
            self._gauges()
        self._thread = threading.Thread(target=self._run, name="goodput-model-worker", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker (after the update it is in) and close the store."""
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        if self._learner is not None:
            self._learner.stop()  # a learning still running is ended, not waited for
        if self._thread is not None:
            self._thread.join(timeout)
        self.store.close()

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until the worker has nothing queued (tests, benchmarks, the demo; a failed update's later retry
        does not count); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if (not self._rebuild and not self._dirty and not self._warm and not self._refresh and not self._settle
                        and not self._learning and self._busy is None and not self._prior_due(time.monotonic())[0]):
                    return True
            time.sleep(0.01)
        return False

    # ------------------------------------------------------------------ writes
    def register(self, job: str, settings: Mapping[str, Any]) -> JobRecord:
        """Register ``job`` or change its settings (then its model is rebuilt; the old one answers meanwhile).

        Raises:
            ValidationError: a new ``num_stages`` that the job's stored observations contradict (stored
                observations are never removed, so its model could not be built again).
        """
        # no POST checked against the old settings commits meanwhile, and none after reads them: the record
        # the POSTs check against is replaced before the lock is let go
        with self.settings_lock(job).exclusive():
            self._check_stages(job, settings)
            record = self.store.put_job(job, settings)
            with self._lock:
                state = self._jobs.get(job)
                if state is None:
                    self._jobs[job] = _JobState(record)
                else:
                    state.record = record
                if record.changed or state is None:
                    self._prior_changes += 1
                    self._rebuild[job] = None
                    self._wake.notify_all()
                self._gauges()
        return record

    def settings_lock(self, job: str) -> _SharedLock:
        """The job's settings lock: writes that check observations against its settings (``num_stages``) hold it
        shared from the check to the commit, :meth:`register` holds it exclusive (else a POST checked against the
        old stages and a PUT of new ones both succeeded, and the job's model could never be built again)."""
        with self._lock:
            return self._settings_locks.setdefault(job, _SharedLock())

    def _check_stages(self, job: str, settings: Mapping[str, Any]) -> None:
        with self._lock:
            state = self._jobs.get(job)
        new = Stages.parse(settings.get("num_stages", 1))
        if state is None or new == Stages.parse(state.record.settings.get("num_stages", 1)):
            return
        for observation in read_observations(self.store, job).observations:
            if observation.num_stages != new.of(observation.gpu_type):
                raise ValidationError("num_stages", new.value,
                                      f"the job's stored observations on {observation.gpu_type} have num_stages "
                                      f"{observation.num_stages}, and stored observations are never removed: "
                                      "register the job under a new name")

    def add(self, job: str, observations: Sequence[Observation], ids: Sequence[str]) -> AddResult:
        """Store the observations durably (skipping ids stored already), then queue them for the model.

        An id repeated within ``ids`` keeps its first record, as the store does."""
        by_id: dict[str, Observation] = {}
        for rid, observation in zip(ids, observations):
            by_id.setdefault(rid, observation)
        self._last_write = time.monotonic()

        def queue(inserted: list[tuple[int, str]]) -> None:
            with self._lock:
                self._pending.setdefault(job, []).extend((row, by_id[rid]) for row, rid in inserted)
                state = self._jobs.get(job)
                if state is not None:  # types the published model lacks: a type it has answers from it meanwhile
                    modelled = set(state.published.gpu_types) if state.published is not None else set()
                    state.pending_types.update({by_id[rid].gpu_type for _, rid in inserted} - modelled)
                self._dirty[job] = None
                if inserted:
                    self._prior_changes += 1
                self._wake.notify_all()

        result = self.store.add_observations(job, [(rid, o.to_dict()) for rid, o in zip(ids, observations)],
                                             after_commit=queue)
        self._last_write = time.monotonic()
        self.metrics.stored.inc(result.accepted)
        self.metrics.duplicates.inc(len(by_id) - result.accepted + (len(ids) - len(by_id)))
        return result

    # ------------------------------------------------------------------ reads
    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)

    def record(self, job: str) -> JobRecord:
        with self._lock:
            state = self._jobs.get(job)
            if state is None:
                raise UnknownJobError(job)
            return state.record

    def published(self, job: str) -> Published:
        """The job's current snapshot.

        Raises:
            UnknownJobError: the job is not registered.
            NotReadyError: its model is not built yet (the job moves to the front of the rebuild queue).
        """
        with self._lock:
            state = self._jobs.get(job)
            if state is None:
                raise UnknownJobError(job)
            if state.published is not None:
                return state.published
            if job in self._rebuild and next(iter(self._rebuild)) != job:
                del self._rebuild[job]
                self._rebuild = {job: None, **self._rebuild}
            done = sum(s.published is not None for s in self._jobs.values())
            raise NotReadyError(job, done, len(self._jobs), state.error)

    def current(self, job: str) -> Published | None:
        """The job's published snapshot, or ``None`` (unknown job, or no model yet); no side effects."""
        state = self._jobs.get(job)  # a dict read: atomic, no lock needed on the hot path
        return None if state is None else state.published

    def not_ready_for(self, job: str, gpu_type: str) -> NotReadyError | None:
        """A :class:`NotReadyError` when ``gpu_type``'s first observations of ``job`` are stored but not modelled yet."""
        with self._lock:
            state = self._jobs.get(job)
            if state is None or gpu_type not in state.pending_types:
                return None
            done = sum(s.published is not None for s in self._jobs.values())
            return NotReadyError(job, done, len(self._jobs), state.error,
                                 what=f"the first observations of job {job!r} on {gpu_type} are being fitted")

    def prior_status(self) -> dict[str, Any]:
        """Where the jobs' cluster prior comes from (``none``, ``given``, ``learned``), its jobs and, once learned, when."""
        with self._lock:
            return {**self._prior_info, "learning": self.learn_prior}

    def prior_description(self) -> dict[str, Any] | None:
        """What the current cluster prior learned (:meth:`goodput.ClusterPrior.describe`: the spread of job and
        job × type effects, their correlations, the size slopes); ``None`` without one."""
        prior = self._current_prior()
        return None if prior is None or not len(prior) else prior.describe()  # fitted in the worker: no EM here

    def backlog(self) -> dict[str, Any]:
        """The worker's queue: jobs to rebuild, to update with new observations, whose answers to compute ahead,
        to refit under a newly learned cluster prior; whether a cluster prior is being learned, and whether
        observations or settings changed since the last one was started (``learn_prior`` only: it is due
        once ``prior_interval_s`` has passed)."""
        with self._lock:
            return {"rebuild": len(self._rebuild), "update": len(self._dirty), "warm": len(self._warm),
                    "refresh": len(self._refresh), "settle": len(self._settle), "busy": self._busy,
                    "learning_prior": self._learning,
                    "prior_behind": self.learn_prior and self._prior_changes != self._prior_seen,
                    "idle": not (self._rebuild or self._dirty or self._warm or self._refresh or self._settle or self._busy
                                 or self._learning)}

    def readiness(self) -> tuple[int, int]:
        """(jobs with a published model, registered jobs)."""
        with self._lock:
            return sum(s.published is not None for s in self._jobs.values()), len(self._jobs)

    def status(self, job: str) -> dict[str, Any]:
        """What ``GET /v1/jobs/{job}`` shows: settings, stored count, the published model's state and diagnostics."""
        with self._lock:
            state = self._jobs.get(job)
            if state is None:
                raise UnknownJobError(job)
            published, record = state.published, state.record
            rebuilding = job in self._rebuild or self._rebuilding == job
            model_state = "rebuilding" if rebuilding and state.state != "failed" else state.state
            error, unreadable = state.error, state.unreadable
        return {
            "job": job, "settings": record.settings, "created": record.created, "updated": record.updated,
            "observations": self.store.count(job),
            "gpu_types": published.gpu_types if published else [],
            "model": {"state": model_state, "version": published.version if published else 0,
                      "observations": published.observations if published else 0,
                      "refits": published.refits if published else 0,
                      "last_refit": published.refit_at if published else None,
                      "published_at": published.published_at if published else None,
                      "error": error, "unreadable": unreadable},
            "diagnostics": published.diagnostics if published else None,
        }

    def allocate(self, cluster: Cluster, jobs: Sequence[str] | None = None,
                 current: Mapping[str, Mapping[str, Any] | None] | None = None, policy: str = "sia", p: float = -0.5,
                 options: Mapping[str, Any] | None = None, specs: Mapping[str, Mapping[str, Any]] | None = None) -> Allocation:
        """One scheduling round (:func:`goodput.allocate`) over the jobs' published tables.

        ``jobs`` defaults to every job with observations stored; a job whose model is being built (its first
        observations on one of the cluster's types being fitted, or rebuilt at start-up) makes the round a
        :class:`NotReadyError` (503: asked again in a second or two), not a round that gives its GPUs away.
        ``specs``: per job, :class:`~goodput.JobSpec` fields (age, restarts, restart_cost, ...); each job's
        registered ``gpu_types`` limit it further, and a job none of whose types the cluster has is left
        unallocated with that reason.
        """
        options = dict(options or {})
        for reserved in ("policy", "jobs", "p", "current"):
            if reserved in options:
                raise ValidationError(f"options.{reserved}", options[reserved], "is a field of the request itself")
        given = {}
        for job, fields_ in (specs or {}).items():
            try:
                given[job] = JobSpec.from_dict(fields_)
            except ValidationError as exc:
                raise ValidationError(f"specs.{job}.{exc.field}", exc.value, exc.reason) from None
        if jobs is None:
            with self._lock:
                names = [j for j, s in self._jobs.items()
                         if (s.published is not None and s.published.observations) or s.pending_types]
        else:
            names = list(dict.fromkeys(jobs))
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ValidationError(f"specs.{unknown[0]}", unknown[0], "not a job of this round")
        tables, job_specs, left_out = {}, {}, {}
        for job in names:
            published = self.published(job)  # rebuilding: NotReadyError
            with self._lock:
                state = self._jobs.get(job)
                pending = set() if state is None or state.state == "failed" else set(state.pending_types)
            fitting = sorted(pending & set(cluster.gpu_types))
            if fitting:  # its first observations there are being fitted
                raise self.not_ready_for(job, fitting[0]) or NotReadyError(job, 0, 0, None)
            spec = given.get(job, JobSpec())
            allowed = self.record(job).settings.get("gpu_types")
            if allowed:
                usable = [t for t in allowed if t in cluster.gpu_types and (not spec.gpu_types or t in spec.gpu_types)]
                if not usable:
                    left_out[job] = f"none of its GPU types ({', '.join(allowed)}) is in this cluster ({cluster})"
                    continue
                spec = dataclasses.replace(spec, gpu_types=tuple(usable))
            try:
                tables[job] = published.table(cluster)
            except (ValueError, ArithmeticError) as exc:  # one job's model fails, not the round (LinAlgError is a ValueError)
                log.exception("goodput serve: job %r's table failed; the round leaves it out", job)
                left_out[job] = f"its goodput table failed: {exc}"
                continue
            if spec != JobSpec():
                job_specs[job] = spec
        last = {}
        for job, value in (current or {}).items():
            try:
                last[job] = None if value is None else JobAllocation.from_dict(value)
            except ValidationError as exc:
                raise ValidationError(f"current.{job}.{exc.field}", exc.value, exc.reason) from None
        try:
            result = allocate(tables, cluster, current=last, p=p, policy=policy, jobs=job_specs, **options)
        except ValidationError as exc:
            if exc.field in options:  # named as the request has it
                raise ValidationError(f"options.{exc.field}", exc.value, exc.reason) from None
            if exc.field.startswith("jobs[") and exc.field[5:].split("]", 1)[0] in given:
                job, rest = exc.field[5:].split("]", 1)
                raise ValidationError(f"specs.{job}{rest}", exc.value, exc.reason) from None
            raise
        if not left_out:
            return result
        return Allocation({**{j: result[j] for j in result}, **dict.fromkeys(left_out)}, {**result.unallocated, **left_out},
                          result.info, result.details)

    # ------------------------------------------------------------------ the worker
    def _gauges(self) -> None:
        self.metrics.jobs.set(len(self._jobs))
        self.metrics.rebuilding.set(sum(s.published is None for s in self._jobs.values()))

    def _due_retries(self, now: float) -> float:
        """Mark the failed jobs due a retry dirty (under the lock); seconds until the next one is due."""
        for job, due in list(self._retry.items()):
            if due <= now:
                del self._retry[job]
                self._dirty[job] = None
        return min((due - now for due in self._retry.values()), default=float("inf"))

    def _next_dirty(self) -> tuple[str | None, float]:
        """The first dirty job not updated within ``min_interval_s``, else (None, seconds until one is due)."""
        now = time.monotonic()
        wait = float("inf")
        for job in self._dirty:
            due = self._updated.get(job, -float("inf")) + self.min_interval_s
            if due <= now:
                return job, 0.0
            wait = min(wait, due - now)
        return None, wait

    def _next_task(self) -> tuple[str, str] | None:
        """Block until there is work: ``("rebuild" | "update" | "warm" | "refresh" | "settle", job)``,
        ``("adopt", "")`` or ``("prior", "")``; ``None`` once stopped.

        A learned prior back from the learner first (adopting it is quick), then rebuilds, then jobs
        with new observations (each at most once per ``min_interval_s``), then, when nothing else
        waits, the new snapshots' server-cluster answers, then the jobs due a newly learned prior, then
        the jobs holding observations conditioned online since their last refit (refitted, so that a
        service at rest answers as a restarted one would), then starting to learn the prior. While POSTs
        stream in (one within the last ``yield_s``), a task waits, at most ``max_defer_s``:
        acknowledging observations comes before absorbing them (the CPU and the interpreter
        lock are shared; a refit can take seconds).
        """
        waited = coalesced = False
        deferred_since = None
        while True:
            now = time.monotonic()
            if self.yield_s > 0 and now - self._last_write < self.yield_s:
                # writes are streaming in: let them have the CPU, up to max_defer_s at a time
                deferred_since = deferred_since or now
                if now - deferred_since < self.max_defer_s:
                    time.sleep(self.yield_s)
                    continue
            with self._lock:
                if self._stop:
                    return None
                if self._learned_result is not None:
                    self._busy = "(cluster prior)"
                    return "adopt", ""
                if self._rebuild:
                    job = next(iter(self._rebuild))
                    del self._rebuild[job]
                    self._dirty.pop(job, None)
                    self._refresh.pop(job, None)
                    self._settle.pop(job, None)
                    self._busy = self._rebuilding = job
                    return "rebuild", job
                retry_wait = self._due_retries(now)
                job, wait = self._next_dirty()
                if job is not None and (coalesced or not waited or self.coalesce_s <= 0):
                    del self._dirty[job]
                    self._refresh.pop(job, None)  # the update gives it the new prior too
                    self._busy = job
                    self._updated[job] = time.monotonic()
                    return "update", job
                if job is None and self._warm:
                    job = next(iter(self._warm))
                    del self._warm[job]
                    self._busy = job
                    return "warm", job
                if job is None and self._refresh:
                    job = next(iter(self._refresh))
                    del self._refresh[job]
                    self._busy = job
                    return "refresh", job
                if job is None and self._settle:
                    job = next(iter(self._settle))
                    del self._settle[job]
                    self._busy = job
                    return "settle", job
                if job is None:
                    due, prior_wait = self._prior_due(now)
                    if due:
                        self._prior_seen = self._prior_changes
                        self._busy = "(cluster prior)"
                        return "prior", ""
                    wait = min(wait, prior_wait, retry_wait)
                    self._wake.wait(None if wait == float("inf") else wait)
                    waited = True
                    continue
            time.sleep(self.coalesce_s)  # after an idle spell, let the rest of a burst arrive: one update for it
            coalesced = True

    def _run(self) -> None:
        if self.learn_prior:
            try:
                self._restore_prior()
            except Exception:  # noqa: BLE001 - the store unreachable, say: the jobs start without it
                log.exception("goodput serve: reading the stored cluster prior failed")
        while (task := self._next_task()) is not None:
            kind, job = task
            try:
                if kind == "prior":
                    self._learn_prior()
                elif kind == "adopt":
                    self._adopt_prior()
                elif kind == "warm":
                    self._warm_up(job)
                else:
                    self._update(job, full=kind == "rebuild", refresh=kind == "refresh", settle=kind == "settle")
            except Exception:  # noqa: BLE001 - the worker outlives any one task (each handles its own failures)
                self.metrics.failures.inc()
                log.exception("goodput serve: the worker's %s task failed", kind)
            finally:
                with self._lock:
                    self._busy = self._rebuilding = None
                    self._gauges()

    def _warm_up(self, job: str) -> None:
        with self._lock:
            published = self._jobs[job].published
        try:
            if published is not None:
                self._precompute(published)
        except Exception:  # noqa: BLE001 - the cache stays cold; queries compute their answers themselves
            log.exception("goodput serve: computing the answers of job %r ahead failed", job)

    def _update(self, job: str, full: bool, refresh: bool = False, settle: bool = False) -> None:
        """Rebuild (``full``) or update the job's working model: its queued observations, the learned prior if
        a newer one exists; then publish a copy. ``refresh``: only for the newer prior (nothing to do without one).
        ``settle``: refit a model that holds observations conditioned online since its last refit (nothing to do
        without them)."""
        started = time.perf_counter()
        try:
            working = None if full else self._working.get(job)
            if working is None:
                working = self._build(job)
                self._working[job] = working
            elif working.prior_version != self._prior_version:
                working.model.cluster_prior = self._prior_of(job)  # the model refits under it
                working.prior_version = self._prior_version
            elif refresh:
                return
            elif settle:
                if not _unsettled(working.model):
                    return
                working.model.refit()
            with self._lock:
                queued = self._pending.pop(job, [])
            fresh = [(row, obs) for row, obs in queued if row > working.watermark]
            if fresh:
                working.model.observe([obs for _, obs in fresh])
                working.watermark = max(row for row, _ in fresh)
            model = working.model
            diagnostics = json_safe(model.diagnostics) if model.observations else {"observations": 0}
            refits = int(getattr(model, "refits", 0))  # JobModel's refit counter (0 where a model has none)
            if refits > working.refits_seen:  # the model's own policy refitted it (now, or at the build)
                working.refit_at = time.time()
            # the copy shares the frozen observations and the cluster prior (read-only once fitted, at the
            # build); everything else (fits, GP state) is its own
            shared = {id(o): o for o in model.observations}
            if model.cluster_prior is not None:
                shared[id(model.cluster_prior)] = model.cluster_prior
            snapshot = copy.deepcopy(model, shared)
            with self._lock:
                state = self._jobs[job]
                state.version += 1
                version = state.version
            published = Published(job, version, snapshot, diagnostics, refits, working.refit_at)
        except Exception as exc:  # the last good model keeps answering; the next update rebuilds from the store
            self._working.pop(job, None)
            self.metrics.failures.inc()
            log.exception("goodput serve: updating the model of job %r failed", job)
            with self._lock:
                state = self._jobs.get(job)
                if state is not None:
                    state.state = "failed"
                    state.error = f"{type(exc).__name__}: {exc}"
                    # retried from the store by itself (a database's failover is brief), waiting longer each time
                    state.failures += 1
                    retry = min(FAILED_RETRY_S[1], FAILED_RETRY_S[0] * 2.0 ** (state.failures - 1))
                    self._retry[job] = time.monotonic() + retry
            return
        self.metrics.publishes.inc()
        self.metrics.refits.inc(max(0, refits - working.refits_seen))
        working.refits_seen = refits
        self.metrics.update_seconds.observe(time.perf_counter() - started)
        with self._lock:
            state = self._jobs[job]
            state.published = published
            state.state, state.error, state.failures = "ready", None, 0
            self._retry.pop(job, None)
            if self.cluster is not None:
                self._warm[job] = None
            if _unsettled(working.model):
                self._settle[job] = None
            else:
                self._settle.pop(job, None)
            state.pending_types.difference_update(published.gpu_types)
            state.unreadable = working.unreadable
            if working.first_unreadable:
                state.error = f"{working.unreadable} stored record(s) unreadable, left out; first: {working.first_unreadable}"

    def _prior_due(self, now: float) -> tuple[bool, float]:
        """(whether the worker should learn the cluster prior now, seconds until it should); under the lock."""
        if not self.learn_prior or self._prior_changes == self._prior_seen or self._learning:
            return False, float("inf")
        wait = self._prior_at + self.prior_interval_s - now
        return wait <= 0, max(wait, 0.0)

    def _learn_prior(self) -> None:
        """Start learning the cluster prior from the working models of the jobs that reported last: their
        observations and sizes go to the learner's child process, and the worker goes on; the prior comes
        back through :meth:`_on_learned` and is adopted by :meth:`_adopt_prior`."""
        recent = sorted((w for w in self._working.values() if w.model.observations), key=lambda w: w.watermark)
        models = [w.model for w in recent[-self.prior_jobs:]]  # the jobs that reported last
        sized = sum(1 for m in models if m.model_size)
        if len(models) < 2 or sized < MIN_SIZED_JOBS:  # nothing to teach yet (a job's own cells are left out)
            if self._learned is None:  # not counted against the interval: the next change may bring the sizes
                with self._lock:
                    self._prior_info = {**self._prior_info, "waiting": (
                        f"{len(models)} jobs with observations, {sized} with a model_size setting: a learned prior "
                        f"needs {MIN_SIZED_JOBS}+ jobs with a model_size")}
            return
        assert self._learner is not None
        observations = {m.job: list(m.observations) for m in models}
        sizes = {m.job: m.model_size for m in models}
        stamp = self._change_stamp()
        with self._lock:
            # every write up to the stamp is in the working models (the store queues a write inside its write
            # lock, which change_stamp takes), unless one still waits for the worker
            settled = not self._rebuild and not any(self._pending.values())
            self._learning = True
        about = {"jobs": len(models), "sized_jobs": sized, "stamp": stamp if settled else None}
        try:
            self._learner.start(observations, sizes, functools.partial(self._on_learned, about))
        except Exception as exc:  # noqa: BLE001 - the process did not start: the jobs keep the prior they had
            self._on_learned(about, None, f"starting the learning process failed: {type(exc).__name__}: {exc}", 0.0)

    def _change_stamp(self) -> list[float] | None:
        """The store's :meth:`Store.change_stamp`, ``None`` (logged) where it cannot say: a prior learned then is
        kept unstamped, and one read then is not known to be current; either is learned again."""
        try:
            return self.store.change_stamp()
        except Exception:  # noqa: BLE001 - the store unreachable: learn or take the prior all the same
            log.exception("goodput serve: reading the store's change stamp failed")
            return None

    def _on_learned(self, about: dict[str, Any], prior: ClusterPrior | None, error: str | None, seconds: float) -> None:
        """The learner's result (its watcher thread), with what :meth:`_learn_prior` started it on: queued for
        the worker to adopt."""
        with self._lock:
            self._learned_result = (about, prior, error, seconds)
            self._wake.notify_all()

    def _take_prior(self, prior: ClusterPrior, shown: dict[str, Any]) -> None:
        """Make ``prior`` the learned one (each job takes it without its own cells at its next update,
        :meth:`_update`); ``shown``: what :meth:`prior_status` says of it besides its source."""
        self._learned = prior
        self._prior_version += 1
        with self._lock:
            self._prior_info = {"source": "learned", **shown}

    def _adopt_prior(self) -> None:
        """Make the prior the learner sent back the jobs' (each takes it without its own cells at its next update,
        :meth:`_update`) and queue every job for a refresh; on an error, log it and keep the prior the jobs have."""
        with self._lock:
            result, self._learned_result = self._learned_result, None
            self._learning = False
            self._prior_at = time.monotonic()
        if result is None:
            return
        about, learned, error, seconds = result
        if learned is None:
            self.metrics.failures.inc()
            log.error("goodput serve: learning the cluster prior failed: %s", error)
            return
        self.metrics.prior_updates.inc()
        self.metrics.prior_seconds.observe(seconds)
        info = {"jobs": about["jobs"], "sized_jobs": about["sized_jobs"], "cells": len(learned.summaries),
                "seconds": round(seconds, 3)}
        self._take_prior(learned, {**info, "learned_at": time.time()})
        try:  # a restarted service starts from it (_restore_prior)
            self.store.save_prior(learned.to_dict(), {**info, "stamp": about["stamp"], "prior_jobs": self.prior_jobs,
                                                      "coords": list(COORDS)})
        except Exception:  # noqa: BLE001 - the jobs take it all the same; a restart would learn it again
            log.exception("goodput serve: storing the learned cluster prior failed")
        with self._lock:
            for job in self._working:
                if job in self._jobs and job not in self._dirty:
                    self._refresh[job] = None
            self._wake.notify_all()

    def _restore_prior(self) -> None:
        """The worker's first task with ``learn_prior``: the last prior learned on this store, if any, so the
        jobs are rebuilt with it. Learned again at once if the window (``prior_jobs``) or the model's
        coordinates (:data:`goodput.parametric.COORDS`: a prior an older model learned lacks what this one
        adds) differ; else, where observations or settings changed since it was learned (the store's change
        stamp), once ``prior_interval_s`` has run since it was learned, as the service before the restart would
        have (it had been learned again at once: the restarted service's answers up to 30% apart; found in
        review); else not until something changes."""
        stored = self.store.latest_prior()
        if stored is None:
            return
        try:
            prior = ClusterPrior.from_dict(stored.data)
            if len(prior):
                prior.fitted()
        except Exception:  # noqa: BLE001 - a record this code cannot read: learn a new one
            log.exception("goodput serve: the stored cluster prior is unreadable; learning a new one")
            return
        with self._lock:
            changes = self._prior_changes
        same_setup = stored.info.get("prior_jobs") == self.prior_jobs and stored.info.get("coords") == list(COORDS)
        current = same_setup and stored.info.get("stamp") is not None and stored.info["stamp"] == self._change_stamp()
        self._take_prior(prior, {**{k: stored.info[k] for k in ("jobs", "sized_jobs", "cells", "seconds") if k in stored.info},
                                 "learned_at": stored.learned, "restored": True})
        with self._lock:
            if current:  # nothing new to learn from: not due until something changes
                self._prior_seen = changes
            if same_setup:  # the interval runs from when it was learned (a restart does not reset it)
                self._prior_at = time.monotonic() - max(0.0, time.time() - stored.learned)
            else:  # another window or an older model's coordinates: learned again at once
                self._prior_at = -math.inf

    def _current_prior(self) -> ClusterPrior | None:
        """The learned prior once there is one, else the given one (or ``None``)."""
        return self._learned if self._learned is not None else self.cluster_prior

    def _prior_of(self, job: str) -> ClusterPrior | None:
        """The cluster prior without ``job``'s own cells, its hierarchy fitted here (in the worker), not by a query."""
        source = self._current_prior()
        if source is None:
            return None
        prior = source.exclude(job)
        if len(prior):
            prior.fitted()
        return prior

    def _build(self, job: str) -> _Working:
        """A working model from the store: the job's settings and every stored observation, in order."""
        record = self.store.get_job(job)
        if record is None:
            raise UnknownJobError(job)
        with self._lock:
            self._jobs[job].record = record
        model = build_model(job, record.settings, cluster_prior=self._prior_of(job), **self.model_options)
        stored = read_observations(self.store, job)
        if stored.observations:
            model.observe(stored.observations)
        return _Working(model, stored.watermark, stored.unreadable, stored.first_unreadable,
                        prior_version=self._prior_version)

    def _precompute(self, published: Published) -> None:
        """The server cluster's table and its rows' goodput answers, computed now (off the request path)."""
        if self.cluster is None or not published.observations:
            return
        table = published.table(self.cluster, reserved=True)
        published.table_json(self.cluster, None, reserved=True)
        published.table_json(self.cluster, str(self.cluster), reserved=True)
        for row in table.frame.to_dict("records"):
            gpu, nodes, gpus = row["gpu_type"], int(row["num_nodes"]), int(row["num_gpus"])
            published._cache.setdefault(("goodput", gpu, nodes, gpus), {
                "gpu_type": gpu, "num_nodes": nodes, "num_gpus": gpus, **{k: json_safe(row[k]) for k in _ROW_KEYS}})
            published.goodput_json(gpu, nodes, gpus)
        if self.export_dir is not None:
            self.export_dir.mkdir(parents=True, exist_ok=True)
            table.to_csv(self.export_dir / f"{published.job}.csv")
