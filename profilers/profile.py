"""``profile_job``: measure a training job on every device type and return its :class:`~goodput.Profile`.

For each device type (:mod:`profilers.devices`), within ``time_budget_s``
seconds of wall time (Sia, SOSP'23, bootstraps a job by profiling one GPU of
each type over ~10 batch sizes in under 20 GPU-seconds per type):

0. **Warm-up**: one untimed step on a fresh copy of the model, so that the
   process's first-call costs (torch imports ``torch._dynamo`` at the first
   optimizer; CUDA starts its context and loads its kernels: 4-6 s together
   on an H200 machine) are spent in the budget before the noise phase's share.
1. **Gradient noise** (≤ 15% of the budget): ``grad_sqr`` and ``grad_var`` at
   the reference batch M0 from real micro-batch gradients of a fresh copy of
   the model (:mod:`profilers.noise`).
2. **Batch-size sweep** (until 60% of the budget when replicas are profiled,
   else all of it): at each local batch size of the grid, ascending, a copy
   of the model reset to the initial weights and a fresh optimizer from the
   factory run real steps (forward, backward, optimizer step) on two batches
   of that size, so no size inherits the training of the ones before
   (carried over, repeating two batches can diverge to a NaN loss that is not
   the job's); warm-up steps are discarded and the median of the timed steps
   is the observation's ``step_time``, their
   standard deviation its ``step_time_std`` (:mod:`profilers.timing`). The
   sweep ends at the grid's end, at the first out-of-memory (CUDA's, or torch's
   CPU allocator refusing an allocation; the memory is released; not an error),
   at a CPU ``memory_cap_bytes`` (sizes measured by an earlier run over the cap
   included), or when the next size would not finish before the sweep's
   deadline. The largest size that ran is the type's ``max_local_bsz`` (the
   job's ``local_bsz_bounds`` upper limit in
   :meth:`goodput.JobModel.from_profile`): the memory limit when the sweep
   ended at an out-of-memory or the cap, else the largest size known to fit,
   so that a scheduler never proposes a size that was not seen to fit (the
   summary table says which). A rerun into the same ``out`` keeps an earlier
   run's larger size (a narrower grid does not shrink it) unless its own sweep
   hit out-of-memory or the cap at or below that size.
3. **Synchronisation** (the rest of the budget): ``replicas`` DDP processes
   per replica count, at up to ``sync_sizes`` local batch sizes of the sweep
   (:mod:`profilers.sync`), each size again from the initial weights and a
   fresh optimizer; observations with ``num_replicas > 1`` and their
   ``sync_time``.

The gradient statistics ride on the single-replica observation at M0 (or, if
M0 was not reached, on one more observation timed at the largest size that ran).
The caller's random generators (torch's, Python's and numpy's) are left as they
were: training after ``profile_job`` stays reproducible from its seed.

Every observation is appended to ``out`` (JSON Lines, fsync per record) the
moment it is measured; rerunning with the same ``out`` skips configurations
already there and device types already finished. A model that fails raises
:class:`~profilers.errors.ModelFailureError` naming the device type and batch.

Example::

    from profilers import profile_job, zoo
    work = zoo.get("mlp")
    profile = profile_job(**work.profile_args(), out="mlp.jsonl", time_budget_s=20)
    JobModel.from_profile(profile).table(Cluster.parse("cpu:2x2"))
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput.errors import ValidationError
from goodput.observations import Observation, Profile, ProfileWriter
from goodput.validation import check_float, check_int, check_str

from .devices import DeviceType, resolve_devices
from .type_run import JobPieces, ProgressBars, Sink, TypeReport, TypeRun

__all__ = ["profile_job", "default_grid", "default_replicas", "trainable_parameters", "check_run_options",
           "RunOptions", "check_job_pieces", "finished_report", "load_previous", "TypeReport"]


def default_grid(init_batch_size: int, max_batch_size: int | None = None, min_local_bsz: int | None = None, points: int = 12) -> list[int]:
    """Local batch sizes to sweep: ``points`` doublings from ``min_local_bsz`` (default M0 // 16), plus M0.

    Capped at ``max_batch_size`` (one replica never needs more). The sweep
    stops earlier where memory or the time budget runs out.

    >>> default_grid(64)
    [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    >>> default_grid(100, max_batch_size=400)
    [6, 12, 24, 48, 96, 100, 192, 384]
    """
    init_batch_size = check_int("init_batch_size", init_batch_size, minimum=1)
    low = max(1, init_batch_size // 16) if min_local_bsz is None else check_int("min_local_bsz", min_local_bsz, minimum=1)
    grid = {low * 2**k for k in range(check_int("points", points, minimum=1))} | {init_batch_size}
    if max_batch_size is not None:
        max_batch_size = check_int("max_batch_size", max_batch_size, minimum=1)
        grid = {b for b in grid if b <= max_batch_size} or {min(low, max_batch_size)}
    return sorted(grid)


def trainable_parameters(model: Any) -> int:
    """Elements of ``model``'s trainable parameters: the gradient that every step synchronises.

    Data-parallel gradient sync moves these (Horovod and DDP all-reduce every
    ``requires_grad`` parameter), so its cost grows with them; the profile records the
    count as ``metadata["num_parameters"]`` and :meth:`goodput.JobModel.from_profile`
    scales other jobs' sync costs by it (``model_size``).
    """
    return int(sum(p.numel() for p in model.parameters() if p.requires_grad))



# ---------------------------------------------------------------------------- validation


def _check_sizes(field_name: str, values: Any) -> list[int] | None:
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValidationError(field_name, values, "expected a list of positive integers")
    sizes = sorted({check_int(field_name, v, minimum=1) for v in values})
    if not sizes:
        raise ValidationError(field_name, values, "must not be empty")
    return sizes


def _check_replicas(values: Any) -> list[int] | None:
    if values is None:
        return None
    if isinstance(values, int) and not isinstance(values, bool):
        values = [values]
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValidationError("replicas", values, "expected replica counts >= 2, e.g. [2, 4]")
    counts = sorted({check_int("replicas", v, minimum=2) for v in values})
    return counts


def default_replicas(devices: int, cuda: bool) -> list[int]:
    """Replica counts profiled by default: powers of two from 2 up to ``devices`` GPUs of one type
    (CUDA), or 2 on a host with >= 2 cores (``devices``: its cores)."""
    if cuda:
        counts, r = [], 2
        while r <= devices:
            counts.append(r)
            r *= 2
        return counts
    return [2] if devices >= 2 else []


@dataclass(frozen=True)
class RunOptions:
    """:func:`profile_job`'s settings of one run, checked (the same for every device type).

    Attributes:
        grid: local batch sizes to sweep, ascending.
        replicas: replica counts for synchronisation, or ``None`` for each type's default.
        time_budget_s: wall seconds per device type.
        memory_cap_bytes: the step-memory cap, or ``None``.
        cpu_threads: intra-op threads of CPU replicas, or ``None`` for the default.
        settings: ``warmup``, ``min_steps``, ``max_steps``, ``noise_rounds``, ``sync_sizes``.
    """

    grid: list[int]
    replicas: list[int] | None
    time_budget_s: float
    memory_cap_bytes: int | None
    cpu_threads: int | None
    settings: dict[str, int]

    def signature(self, replicas: list[int]) -> dict[str, Any]:
        """What a device type's run is compared on to resume it: a type finished under the same is not redone."""
        return {"grid": self.grid, "replicas": list(replicas), "memory_cap_bytes": self.memory_cap_bytes,
                "time_budget_s": self.time_budget_s, "sync_sizes": self.settings["sync_sizes"]}

    def to_dict(self) -> dict[str, Any]:
        """The settings recorded in a profile's ``metadata["profiler"]``."""
        return {"time_budget_s": self.time_budget_s, "grid": self.grid, "replicas": self.replicas,
                "memory_cap_bytes": self.memory_cap_bytes, **self.settings}


def check_run_options(init_batch_size: int, *, max_batch_size: int | None, batch_sizes: Iterable[int] | None,
                      min_local_bsz: int | None, time_budget_s: float, replicas: int | Iterable[int] | None,
                      memory_cap_bytes: int | None, cpu_threads: int | None, warmup: int, min_steps: int,
                      max_steps: int, noise_rounds: int, sync_sizes: int) -> RunOptions:
    """:func:`profile_job`'s per-run arguments checked (:class:`~goodput.errors.ValidationError` naming a bad one)."""
    time_budget_s = check_float("time_budget_s", time_budget_s, positive=True)
    if memory_cap_bytes is not None:
        memory_cap_bytes = check_int("memory_cap_bytes", memory_cap_bytes, minimum=1)
    grid = _check_sizes("batch_sizes", batch_sizes) or default_grid(init_batch_size, max_batch_size, min_local_bsz)
    if max_batch_size is not None and grid[-1] > check_int("max_batch_size", max_batch_size, minimum=1):  # a given list
        # a local batch above the largest total batch is one the job never runs (it had been swept and reported as
        # the type's max_local_bsz; found in review)
        raise ValidationError("batch_sizes", grid[-1], f"above max_batch_size ({max_batch_size}): a local batch the "
                              "job never runs")
    if replicas == 0:
        replicas = []
    if cpu_threads is not None:
        cpu_threads = check_int("cpu_threads", cpu_threads, minimum=1)
    settings = {
        "warmup": check_int("warmup", warmup, minimum=1),
        "min_steps": check_int("min_steps", min_steps, minimum=1),
        "max_steps": check_int("max_steps", max_steps, minimum=min_steps),
        "noise_rounds": check_int("noise_rounds", noise_rounds, minimum=1),
        "sync_sizes": check_int("sync_sizes", sync_sizes, minimum=0),
    }
    return RunOptions(grid, _check_replicas(replicas), time_budget_s, memory_cap_bytes, cpu_threads, settings)


def check_job_pieces(model: Any, optimizer_factory: Any, loss_fn: Any, make_batch: Any) -> None:
    """A job's pieces as :func:`profile_job` takes them: a ``torch.nn.Module`` and three callables
    (:class:`~goodput.errors.ValidationError` naming the first that is not)."""
    for name, fn in (("optimizer_factory", optimizer_factory), ("loss_fn", loss_fn), ("make_batch", make_batch)):
        if not callable(fn):
            raise ValidationError(name, fn, "expected a callable")
    import torch

    if not isinstance(model, torch.nn.Module):
        raise ValidationError("model", model, "expected a torch.nn.Module")


def finished_report(previous: Profile, gpu_type: str, signature: dict[str, Any]) -> dict[str, Any] | None:
    """The report of ``gpu_type`` in ``previous`` (a profile read from ``out``) if its run finished with
    ``signature``'s settings (then a rerun has nothing to add), else ``None``."""
    done = previous.metadata.get(f"profiler.{gpu_type}", {})
    return done if done.get("complete") and done.get("signature") == signature else None


# ---------------------------------------------------------------------------- the public function


def profile_job(
    model: Any,
    optimizer_factory: Callable[[Any], Any],
    loss_fn: Callable[[Any, Any], Any],
    make_batch: Callable[[int, Any], Any],
    *,
    job: str,
    init_batch_size: int,
    max_batch_size: int | None = None,
    devices: Any = None,
    batch_sizes: Iterable[int] | None = None,
    min_local_bsz: int | None = None,
    time_budget_s: float = 20.0,
    replicas: int | Iterable[int] | None = None,
    out: str | os.PathLike[str] | None = None,
    progress: bool = True,
    memory_cap_bytes: int | None = None,
    mlflow: bool = False,
    cpu_threads: int | None = None,
    warmup: int = 2,
    min_steps: int = 3,
    max_steps: int = 100,
    noise_rounds: int = 8,
    sync_sizes: int = 3,
    console: Any = None,
    on_observation: Callable[[Observation], None] | None = None,
) -> Profile:
    """Profile a training job on every device type; return its :class:`~goodput.Profile`.

    Args:
        model: the ``torch.nn.Module`` (left untouched: each device type gets a deep copy).
        optimizer_factory: ``optimizer_factory(params) -> Optimizer``, called per copy.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``, the mean loss of the
            batch, computed by calling ``model`` (so DDP sees the forward pass).
        make_batch: ``make_batch(batch_size, device) -> batch`` for ``loss_fn``.
        job: the job's name.
        init_batch_size: the reference batch M0, samples.
        max_batch_size: the largest total batch the job tolerates; caps the grid.
        devices: ``None`` (every CUDA type present, else the CPU) or names, see
            :func:`profilers.devices.resolve_devices`.
        batch_sizes: local batch sizes to sweep (default :func:`default_grid`).
        min_local_bsz: smallest size of the default grid (default M0 // 16).
        time_budget_s: wall seconds per device type (default 20, Sia's bootstrap budget).
            A target, not a hard limit: a size is started only when its predicted
            cost fits, but the first size of each phase always runs, spawning the
            replicas is not bounded, and replicas still running at the deadline are
            stopped after a grace period (``experiments/bench_profiler.py`` measures
            the real cost: 14–15 s for the zoo on 2 CPU cores).
        replicas: replica counts for synchronisation profiling; ``None``:
            powers of two up to the GPUs of each type (CUDA), 2 on a CPU host
            with >= 2 cores; ``[]`` or ``0``: none.
        out: a JSON Lines path; observations are appended as they are
            measured and a rerun resumes from it.
        progress: show a progress bar per device type and a summary table.
        memory_cap_bytes: the sweep ends at the first size whose step memory
            (the CPU estimate or the CUDA peak, :mod:`profilers.memory`) would
            exceed this: predicted by linear extrapolation from the two sizes
            before it (then not run), or measured (then not recorded).
        mlflow: log the profile as an MLflow run (:func:`profilers.tracking.log_profile`).
        cpu_threads: intra-op threads of each CPU replica (and of the
            single-replica sweep, so compute matches); default: cores // largest replica count.
            On a host shared with other work, 1 is safer: OpenMP threads that
            wait for a descheduled peer stall a step by a scheduler slice.
        warmup, min_steps, max_steps: discarded and timed steps per configuration.
        noise_rounds: at most this many rounds of the gradient-noise estimate.
        sync_sizes: local batch sizes measured per replica count.
        console: a ``rich.console.Console`` for progress and the summary.
        on_observation: called with each new :class:`~goodput.Observation` the
            moment it is measured (after it is on disk in ``out``), e.g. to stream
            it elsewhere; an exception it raises stops the profiling.

    Returns:
        The profile: every observation of this job in ``out`` (earlier runs
        included) and those just measured, with ``max_local_bsz`` per type and
        per-type facts under ``metadata["profiler.<type>"]``, and the trainable
        parameter count under ``metadata["num_parameters"]``.

    Raises:
        ValidationError: a bad argument (names it).
        ModelFailureError: the model failed (names the device type and batch size).

    Warns:
        RuntimeWarning: a device type measured nothing (out of memory at the smallest batch, or
            ``memory_cap_bytes`` below it); its summary row and ``metadata["profiler.<type>"]`` say why.
    """
    _refuse_in_bootstrapping_replica()
    job = check_str("job", job)
    init_batch_size = check_int("init_batch_size", init_batch_size, minimum=1)
    if max_batch_size is not None:
        max_batch_size = check_int("max_batch_size", max_batch_size, minimum=init_batch_size)
    check_job_pieces(model, optimizer_factory, loss_fn, make_batch)
    if on_observation is not None and not callable(on_observation):
        raise ValidationError("on_observation", on_observation, "expected a callable or None")
    options = check_run_options(
        init_batch_size, max_batch_size=max_batch_size, batch_sizes=batch_sizes, min_local_bsz=min_local_bsz,
        time_budget_s=time_budget_s, replicas=replicas, memory_cap_bytes=memory_cap_bytes, cpu_threads=cpu_threads,
        warmup=warmup, min_steps=min_steps, max_steps=max_steps, noise_rounds=noise_rounds, sync_sizes=sync_sizes)
    grid, replica_counts, time_budget_s = options.grid, options.replicas, options.time_budget_s
    memory_cap_bytes, cpu_threads, settings = options.memory_cap_bytes, options.cpu_threads, options.settings
    types = resolve_devices(devices)
    for dtype in types:
        for r in replica_counts or []:
            if r > dtype.count:
                what = f"{dtype.gpu_type} devices" if dtype.is_cuda else "CPU cores"
                raise ValidationError("replicas", r, f"more replicas than {what} ({dtype.count})")
    if progress and console is None:
        console = _console()

    run_settings = options.to_dict()
    num_parameters = trainable_parameters(model)
    previous = load_previous(out, job, init_batch_size)
    writer = ProfileWriter(out) if out is not None else None
    sink = Sink(writer, on_observation)
    try:
        sink.meta(
            job=job,
            init_batch_size=init_batch_size,
            **({"max_batch_size": max_batch_size} if max_batch_size is not None else {}),
            metadata={"profiler": run_settings, "num_parameters": num_parameters},
        )
        existing = [o for o in (writer.existing if writer else []) if o.job == job]
        reports: dict[str, TypeReport] = {}
        with ProgressBars(progress, console) as bar, _caller_random_state_kept(types):
            for dtype in types:
                counts = replica_counts if replica_counts is not None else default_replicas(dtype.count, dtype.is_cuda)
                signature = options.signature(counts)
                done = finished_report(previous, dtype.gpu_type, signature)
                if done is not None:
                    # Finished earlier with the same settings: nothing to add.
                    known = {k: v for k, v in done.items() if k in TypeReport.__dataclass_fields__}
                    reports[dtype.gpu_type] = TypeReport(**{**known, "resumed": sum(o.gpu_type == dtype.gpu_type for o in existing)})
                    continue
                run = TypeRun(
                    dtype, JobPieces(model, optimizer_factory, loss_fn, make_batch), job=job, init_batch_size=init_batch_size,
                    grid=grid, budget=time_budget_s, replicas=counts, memory_cap=memory_cap_bytes,
                    cpu_threads=cpu_threads, settings=settings, sink=sink, bar=bar,
                    existing=[o for o in existing if o.gpu_type == dtype.gpu_type],
                )
                run.report.signature = signature
                report = run.run()
                earlier = previous.metadata.get(f"profiler.{dtype.gpu_type}")
                if report.grad is None and isinstance(earlier, dict) and earlier.get("grad"):
                    report.grad = earlier["grad"]  # resumed: the noise measured before still stands
                reports[dtype.gpu_type] = report
                limit = _max_local_bsz(previous.max_local_bsz.get(dtype.gpu_type), report)
                sink.meta(
                    **({"max_local_bsz": {dtype.gpu_type: limit}} if limit else {}),
                    metadata={f"profiler.{dtype.gpu_type}": report.to_dict()},
                )
    finally:
        if writer is not None:
            writer.close()

    max_local = dict(previous.max_local_bsz)
    metadata = dict(previous.metadata)
    for gpu, report in reports.items():
        limit = _max_local_bsz(previous.max_local_bsz.get(gpu), report)
        if limit:
            max_local[gpu] = limit
        metadata[f"profiler.{gpu}"] = report.to_dict()
    metadata["profiler"] = run_settings
    metadata["num_parameters"] = num_parameters
    profile = Profile(
        existing + sink.new,
        job=job,
        init_batch_size=init_batch_size,
        max_batch_size=max_batch_size if max_batch_size is not None else previous.max_batch_size,
        max_local_bsz=max_local,
        metadata=metadata,
    )
    for gpu, report in reports.items():
        if not any(o.gpu_type == gpu for o in profile.observations):
            warnings.warn(f"profile_job: nothing measured on {gpu} ({report.sweep_stopped or 'no step completed'}); "
                          "the profile holds no observations of it", RuntimeWarning, stacklevel=2)
    if progress:
        from .summary import summary_table

        console.print(summary_table(profile, reports))
    if mlflow:
        from .tracking import log_profile

        run_id = log_profile(profile, path=out)
        if progress:
            console.print(f"logged MLflow run {run_id}")
    return profile


def _console() -> Any:
    """A rich console; a wide page when output is not a terminal (logs, pipes), not 80 columns."""
    import shutil
    import sys

    from rich.console import Console

    width = None if sys.stdout.isatty() else max(shutil.get_terminal_size((160, 24)).columns, 160)
    return Console(width=width)


@contextlib.contextmanager
def _caller_random_state_kept(types: Iterable[DeviceType]) -> Iterator[None]:
    """Restore torch's (CPU and the profiled CUDA devices'), Python's and numpy's global generators afterwards.

    Profiling draws batches, dropout masks and initial noise from the global
    generators; a caller's training after ``profile_job`` stays reproducible
    from its seed.
    """
    import random

    import numpy as np
    import torch

    cuda = sorted({int(d.split(":")[1]) if ":" in d else 0 for t in types if t.is_cuda for d in t.devices})
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _refuse_in_bootstrapping_replica() -> None:
    """A spawned replica re-imports the caller's script as ``__mp_main__``; an unguarded call lands here."""
    import multiprocessing
    import sys

    main = sys.modules.get("__main__")
    if multiprocessing.parent_process() is not None and getattr(main, "__name__", None) == "__mp_main__":
        raise RuntimeError(
            "profile_job was called while a spawned replica imported the main script: "
            "call it under `if __name__ == \"__main__\":` (replicas are started with the spawn method)"
        )


def _max_local_bsz(previous: int | None, report: TypeReport) -> int | None:
    """A type's largest local batch known to fit after this run: ``report``'s, or ``previous`` where larger.

    An earlier run's size ran, so a narrower grid (or a shorter budget) this
    time does not shrink it; only a sweep that hit a memory limit (out of
    memory, or the cap) at or below it makes this run's tighter size the one.
    """
    new = report.max_local_bsz
    if previous is None or new is None:
        return new if new is not None else previous
    if report.sweep_stopped in ("oom", "memory_cap"):
        stop = _sweep_stop_size(report)
        if stop is None or stop <= previous:
            return new
    return max(previous, new)


def _sweep_stop_size(report: TypeReport) -> int | None:
    """The grid size the sweep stopped at (it runs the grid in order, each size measured or resumed), or None."""
    done = len(report.measured)
    return report.grid[done] if done < len(report.grid) else None


def load_previous(out: Any, job: str, init_batch_size: int) -> Profile:
    """What ``out`` holds of ``job`` (an empty profile when there is no file), checked against ``job`` and M0."""
    if out is None or not Path(out).exists():
        return Profile()
    if Path(out).is_dir():
        raise ValidationError("out", str(out), "is a directory; expected the path of a .jsonl file")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torn tail is cut (and warned about) by ProfileWriter
        previous = Profile.load(out)
    if previous.job_meta:  # a file of several jobs: this job's own settings
        previous = previous.select(job=job)
    if previous.job is not None and previous.job != job:
        raise ValidationError("out", str(out), f"holds a profile of job {previous.job!r}, not {job!r}")
    if previous.init_batch_size is not None and previous.init_batch_size != init_batch_size:
        # grad_var is stored relative to M0: statistics measured for another M0 would be misread.
        raise ValidationError("init_batch_size", init_batch_size,
                              f"{out} was profiled with init_batch_size={previous.init_batch_size}; use another out")
    return previous
