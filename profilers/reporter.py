"""Report a running training job's own step times to ``goodput serve`` as it trains.

:class:`GoodputReporter` times real optimizer steps (CUDA events on a GPU,
``time.perf_counter`` on the CPU), groups them by configuration (nodes,
replicas, local batch, accumulation steps) and, every ``flush_interval``
seconds, turns each group into one :class:`~goodput.Observation` (the median
step time and its spread; ``source="training"``) that a background thread posts
to the service. With a DistributedDataParallel model attached
(:meth:`GoodputReporter.attach`), a communication hook also measures the
gradient noise the way Pollux does — this replica's local gradient against
the all-reduced one, two batch sizes, folded into the existing
:class:`~goodput.efficiency.GradientNoiseTracker` — and the observations carry
``grad_sqr``/``grad_var``; on the CPU it also times the step's exposed gradient
sync (``sync_time``: from the last bucket's gradients being ready to the last
all-reduce done, the part of the step no compute hides; Pollux's traces carry
the same), which gives the model the step's compute apart from its sync.

Guarantees:

- **Cheap**: a step costs two clock reads (or two CUDA event records) and an
  append; aggregation, JSON and HTTP happen on the background thread. The
  measured cost is in ``experiments/bench_service.py`` (target: under 1% of a
  step).
- **Never raises into the training loop**: the reporter's own faults are logged
  (``goodput.reporter``, at most once a minute per kind) and swallowed; an
  exception from the training code inside ``with reporter.step(...)`` passes
  through unchanged (that step is not recorded).
- **Nothing lost**: every observation is appended (with ``fsync``) to a local
  JSON Lines buffer before it is sent and removed only once the service has
  acknowledged it (the service acknowledges after its commit). While the
  service is down the buffer grows; it is sent when the service is back, also
  by a later run of the job (same ``job``, ``rank`` and ``buffer_dir``). Every
  record has a UUID, so one sent twice is stored once. Records the service
  refuses as invalid (422) go to ``<buffer>.rejected.jsonl``. Where the buffer
  cannot be written (a read-only or full disk: a ``buffer`` fault), records are
  still sent from memory; only their survival of a crash is lost. Each live
  reporter holds its buffer file's ``flock``: a second run of the same job and
  rank on the host keeps ``<job>.rank<r>.pid<pid>.jsonl``, and a reporter that
  starts adopts the files of reporters that died. A body over the server's
  limit (413) is sent in halves. ``close()`` returns within about its
  ``timeout`` even when the service hangs. On SIGTERM (how Slurm and
  Kubernetes stop or preempt a job) the reporters close within
  :data:`SIGTERM_CLOSE_S` and the process then ends as SIGTERM would have
  ended it (a SIGTERM handler set before the first reporter runs after them;
  a main thread inside a long C call, such as a hung collective, handles it
  when the call returns, and the scheduler's SIGKILL after its grace period
  still ends it); SIGKILL loses the steps timed since the last flush
  (``flush_interval``).
- **Forks**: a forked child (``os.fork``, fork-started workers) records and
  sends nothing; the parent does.

Only one replica reports (``report_rank``, rank 0 by default): data-parallel
replicas run the same steps. ``num_nodes``/``num_replicas`` come from
``torch.distributed`` (world size) and torchrun's ``LOCAL_WORLD_SIZE`` (or
Slurm's ``SLURM_JOB_NUM_NODES``) unless given.

Example::

    reporter = GoodputReporter("cifar10", "http://goodput:8470", init_batch_size=128, token=token)
    reporter.attach(ddp_model)                  # optional: gradient noise from DDP's all-reduce
    for batch in loader:
        with reporter.step(local_bsz=64, accum_steps=0):
            loss = loss_fn(ddp_model(batch.x), batch.y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    reporter.close()                            # final flush (also at interpreter exit)
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import glob
import json
import logging
import numbers
import os
import signal
import statistics
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from goodput.errors import ValidationError
from goodput.io import atomic_write_text, try_lock_file
from goodput.validation import check_float, check_int, check_job_name, normalize_gpu_type

__all__ = ["GoodputReporter", "default_buffer_dir"]

log = logging.getLogger("goodput.reporter")

SEND_CHUNK = 500  # records per POST
_WARN_EVERY_S = 60.0


def default_buffer_dir() -> Path:
    """``$GOODPUT_REPORTER_DIR``, else ``~/.cache/goodput/reporter``."""
    env = os.environ.get("GOODPUT_REPORTER_DIR")
    return Path(env) if env else Path.home() / ".cache" / "goodput" / "reporter"


class _Step:
    """``with reporter.step(...)``: times the block; records it only if the block finished without an exception."""

    __slots__ = ("reporter", "key", "start")

    def __init__(self, reporter: GoodputReporter, key: tuple[int, int, int, int] | None) -> None:
        self.reporter = reporter
        self.key = key
        self.start: Any = None

    def __enter__(self) -> _Step:
        if self.key is not None:
            try:
                self.start = self.reporter._clock_start()
            except Exception as exc:  # noqa: BLE001 - never into the training loop
                self.reporter._fault("timing", exc)
                self.key = None
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        try:
            if self.key is not None and exc_type is None:
                self.reporter._record(self.key, self.start)
            elif self.reporter._bucket_sums:  # a warm-up or failed step: its gradients are not a sample
                with self.reporter._bucket_lock:
                    self.reporter._bucket_sums = []
        except Exception as error:  # noqa: BLE001
            self.reporter._fault("timing", error)
        return False  # the training code's own exceptions pass through


class GoodputReporter:
    """Times a training job's steps and posts them to ``goodput serve`` (see the module docstring).

    Args:
        job: the job's name on the service.
        url: the service, e.g. ``http://goodput:8470``.
        token: bearer token for writes (the server's ``--token-file``).
        init_batch_size, max_batch_size, local_bsz_bounds: when ``init_batch_size`` is given, the
            job is registered (``PUT``) with these settings if the service does not know it yet;
            ``init_batch_size`` is also the reference batch M0 of the gradient-noise statistics
            (else it is read from the service's record of the job).
        model_size: the job's trainable parameters, registered with those settings: with a cluster
            prior on the service (``goodput serve --learn-prior`` or ``--cluster-prior``) they place its sync costs before it
            has run multi-GPU (``profilers.trainable_parameters(model)`` counts them).
        gpu_type: the device type (default: the CUDA device's normalised name, or ``"cpu"``).
        num_nodes, num_replicas: the allocation (default: from ``torch.distributed`` and the launcher).
        device: the device whose work is timed (default: the current CUDA device if CUDA is in use, else CPU).
        rank: this process's rank (default: ``torch.distributed``'s, else ``$RANK``, else 0).
        report_rank: the rank that reports (default 0); the others' reporters do nothing.
        flush_interval: seconds between posts (default 5).
        warmup_steps: steps of each new configuration not recorded (allocation, autotuning; default 3).
        buffer_dir: where the JSON Lines buffer lives (default :func:`default_buffer_dir`).
        timeout: seconds per HTTP request.
        transport: an httpx transport for the client (tests, proxies).
    """

    def __init__(self, job: str, url: str, *, token: str | None = None, init_batch_size: int | None = None,
                 max_batch_size: int | None = None, local_bsz_bounds: Any = None, model_size: float | None = None,
                 gpu_type: str | None = None,
                 num_nodes: int | None = None, num_replicas: int | None = None, device: Any = None,
                 rank: int | None = None, report_rank: int = 0, flush_interval: float = 5.0, warmup_steps: int = 3,
                 buffer_dir: str | os.PathLike[str] | None = None, timeout: float = 10.0,
                 transport: Any = None) -> None:
        from goodput.client import Client

        self.job = check_job_name(job)
        self.init_batch_size = None if init_batch_size is None else check_int("init_batch_size", init_batch_size, minimum=1)
        if init_batch_size is not None:  # the settings as the service's model will check them, checked here and now
            from goodput import JobModel

            JobModel(self.job, self.init_batch_size, max_batch_size, local_bsz_bounds, bayesian=False)
        self._settings = None if init_batch_size is None else {
            "init_batch_size": self.init_batch_size, "max_batch_size": max_batch_size, "local_bsz_bounds": local_bsz_bounds,
            "model_size": None if model_size is None else check_float("model_size", model_size, positive=True)}
        self.flush_interval = check_float("flush_interval", flush_interval, positive=True)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
        self.device = _default_device() if device is None else device
        self.cuda = str(self.device).startswith("cuda")
        self.gpu_type = _device_type(self.device) if gpu_type is None else normalize_gpu_type(gpu_type)
        self.rank = _rank() if rank is None else check_int("rank", rank, minimum=0)
        self.active = self.rank == check_int("report_rank", report_rank, minimum=0)
        replicas, nodes = _world()
        self.num_replicas = check_int("num_replicas", num_replicas if num_replicas is not None else replicas, minimum=1)
        self.num_nodes = check_int("num_nodes", num_nodes if num_nodes is not None else nodes, minimum=1)
        if self.num_replicas < self.num_nodes:
            raise ValidationError("num_replicas", self.num_replicas, f"must be >= num_nodes ({self.num_nodes})")
        self.client = Client(url, token=token, timeout=timeout, transport=transport)
        self._buffer_dir = Path(buffer_dir if buffer_dir is not None else default_buffer_dir())
        self.buffer_path = self._buffer_dir / f"{self.job}.rank{self.rank}.jsonl"
        self._lock_fd: int | None = None  # the buffer's lock, held while this reporter lives
        self._closed = False
        self._chunk = SEND_CHUNK  # records per POST, halved when the service says the body is too large
        self.sent = 0  # records the service acknowledged
        self.faults: collections.Counter[str] = collections.Counter()
        self._samples: collections.deque[tuple[tuple[int, int, int, int], Any, float, float | None]] = collections.deque()
        self._grads: collections.deque[tuple[Any, Any, int, int]] = collections.deque()
        self._bucket_sums: list[Any] = []  # the current step's (local, total) squared norms per bucket, and (on the CPU)
        # the perf_counter seconds it was ready to reduce and reduced (None on CUDA)
        self._bucket_lock = threading.Lock()
        self._seen: dict[tuple[int, int, int, int], int] = {}
        self._last_warning: dict[str, float] = {}
        self._tracker: Any = None
        self._registered = False
        self._unsent: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._io_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if self.active:
            self._claim_buffer()
            self._unsent = self._read_buffer() + self._adopt_orphans()
            _LIVE.add(self)
            self._thread = threading.Thread(target=self._run, name=f"goodput-reporter-{self.job}", daemon=True)
            self._thread.start()
            atexit.register(self.close)
            _flush_on_sigterm()

    # ------------------------------------------------------------------ the training loop's side
    def step(self, local_bsz: int, accum_steps: int = 0) -> _Step:
        """``with reporter.step(local_bsz=..., accum_steps=...):`` around one optimizer step (all its micro-batches)."""
        if not self.active or self._closed:
            if self._closed:
                self._fault("closed", RuntimeError("step() after close(): not recorded"))
            return _Step(self, None)
        if not (_whole(local_bsz) and _whole(accum_steps)) or local_bsz < 1 or accum_steps < 0:
            self._fault("arguments", ValidationError("local_bsz/accum_steps", (local_bsz, accum_steps),
                                                     "expected an int >= 1 and an int >= 0; step not recorded"))
            return _Step(self, None)
        local_bsz, accum_steps = int(local_bsz), int(accum_steps)  # numpy's integers too
        key = (self.num_nodes, self.num_replicas, local_bsz, accum_steps)
        seen = self._seen.get(key, 0)
        self._seen[key] = seen + 1
        return _Step(self, key if seen >= self.warmup_steps else None)

    def on_step(self, local_bsz: int, accum_steps: int = 0) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A decorator form: ``reporter.on_step(64)(train_step)`` times every call of ``train_step``."""
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            def timed(*args: Any, **kwargs: Any) -> Any:
                with self.step(local_bsz, accum_steps):
                    return fn(*args, **kwargs)
            return timed
        return wrap

    def reconfigure(self, *, num_nodes: int | None = None, num_replicas: int | None = None) -> None:
        """The allocation changed (an elastic job rescaled): later steps are observations of the new one."""
        nodes = self.num_nodes if num_nodes is None else check_int("num_nodes", num_nodes, minimum=1)
        replicas = self.num_replicas if num_replicas is None else check_int("num_replicas", num_replicas, minimum=1)
        if replicas < nodes:
            raise ValidationError("num_replicas", replicas, f"must be >= num_nodes ({nodes})")
        self.num_nodes, self.num_replicas = nodes, replicas

    def attach(self, ddp_model: Any, process_group: Any = None) -> GoodputReporter:
        """Measure gradient noise through ``ddp_model``'s all-reduce (a DDP communication hook; call it on every rank).

        The hook does DDP's default averaging all-reduce and, around it, takes the squared
        norm of this replica's gradient and of the averaged one: two batch sizes of one
        step (Pollux, OSDI'21 §3.1; McCandlish et al. 2018, App. A.1). Needs 2+ replicas. With
        gradient accumulation, run all micro-batches but the last under ``ddp_model.no_sync()``:
        a step that reduces a bucket twice gives no gradient statistics (its time still counts).
        On the CPU it also times each bucket from ready to reduced: a step's ``sync_time`` is
        its last reduction's end minus its last bucket's readiness (the backward pass has no
        compute left then; Pollux, OSDI'21 §3.2). On CUDA the hook runs when the host queues
        the bucket, not when the GPU has its gradients, so host clocks would not measure it:
        there the observations carry no ``sync_time``.
        Unless ``model_size`` was given, the model's trainable parameters become the job's
        ``model_size`` when this reporter registers it (a cluster prior's size slopes use it).
        """
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        ddp_model = getattr(ddp_model, "_orig_mod", ddp_model)  # torch.compile(DDP(model)): the DDP inside
        if not isinstance(ddp_model, DistributedDataParallel):
            raise ValidationError("ddp_model", type(ddp_model).__name__, "expected a DistributedDataParallel model "
                                  "(gradient noise is read off its all-reduce)")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValidationError("ddp_model", type(ddp_model).__name__, "needs torch.distributed initialised "
                                  "(init_process_group)")
        group = process_group if process_group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        reporter = self

        timed = not self.cuda

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses annotations other than its own types
            ready = time.perf_counter() if timed else None
            index = bucket.index()
            tensor = bucket.buffer()
            local = tensor.detach().pow(2).sum()
            tensor.div_(world)
            future = dist.all_reduce(tensor, group=group, async_op=True).get_future()

            def reduced(fut: Any) -> Any:
                averaged = fut.value()[0]
                if reporter.active and not reporter._closed:
                    total = averaged.detach().pow(2).sum()
                    with reporter._bucket_lock:
                        reporter._bucket_sums.append((local, total, ready, time.perf_counter() if timed else None, index))
                return averaged

            return future.then(reduced)

        ddp_model.register_comm_hook(None, hook)
        if self._settings is not None and self._settings.get("model_size") is None:
            from .profile import trainable_parameters

            self._settings["model_size"] = float(trainable_parameters(ddp_model))
        return self

    # ------------------------------------------------------------------ internals of the hot path
    def _clock_start(self) -> Any:
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _record(self, key: tuple[int, int, int, int], start: Any) -> None:
        sums: list[Any] = []
        if self._bucket_sums:
            with self._bucket_lock:
                sums, self._bucket_sums = self._bucket_sums, []
        if self.cuda:
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._samples.append((key, (start, end), time.time(), None))
        else:
            duration = time.perf_counter() - start
            sync = None
            if sums and all(s[2] is not None for s in sums):  # exposed: the last reduction's end after the last bucket
                sync = min(max(0.0, max(s[3] for s in sums) - max(s[2] for s in sums)), duration)
            self._samples.append((key, duration, time.time(), sync))
        # one micro-batch's gradient against the replicas' average: each bucket reduced once. Accumulating without
        # no_sync() reduces every bucket at each micro-batch, and the sums mixed averages into the local norms
        # (|G|² 49% high; found in review): such a step's statistics are left out, its time kept
        if sums and len({s[4] for s in sums}) == len(sums):
            local_batch = key[2] * (key[3] + 1)
            self._grads.append((sum(s[0] for s in sums), sum(s[1] for s in sums), local_batch, local_batch * key[1]))

    def _fault(self, kind: str, exc: BaseException) -> None:
        self.faults[kind] += 1
        now = time.monotonic()
        if now - self._last_warning.get(kind, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._last_warning[kind] = now
            log.warning("goodput reporter (%s, %s): %s: %s (%d so far; training goes on)", self.job, kind,
                        type(exc).__name__, exc, self.faults[kind])

    # ------------------------------------------------------------------ the background thread
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            self.flush(final=False)

    def flush(self, final: bool = True, wait: float | None = None) -> int:
        """Aggregate the steps timed so far, buffer them, send everything unsent; the records still unsent.

        Called by the background thread every ``flush_interval``; ``final=True`` (``close``) also turns
        configurations with a single timed step into observations. ``wait``: seconds to wait for a flush
        in progress (the background thread's, on a slow service) before giving up (``None``: as long as it
        takes); its records are in the buffer file already. Never raises.
        """
        deadline = None if wait is None else time.monotonic() + max(wait, 0.0)
        if not self._io_lock.acquire(timeout=-1 if wait is None else max(wait, 0.0)):
            return len(self._unsent)
        bounded = self.client.deadline(deadline) if deadline is not None else contextlib.nullcontext()
        bounded.__enter__()  # every request of this flush (settings, registration, records) ends by the deadline
        try:
            try:
                self._fold_gradients()
            except Exception as exc:  # noqa: BLE001 - e.g. M0 not known yet and the service down: steps still go on
                self._fault("gradients", exc)
            records = []
            try:
                records = self._aggregate(final)
            except Exception as exc:  # noqa: BLE001
                self._fault("aggregate", exc)
            if records:
                self._unsent.extend(records)  # sent from memory even when the buffer cannot keep them
                try:
                    self._append_buffer(records)
                except Exception as exc:  # noqa: BLE001 - a read-only or full disk: durability lost, not the records
                    self._fault("buffer", exc)
            try:
                self._send(deadline)
            except Exception as exc:  # noqa: BLE001
                self._fault("send", exc)
            return len(self._unsent)
        finally:
            bounded.__exit__(None, None, None)
            self._io_lock.release()

    def _fold_gradients(self) -> None:
        if not self._grads:
            return
        if self._tracker is None:
            if self.init_batch_size is None:
                self.init_batch_size = int(self.client.job(self.job)["settings"]["init_batch_size"])
            from goodput.efficiency import GradientNoiseTracker

            self._tracker = GradientNoiseTracker(self.init_batch_size)
        while self._grads:
            local, total, small, large = self._grads.popleft()
            if large > small:  # one replica: the two batches coincide, nothing to learn
                self._tracker.update_two_batches(float(local), small, float(total), large)

    def _aggregate(self, final: bool) -> list[dict[str, Any]]:
        """The flush's records: one per configuration, its median step. A configuration whose record the
        observation's checks refuse (a step over ``MAX_STEP_TIME``, a timer that read 0) is counted as an
        ``aggregate`` fault and left out alone; the others' records are kept."""
        from goodput import Observation, ValidationError

        groups: dict[tuple[int, int, int, int], list[tuple[float, float | None]]] = {}
        taken: list[tuple[tuple[int, int, int, int], Any, float, float | None]] = []
        while self._samples:
            taken.append(self._samples.popleft())
        for key, sample, _, sync in taken:
            if isinstance(sample, tuple):  # CUDA events: wait for the end on this thread, not the training one
                start, end = sample
                end.synchronize()
                sample = start.elapsed_time(end) / 1000.0
            groups.setdefault(key, []).append((float(sample), sync))
        grads = {}
        if self._tracker is not None and self._tracker.updates:
            grads = {"grad_sqr": self._tracker.grad_sqr, "grad_var": self._tracker.grad_var}
        records = []
        now = time.time()
        for (nodes, replicas, bsz, accum), steps in groups.items():
            if len(steps) < 2 and not final:  # one step is a noisy estimate: wait for the next window's
                self._samples.extend(((nodes, replicas, bsz, accum), t, now, sync) for t, sync in steps)
                continue
            times = [t for t, _ in steps]
            step_time = statistics.median(times)
            syncs = [sync for _, sync in steps if sync is not None]
            # the median exposed sync where every step of the group has one (no more than the median step)
            sync_time = min(statistics.median(syncs), step_time) if syncs and len(syncs) == len(steps) else None
            try:
                observation = Observation(
                    job=self.job, gpu_type=self.gpu_type, num_nodes=nodes, num_replicas=replicas, local_bsz=bsz,
                    accum_steps=accum, step_time=step_time, sync_time=sync_time,
                    step_time_std=statistics.stdev(times) if len(times) > 1 else None,
                    source="training", timestamp=now, **grads)
            except ValidationError as exc:
                self._fault("aggregate", exc)
                continue
            records.append({**observation.to_dict(), "id": uuid.uuid4().hex})
        return records

    # ------------------------------------------------------------------ the buffer and the service
    def _claim_buffer(self) -> None:
        """Lock this reporter's buffer file for its lifetime (``flock`` on ``<buffer>.lock``): another live
        reporter of the same job and rank (a second run on the host) holds ``<job>.rank<r>.jsonl``, so this one
        takes ``<job>.rank<r>.pid<pid>.jsonl``. Each rewrites only its own file when records are acknowledged;
        sharing one, each had deleted the other's unsent records from disk."""
        try:
            self._buffer_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._fault("buffer", exc)
            return
        stem = f"{self.job}.rank{self.rank}"
        for n in range(1000):  # a third reporter in this process (no close()) takes pid<pid>.<n>: never a shared file
            name = f"{stem}.jsonl" if n == 0 else f"{stem}.pid{os.getpid()}.jsonl" if n == 1 else f"{stem}.pid{os.getpid()}.{n}.jsonl"
            path = self._buffer_dir / name
            try:
                fd = try_lock_file(path.with_name(path.name + ".lock"))
            except OSError as exc:  # a folder this process may not write in: the buffer faults as it did
                self._fault("buffer", exc)
                return
            if fd is not None:
                self.buffer_path, self._lock_fd = path, fd
                return
        self._fault("buffer", RuntimeError(f"no free buffer file for {stem} in {self._buffer_dir}"))

    def _adopt_orphans(self) -> list[dict[str, Any]]:
        """Records of this job and rank left by reporters that died (their buffer files unlocked): copied into
        this reporter's buffer (fsynced) before their files are removed, so a crash in between repeats them
        (the service keeps one per id) but loses none."""
        adopted: list[dict[str, Any]] = []
        stem = glob.escape(f"{self.job}.rank{self.rank}")
        for lock in sorted(self._buffer_dir.glob(f"{stem}.pid*.jsonl.lock")):  # dead reporters that left nothing
            if not lock.with_suffix("").exists() and lock.with_suffix("") != self.buffer_path:
                fd = _lock_if_free(lock)
                if fd is not None:
                    lock.unlink(missing_ok=True)
                    os.close(fd)
        for path in sorted(self._buffer_dir.glob(f"{stem}.jsonl")) + sorted(self._buffer_dir.glob(f"{stem}.pid*.jsonl")):
            if path == self.buffer_path or path.name.endswith(".rejected.jsonl"):
                continue
            lock = path.with_name(path.name + ".lock")
            fd = _lock_if_free(lock)
            if fd is None:  # its reporter is alive (or the file is not ours to lock)
                continue
            try:
                records = self._read_records(path)
                if records:
                    self._append_buffer(records)
                path.unlink(missing_ok=True)
                if ".pid" in path.name:
                    lock.unlink(missing_ok=True)
                adopted.extend(records)
            except OSError as exc:
                self._fault("buffer", exc)
            finally:
                os.close(fd)
        return adopted

    def _read_buffer(self) -> list[dict[str, Any]]:
        """Records a previous run left unsent in this reporter's buffer file."""
        return self._read_records(self.buffer_path)

    def _read_records(self, path: Path) -> list[dict[str, Any]]:
        """The records of a buffer file. A torn last line, from a crash mid-write, is skipped and cut
        from the file (appended to, the next record would be joined to it and lost with it)."""
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as exc:
            self._fault("buffer", exc)
            return []
        records = []
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("id"):
                records.append(record)
        if text and not text.endswith("\n") and path == self.buffer_path:
            try:
                self._rewrite_buffer(records)
            except OSError as exc:
                self._fault("buffer", exc)
        return records

    def _append_buffer(self, records: list[dict[str, Any]]) -> None:
        self.buffer_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.buffer_path, "a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _rewrite_buffer(self, records: list[dict[str, Any]]) -> None:
        """Make the buffer hold exactly ``records`` (atomically; no file when there are none)."""
        if records:
            atomic_write_text(self.buffer_path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
        else:
            try:
                self.buffer_path.unlink()
            except FileNotFoundError:
                pass

    def _send(self, deadline: float | None = None) -> None:
        """Send the unsent records in chunks; with ``deadline`` (``time.monotonic()``), none is sent after it
        (what is left stays in the buffer file)."""
        from goodput.client import PayloadTooLargeError, ServiceValidationError, UnknownJobError

        if not self._unsent:
            return
        changed = False
        try:
            while self._unsent:
                if deadline is not None and deadline - time.monotonic() <= 0.01:
                    return  # the rest stays in the buffer file (each request is cut to the deadline: flush)
                chunk = self._unsent[:self._chunk]
                try:
                    self.client.post_observations(self.job, chunk)
                except PayloadTooLargeError as exc:  # over the server's --max-body-mb: send less at once
                    if len(chunk) > 1:
                        self._chunk = max(1, len(chunk) // 2)
                        continue
                    self._reject(chunk, exc)  # one record too large for the service: kept aside, not retried forever
                except UnknownJobError:
                    if self._settings is None or self._registered:
                        raise
                    self._register()
                    continue
                except ServiceValidationError as exc:
                    self._reject(chunk, exc)
                else:
                    self.sent += len(chunk)
                del self._unsent[:len(chunk)]
                changed = True
        finally:
            if changed:
                self._rewrite_buffer(self._unsent)

    def _register(self) -> None:
        settings = {k: v for k, v in (self._settings or {}).items() if v is not None}
        self.client.put_job(self.job, **settings)
        self._registered = True

    def _reject(self, chunk: list[dict[str, Any]], exc: Exception) -> None:
        path = self.buffer_path.with_suffix(".rejected.jsonl")
        with open(path, "a", encoding="utf-8") as f:
            for record in chunk:
                f.write(json.dumps(record, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._fault("rejected", RuntimeError(f"the service refused {len(chunk)} record(s), kept in {path}: {exc}"))

    def close(self, timeout: float = 30.0) -> int:
        """Stop the background thread after a last flush, within about ``timeout`` seconds (a service that
        hangs does not hold the training script's exit longer); the records left unsent, kept in the buffer
        file for the next run. Later steps are not recorded."""
        if self._thread is None:
            return 0
        deadline = time.monotonic() + timeout
        self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        left = self.flush(final=True, wait=deadline - time.monotonic())
        if left:  # said once, where the training script's log shows it (the service's faults are rate-limited)
            log.warning("goodput reporter %s: %d record(s) not sent, kept in %s for the job's next run",
                        self.job, left, self.buffer_path)
        self._thread = None
        self.client.close()
        self._release_buffer()
        _LIVE.discard(self)
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001
            pass
        return left

    def _release_buffer(self) -> None:
        if self._lock_fd is None:
            return
        if ".pid" in self.buffer_path.name and not self.buffer_path.exists():  # nothing left: no lock file either
            self.buffer_path.with_name(self.buffer_path.name + ".lock").unlink(missing_ok=True)
        os.close(self._lock_fd)
        self._lock_fd = None

    def _after_fork_in_child(self) -> None:
        """A forked child (``os.fork``, a fork-started worker) holds a copy of this reporter: it records and sends
        nothing (the parent does), and its exit neither sends the parent's pending steps twice nor waits on a
        lock a parent's thread held at the fork."""
        self.active, self._thread = False, None
        self._samples, self._grads, self._unsent = collections.deque(), collections.deque(), []
        self._io_lock = threading.Lock()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the child's copy; the parent's lock stays (flock belongs to the open file)
            self._lock_fd = None

    def __enter__(self) -> GoodputReporter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_LIVE: weakref.WeakSet[GoodputReporter] = weakref.WeakSet()  # the process's active reporters


def _forget_in_child() -> None:
    for reporter in list(_LIVE):
        reporter._after_fork_in_child()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)

SIGTERM_CLOSE_S = 10.0  # what a SIGTERM leaves the reporters to close (Kubernetes' grace period is 30 s by default)
_sigterm_previous: Any = None  # the SIGTERM handler before the reporters' own (None: not installed)


def _flush_on_sigterm() -> None:
    """Close the live reporters on SIGTERM, how Slurm and Kubernetes stop or preempt a job: Python's default
    SIGTERM skips ``atexit``, and the steps timed since the last flush had been lost. Installed once, from
    the main thread, unless SIGTERM is ignored; a handler set before is called after, else the process then
    ends of SIGTERM as it would have."""
    global _sigterm_previous
    if _sigterm_previous is not None or threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN or previous is None:  # ignored, or set outside Python: left alone
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # no signals here (an embedded interpreter)
        return
    _sigterm_previous = previous


def _on_sigterm(signum: int, frame: Any) -> None:
    deadline = time.monotonic() + SIGTERM_CLOSE_S
    for reporter in list(_LIVE):
        try:
            reporter.close(timeout=max(deadline - time.monotonic(), 0.1))
        except Exception:  # noqa: BLE001  (the process is ending: nothing here may stop it)
            log.exception("goodput reporter: closing on SIGTERM failed")
    previous = _sigterm_previous
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _whole(value: Any) -> bool:
    """An integer, numpy's included (``GoodputTable.frame``'s ``local_bsz``), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _lock_if_free(path: Path) -> int | None:
    """:func:`goodput.io.try_lock_file`, ``None`` also for a lock file this process cannot open (another user's)."""
    try:
        return try_lock_file(path)
    except OSError:
        return None


# ---------------------------------------------------------------------- the environment
def _default_device() -> str:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return f"cuda:{torch.cuda.current_device()}"
    except ImportError:  # pragma: no cover
        pass
    return "cpu"


def _device_type(device: Any) -> str:
    if not str(device).startswith("cuda"):
        return "cpu"
    import torch

    from .devices import normalize_device_name

    return normalize_device_name(torch.cuda.get_device_name(torch.device(device)))


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except ImportError:  # pragma: no cover
        pass
    return int(os.environ.get("RANK", "0") or 0)


def _world() -> tuple[int, int]:
    """(replicas, nodes): torch.distributed's world size and the launcher's node count (1 without either)."""
    replicas = 1
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            replicas = int(dist.get_world_size())
    except ImportError:  # pragma: no cover
        pass
    if replicas == 1:
        replicas = int(os.environ.get("WORLD_SIZE", "1") or 1)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and int(local) > 0:
        return replicas, max(1, replicas // int(local))
    slurm = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
    if slurm:
        return replicas, max(1, min(replicas, int(slurm)))
    return replicas, 1
