"""``profile_cluster``: profile a training job on every device type of a Ray cluster, one node of each, in parallel.

:func:`profilers.profile_job` measures the device types of the machine it runs
on. In a cluster each GPU type lives on other nodes, so Sia's bootstrap (one
GPU of each type, under 20 s each; Jayaram Subramanya et al., SOSP'23) needs a
task on a node of every type. Ray schedules by type (Ray labels every GPU node
``accelerator_type:<NAME>``) and ships functions by cloudpickle, so a job built
from lambdas travels too:

1. connect (:func:`profilers.rayutil.connected`) and find the types the cluster
   offers (:func:`profilers.rayutil.discover_types`);
2. per type, one Ray actor on one node of it that asks for the GPUs of the most
   replicas (powers of two up to the node's GPUs; the sweep runs on the first)
   or, on a CPU type, as many cores; it runs ``profile_job`` on that node's
   devices under the cluster's name for the type (``accelerator_type:A100`` →
   ``"a100"``) and hands each observation back as it is measured (a long poll:
   Ray's streaming generators do not work through Ray Client, actors do);
3. here, each observation is appended to ``out`` (JSON Lines, fsync per record)
   as it arrives and handed to ``on_observations(gpu_type, observations)``; a
   type's facts (its report, its largest batch) follow when it finishes;
4. one progress line per type while they run, then the summary table.

Rerunning with the same ``out`` skips the types finished there with the same
settings, and resumes the others from what they had measured (their
observations go to the task, which skips what is done). A type whose task fails
(the model, the node, the worker) is named with its error while the others
finish; :class:`~profilers.errors.ClusterProfileError` is raised at the end
carrying the merged profile and the failures.

Every node needs this package (and the job's own modules, where the job is not
made of lambdas) importable: install it there, or connect with a runtime
environment first (``ray.init(address, runtime_env={"py_modules": [...]})``);
``profile_cluster`` uses a connection the process already has.

What Ray adds to a type's wall time is mostly its actor's start: a Ray worker
process unpickling the job, which imports torch there (1.5-2 s on this
project's 2-core host). A cluster started with ``RAY_preload_python_modules=torch``
(``ray start``'s environment on each node) has its idle workers import torch
before they are given work, which takes that off the start where an idle worker
is waiting (``python -m experiments.bench_ray --preload-torch`` measures both).

Example::

    from profilers import profile_cluster, zoo
    work = zoo.get("resnet")
    profile = profile_cluster(**work.profile_args(), address="auto", out="resnet.jsonl")
    JobModel.from_profile(profile).table(Cluster.parse("t4:6x4,a100:2x8"))
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import queue
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput.errors import ValidationError
from goodput.observations import Observation, Profile, ProfileWriter
from goodput.validation import check_int, check_str

from .errors import ClusterProfileError
from .profile import (
    RunOptions,
    check_job_pieces,
    check_run_options,
    default_replicas,
    finished_report,
    load_previous,
    profile_job,
    trainable_parameters,
)
from .rayutil import ClusterType, connected, discover_types, task_error
from .type_run import JobPieces

__all__ = ["profile_cluster", "TypeTask"]

# profile_job's arguments that profile_cluster decides itself, per node or here
_DECIDED_HERE = ("model", "optimizer_factory", "loss_fn", "make_batch", "job", "init_batch_size", "devices", "out",
                 "progress", "mlflow", "console", "on_observation")


@dataclass(frozen=True)
class TypeTask:
    """What one type's actor is asked to do (picklable).

    Attributes:
        gpu_type: the cluster's name for the type; the observations carry it.
        is_cuda: profile the node's CUDA devices (else its CPU).
        replicas: replica counts of the synchronisation phase.
    """

    gpu_type: str
    is_cuda: bool
    replicas: tuple[int, ...]


def profile_cluster(
    model: Any,
    optimizer_factory: Callable[[Any], Any],
    loss_fn: Callable[[Any, Any], Any],
    make_batch: Callable[[int, Any], Any],
    *,
    job: str,
    init_batch_size: int,
    address: str | None = None,
    gpu_types: Any = None,
    out: str | os.PathLike[str] | None = None,
    progress: bool = True,
    mlflow: bool = False,
    console: Any = None,
    on_observations: Callable[[str, list[Observation]], None] | None = None,
    server: str | None = None,
    token: str | None = None,
    **profile_job_options: Any,
) -> Profile:
    """Profile a job on one node of every device type of a Ray cluster, in parallel; return the merged profile.

    Args:
        model, optimizer_factory, loss_fn, make_batch, job, init_batch_size:
            the job, as :func:`profilers.profile_job` takes it (shipped to the
            nodes by cloudpickle: lambdas and closures work).
        address: the Ray cluster: ``None`` (Ray's default: ``RAY_ADDRESS``, the
            cluster last started on this machine, else a new local instance),
            ``"auto"``, ``"host:port"`` or ``"ray://host:10001"``; an existing
            connection of this process is used as it is.
        gpu_types: ``None`` (every CUDA GPU type the cluster labels with Ray's
            ``accelerator_type:*``, and labelled nodes without GPUs by their CPU;
            the host ``"cpu"`` when there is none), a list or comma-separated
            names of those (``"cpu"`` included), or ``{name: resource}`` naming
            custom Ray resources that label each type's nodes
            (:func:`profilers.rayutil.cluster_types`).
        out: a JSON Lines path; observations are appended as they arrive, and
            a rerun skips types finished there and resumes the rest.
        progress: a progress line per type, then the summary table.
        mlflow: log the merged profile as an MLflow run (here, not on the nodes).
        console: a ``rich.console.Console`` for progress and the summary.
        on_observations: called here with ``(gpu_type, [observations])`` as each
            type's observations arrive (after they are on disk in ``out``); an
            exception it raises stops the profiling (every type's actor is killed).
            This is where observations can be sent on as they arrive.
        server: the goodput service (``goodput serve``, e.g. ``http://goodput:8470``):
            the job is registered there (``PUT /v1/jobs/{job}``) and every
            observation is posted as it arrives (``observations`` endpoint; a
            rerun's earlier observations too: the service stores each record
            once, so resending is harmless). A failed post stops the profiling
            as ``on_observations``'s exception does; what is on disk in ``out``
            is kept either way.
        token: the bearer token the service's writes need (its ``--token-file``).
        **profile_job_options: ``max_batch_size``, ``batch_sizes``,
            ``min_local_bsz``, ``time_budget_s`` (per type, default 20),
            ``replicas`` (counts measured on the types whose nodes have that many
            GPUs, or cores on a CPU type; default: powers of two up to a node's
            GPUs, 2 on a CPU type), ``memory_cap_bytes``, ``cpu_threads``,
            ``warmup``, ``min_steps``, ``max_steps``, ``noise_rounds``,
            ``sync_sizes`` — as :func:`profilers.profile_job` takes them.

    Returns:
        Every observation of the job (earlier runs in ``out`` included), in
        ``out``'s order, each type's facts under ``metadata["profiler.<type>"]``
        (with the Ray ``node_id`` and ``host`` it ran on, ``ray_start_s`` from
        submitting its actor to the actor's start, and ``ray_wall_s`` from
        submitting to its end; ``ray_wall_s`` less ``seconds``, profile_job's own,
        is what Ray added) and its ``max_local_bsz``.

    Raises:
        ValidationError: a bad argument (names it), or a type the cluster does not offer.
        RayNotInstalledError: Ray is missing (``pip install 'goodput[ray]'``).
        RayConnectionError: no cluster at ``address``.
        ClusterProfileError: some types failed; names them and their errors, and
            carries the profile of everything kept (``.profile``).
    """
    job = check_str("job", job)
    init_batch_size = check_int("init_batch_size", init_batch_size, minimum=1)
    check_job_pieces(model, optimizer_factory, loss_fn, make_batch)
    if on_observations is not None and not callable(on_observations):
        raise ValidationError("on_observations", on_observations, "expected a callable or None")
    client = None
    if server is not None:
        from goodput.client import Client

        client = Client(server, token)  # refuses a bad URL or token here, before Ray starts
    run = _run_options(profile_job_options)
    max_batch_size = run.pop("max_batch_size")
    if max_batch_size is not None:
        max_batch_size = check_int("max_batch_size", max_batch_size, minimum=init_batch_size)
    options = check_run_options(init_batch_size, max_batch_size=max_batch_size, **run)
    previous = load_previous(out, job, init_batch_size)
    if progress and console is None:
        from .profile import _console

        console = _console()

    if client is not None:
        on_observations = _posting(client, job, init_batch_size, max_batch_size, trainable_parameters(model), previous,
                                   on_observations)
    with connected(address, "profile_cluster") as ray:
        types = discover_types(gpu_types)
        plans = [(t, _replicas(t, options)) for t in types]
        job_settings = {"job": job, "init_batch_size": init_batch_size, "max_batch_size": max_batch_size}
        runner = _Runner(ray, JobPieces(model, optimizer_factory, loss_fn, make_batch), options, job_settings, previous,
                         out, on_observations, console if progress else None)
        runner.meta(num_parameters=trainable_parameters(model))
        try:
            runner.run(plans)
        finally:
            runner.close()
            if client is not None:
                client.close()
    profile = runner.profile()
    if progress:
        from .summary import summary_table

        console.print(summary_table(profile))
        for gpu_type, error in runner.failures.items():
            console.print(f"[bold red]{gpu_type}: failed[/] — {error}")
    if mlflow:
        from .tracking import log_profile

        run_id = log_profile(profile, path=out)
        if progress:
            console.print(f"logged MLflow run {run_id}")
    if runner.failures:
        raise ClusterProfileError(runner.failures, profile)
    return profile


def _posting(client: Any, job: str, init_batch_size: int, max_batch_size: int | None, model_size: int, previous: Profile,
             then: Callable[[str, list[Observation]], None] | None) -> Callable[[str, list[Observation]], None]:
    """Register ``job`` with the service (with its trainable parameters: a cluster prior's size slopes place its
    sync), post what ``out`` already held, and return the callback that posts each type's observations as they
    arrive (then calls ``then``)."""
    client.put_job(job, init_batch_size=init_batch_size, max_batch_size=max_batch_size, model_size=model_size or None)
    earlier = [o for o in previous.observations if o.job == job]
    if earlier:
        client.post_observations(job, earlier)

    def post(gpu_type: str, observations: list[Observation]) -> None:
        if observations:
            client.post_observations(job, observations)
        if then is not None:
            then(gpu_type, observations)

    return post


def _run_options(given: dict[str, Any]) -> dict[str, Any]:
    """``profile_job_options`` with :func:`profile_job`'s defaults for the rest (its signature is the one source)."""
    parameters = inspect.signature(profile_job).parameters
    for name in given:
        if name in _DECIDED_HERE:
            reason = {"devices": "profile_cluster profiles one node of each type; choose types with gpu_types",
                      "on_observation": "use on_observations(gpu_type, observations)"}.get(name, "set by profile_cluster itself")
            raise ValidationError(name, given[name], reason)
        if name not in parameters:
            known = ", ".join(p for p in parameters if p not in _DECIDED_HERE)
            raise ValidationError(name, given[name], f"not an option of profile_job (options: {known})")
    return {name: given.get(name, p.default) for name, p in parameters.items()
            if name not in _DECIDED_HERE and p.kind is p.KEYWORD_ONLY}


def _replicas(ctype: ClusterType, options: RunOptions) -> tuple[int, ...]:
    """Replica counts for ``ctype``: the asked ones its nodes can hold, else the default for a node of it."""
    capacity = ctype.gpus_per_node if ctype.is_cuda else ctype.cpus_per_node
    if options.replicas is None:
        return tuple(default_replicas(capacity, ctype.is_cuda))
    return tuple(r for r in options.replicas if r <= capacity)


# ---------------------------------------------------------------------------- on a node (a Ray actor)


def _node_device_type(task: TypeTask) -> Any:
    """This node's devices of the task's type, named as the cluster names the type."""
    from .devices import cpu_device_type, cuda_device_types

    if not task.is_cuda:
        return dataclasses.replace(cpu_device_type(), gpu_type=task.gpu_type)
    groups = cuda_device_types()  # Ray made the GPUs given to this task the visible ones
    if not groups:
        raise ValidationError("gpu_types", task.gpu_type, "Ray gave the task no CUDA device this torch can use "
                              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    same = [g for g in groups if g.gpu_type == task.gpu_type]
    chosen = same[0] if same else max(groups, key=lambda g: len(g.devices))
    return dataclasses.replace(chosen, gpu_type=task.gpu_type)


class NodeProfiler:
    """One type's profiling on one of its nodes: the body of a Ray actor (``ray.remote(NodeProfiler)``).

    :meth:`start` begins ``profile_job`` on the node's devices of the type in a thread and says where
    it runs; :meth:`poll` hands back the observations measured since the last call as they come
    (a long poll), then the type's facts once it is done, or raises what ``profile_job`` raised. An
    actor, not a streaming generator task, so that it works through Ray Client (``ray://``) too.
    ``prior`` (this type's records from the caller's ``out``) is written to a file here that
    ``profile_job`` resumes from, so what was measured before is not measured again.

    The worker process is fresh, so its first-call costs (torch imports ``torch._dynamo`` when the first
    optimizer is built: 1-2 s on this project's 2-core host) fall inside the type's time budget, before
    any timed step, as they do for ``profile_job`` in a fresh process: they cost that budget's
    measurements, not the caller's wall time.
    """

    def __init__(self, pieces: JobPieces, task: TypeTask, prior: Profile, settings: dict[str, Any]) -> None:
        self.pieces, self.task, self.prior, self.settings = pieces, task, prior, settings
        self.found: queue.Queue[Observation] = queue.Queue()
        self.outcome: dict[str, Any] = {}
        self.done = threading.Event()

    def start(self) -> dict[str, Any]:
        """Start profiling; return where: the Ray node id, the host name, the devices and their names."""
        import ray

        dtype = _node_device_type(self.task)
        thread = threading.Thread(target=self._work, args=(dtype,), name=f"profile {self.task.gpu_type}", daemon=True)
        thread.start()
        return {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
                "devices": list(dtype.devices), "names": list(dtype.names)}

    def _work(self, dtype: Any) -> None:
        try:
            with tempfile.TemporaryDirectory(prefix="goodput-cluster-") as folder:
                path = Path(folder) / "profile.jsonl"
                if len(self.prior) or self.prior.meta_dict():
                    self.prior.save(path)
                self.outcome["profile"] = profile_job(*self.pieces, devices=[dtype], replicas=list(self.task.replicas),
                                                      out=path, progress=False, on_observation=self.found.put, **self.settings)
        except BaseException as exc:  # noqa: BLE001 - raised to the caller by poll()
            self.outcome["error"] = exc
        finally:
            self.done.set()

    def poll(self, wait_s: float = 0.5) -> tuple[list[Observation], dict[str, Any] | None]:
        """``(observations since the last poll, None)`` while profiling (waiting up to ``wait_s`` seconds
        for the first), then ``(the last ones, facts)``; raises ``profile_job``'s error once it failed."""
        observations: list[Observation] = []
        deadline = time.monotonic() + wait_s
        while not observations and not self.done.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                observations.append(self.found.get(timeout=min(0.05, max(0.0, deadline - time.monotonic()))))
        finished = self.done.is_set()  # read before draining: nothing is put after it is set
        while True:
            try:
                observations.append(self.found.get_nowait())
            except queue.Empty:
                break
        if not finished:
            return observations, None
        if "error" in self.outcome:
            if observations:  # hand over what was measured first; the error comes with the next poll
                return observations, None
            raise self.outcome["error"]
        profile = self.outcome["profile"]
        return observations, {"max_local_bsz": profile.max_local_bsz.get(self.task.gpu_type),
                              "report": profile.metadata.get(f"profiler.{self.task.gpu_type}", {})}


# ---------------------------------------------------------------------------- here


class _Runner:
    """Starts an actor per type, writes what they send to ``out``, shows progress, gathers the profile."""

    def __init__(self, ray: Any, pieces: JobPieces, options: RunOptions, job_settings: dict[str, Any], previous: Profile,
                 out: Any, on_observations: Callable[[str, list[Observation]], None] | None, console: Any) -> None:
        self.ray, self.pieces, self.options, self.previous = ray, pieces, options, previous
        self.job, self.init_batch_size, self.max_batch_size = (job_settings[k] for k in ("job", "init_batch_size", "max_batch_size"))
        self.on_observations = on_observations
        self.console = console
        self.writer = ProfileWriter(out) if out is not None else None
        self.new: dict[str, list[Observation]] = {}  # per type, as they arrived
        self.arrived: list[Observation] = []  # all types, in the order they arrived (and went to out)
        self.limits: dict[str, int] = {}
        self.reports: dict[str, dict[str, Any]] = {}
        self.failures: dict[str, str] = {}
        self.where: dict[str, dict[str, Any]] = {}
        self.submitted: dict[str, float] = {}  # perf_counter when each type's task was submitted
        self.num_parameters: int | None = None
        self._bars: Any = None
        self._lines: dict[str, Any] = {}

    # ------------------------------------------------------------------ the file
    def meta(self, num_parameters: int) -> None:
        self.num_parameters = num_parameters
        if self.writer is not None:
            self.writer.write_meta(job=self.job, init_batch_size=self.init_batch_size,
                                   **({"max_batch_size": self.max_batch_size} if self.max_batch_size is not None else {}),
                                   metadata={"profiler": self.options.to_dict(), "num_parameters": num_parameters})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    # ------------------------------------------------------------------ the tasks
    def run(self, plans: list[tuple[ClusterType, tuple[int, ...]]]) -> None:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._bars = Progress(SpinnerColumn(finished_text="·"), TextColumn("[bold]{task.fields[gpu]:<12}[/]"),
                              TimeElapsedColumn(), TextColumn("{task.description}"), console=self.console,
                              disable=self.console is None)
        with self._bars:
            todo = []
            for ctype, replicas in plans:
                self._lines[ctype.gpu_type] = self._bars.add_task("", total=1, gpu=ctype.gpu_type)
                done = finished_report(self.previous, ctype.gpu_type, self.options.signature(list(replicas)))
                if done is not None:
                    kept = sum(o.gpu_type == ctype.gpu_type for o in self.previous.observations)
                    self._line(ctype.gpu_type, f"complete in {self.writer.path if self.writer else 'out'}: "
                               f"{kept} observations, not redone", finished=True)
                    continue
                todo.append((ctype, replicas))
            self._stream(todo)

    def _stream(self, todo: list[tuple[ClusterType, tuple[int, ...]]]) -> None:
        ray = self.ray
        if not todo:
            return
        # An actor per type: its own worker process, gone when killed after the type (the GPU memory, CUDA
        # context and threads of the profiling are freed); not restarted when it fails (a rerun resumes it).
        remote = ray.remote(max_restarts=0)(NodeProfiler)
        pieces = ray.put(self.pieces)  # shipped once (cloudpickle), shared by every type's actor
        settings = {"job": self.job, "init_batch_size": self.init_batch_size, "max_batch_size": self.max_batch_size,
                    "batch_sizes": self.options.grid, "time_budget_s": self.options.time_budget_s,
                    "memory_cap_bytes": self.options.memory_cap_bytes, "cpu_threads": self.options.cpu_threads,
                    **self.options.settings}
        actors: dict[str, Any] = {}
        calls: dict[Any, tuple[str, str]] = {}  # an outstanding call -> (its type, "start" or "poll")
        for ctype, replicas in todo:
            task = TypeTask(ctype.gpu_type, ctype.is_cuda, replicas)
            actor = remote.options(**ctype.task_options(replicas)).remote(pieces, task, self._prior(ctype.gpu_type), settings)
            actors[ctype.gpu_type] = actor
            calls[actor.start.remote()] = (ctype.gpu_type, "start")
            self.submitted[ctype.gpu_type] = time.perf_counter()
            self._line(ctype.gpu_type, "waiting for a node of this type")
        try:
            while calls:
                ready, _ = ray.wait(list(calls), num_returns=1)
                arrived: dict[str, list[Observation]] = {}
                for ref in ready:
                    gpu_type, kind = calls.pop(ref)
                    try:
                        value = ray.get(ref)
                    except ray.exceptions.RayError as exc:
                        self._failed(gpu_type, task_error(exc))
                        ray.kill(actors.pop(gpu_type))
                        continue
                    if kind == "start":
                        self.where[gpu_type] = {**value, "start_s": round(time.perf_counter() - self.submitted[gpu_type], 3)}
                        self._line(gpu_type, f"on {value['host']} ({', '.join(dict.fromkeys(value['names']))})")
                    else:
                        observations, facts = value
                        for obs in observations:
                            self._observed(gpu_type, obs)
                        if observations:
                            arrived[gpu_type] = observations
                        if facts is not None:
                            self._finished(gpu_type, facts)
                            ray.kill(actors.pop(gpu_type))
                            continue
                    calls[actors[gpu_type].poll.remote()] = (gpu_type, "poll")
                if self.on_observations is not None:
                    for gpu_type, observations in arrived.items():
                        self.on_observations(gpu_type, observations)
        finally:
            for actor in actors.values():
                ray.kill(actor)

    def _prior(self, gpu_type: str) -> Profile:
        """What ``out`` holds of this type, for its task to resume from."""
        report = self.previous.metadata.get(f"profiler.{gpu_type}")
        limit = self.previous.max_local_bsz.get(gpu_type)
        return Profile([o for o in self.previous.observations if o.job == self.job and o.gpu_type == gpu_type],
                       job=self.job, init_batch_size=self.init_batch_size, max_batch_size=self.max_batch_size,
                       max_local_bsz={gpu_type: limit} if limit else {},
                       metadata={f"profiler.{gpu_type}": report} if report else {})

    def _observed(self, gpu_type: str, obs: Observation) -> None:
        if self.writer is not None:
            self.writer.write(obs)
        seen = self.new.setdefault(gpu_type, [])
        seen.append(obs)
        self.arrived.append(obs)
        what = (f"b={obs.local_bsz}: {obs.step_time * 1e3:.3g} ms" if obs.num_replicas == 1 else
                f"{obs.num_replicas} replicas b={obs.local_bsz}: sync {(obs.sync_time or 0.0) * 1e3:.3g} ms")
        self._line(gpu_type, f"on {self.where.get(gpu_type, {}).get('host', '?')}: {len(seen)} observations, last {what}")

    def _finished(self, gpu_type: str, facts: dict[str, Any]) -> None:
        where = self.where.get(gpu_type, {})
        # where it ran, and what Ray cost: from submitting the task to its first message (a worker process, the
        # job unpickled there, which imports torch), and from submitting to the type's facts arriving here
        report = {**facts["report"], "node_id": where.get("node_id"), "host": where.get("host"),
                  "ray_start_s": where.get("start_s"),
                  "ray_wall_s": round(time.perf_counter() - self.submitted[gpu_type], 3)}
        self.reports[gpu_type] = report
        if facts["max_local_bsz"]:
            self.limits[gpu_type] = int(facts["max_local_bsz"])
        if self.writer is not None:
            self.writer.write_meta(**({"max_local_bsz": {gpu_type: self.limits[gpu_type]}} if gpu_type in self.limits else {}),
                                   metadata={f"profiler.{gpu_type}": report})
        self._line(gpu_type, f"done on {where.get('host', '?')}: {len(self.new.get(gpu_type, []))} observations "
                   f"in {report.get('seconds', 0.0):.1f} s", finished=True)

    def _failed(self, gpu_type: str, exc: BaseException) -> None:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.failures[gpu_type] = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        self._line(gpu_type, f"[red]failed[/]: {self.failures[gpu_type]}", finished=True)

    def _line(self, gpu_type: str, text: str, finished: bool = False) -> None:
        if self._bars is not None and gpu_type in self._lines:
            self._bars.update(self._lines[gpu_type], description=text, **({"completed": 1} if finished else {}))

    # ------------------------------------------------------------------ the result
    def profile(self) -> Profile:
        """Everything of the job, in ``out``'s order: its earlier observations, then the new ones as they arrived."""
        previous = self.previous
        observations = [o for o in previous.observations if o.job == self.job] + self.arrived
        metadata = {**previous.metadata, "profiler": self.options.to_dict(), "num_parameters": self.num_parameters}
        metadata.update({f"profiler.{gpu_type}": report for gpu_type, report in self.reports.items()})
        return Profile(observations, job=self.job, init_batch_size=self.init_batch_size,
                       max_batch_size=self.max_batch_size if self.max_batch_size is not None else previous.max_batch_size,
                       max_local_bsz={**previous.max_local_bsz, **self.limits}, metadata=metadata)
