"""Synchronisation profiling: real ``torch.distributed`` replicas running DistributedDataParallel.

:func:`profile_sync` spawns ``num_replicas`` processes with
``torch.multiprocessing`` (start method ``spawn``), joined by a file store:
gloo on the CPU (each process limited to ``threads`` intra-op threads so that
replicas don't thrash a small host), NCCL across GPUs of one type (one process
per GPU). Every process wraps its own copy of the job's model in
``DistributedDataParallel`` and trains on its own batches, each batch size
from the initial weights with a fresh optimizer.

What is measured, per local batch size, in the same processes (so with the same
threads and the same devices):

* ``step_time``: median seconds of a synchronised DDP step (forward, backward
  with its bucketed all-reduce, optimizer step), as rank 0 sees it;
* ``compute_time``: median seconds of the same step under ``DDP.no_sync()``
  (no communication), the slowest rank's median;
* ``sync_time = clip(step_time − compute_time, 0, step_time)``: the part of the
  step spent on gradient synchronisation that compute did not hide — DESIGN.md's
  ``sync_time``, Pollux's T_sync seen through its overlap with T_accum.

The two kinds of step are interleaved (local, synchronised, local, …) so slow
drifts of the machine affect both alike. Warm-up steps of both kinds are
discarded. Rank 0 decides, and broadcasts, whether to start another batch size
(``deadline``; the first size always runs) and how many steps to time, so every
rank runs the same collectives.

The job's pieces cross process boundaries by pickling: the model by torch's
pickler (its tensors in shared memory, one copy for all replicas), the optimizer
factory, ``loss_fn`` and ``make_batch`` by cloudpickle, as Ray ships functions, so
lambdas and closures work too (what they capture must pickle); ``loss_fn`` must
run the forward pass by calling the model it is given.

Example::

    outcome = profile_sync(pieces, ["cpu"], num_replicas=2, sizes=[8, 32], gpu_type="cpu",
                           deadline=time.time() + 10, threads=1, on_result=print)
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import pickle
import queue as queue_module
import shutil
import signal
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SyncResult", "SyncOutcome", "profile_sync"]


@dataclass(frozen=True)
class SyncResult:
    """One synchronised configuration's measurements (seconds, bytes).

    Attributes:
        num_replicas: data-parallel processes.
        local_bsz: samples per replica per step.
        step_time: median seconds of a synchronised step (rank 0).
        step_time_std: sample standard deviation of those steps.
        compute_time: median seconds of a step without synchronisation (slowest rank).
        sync_time: ``clip(step_time - compute_time, 0, step_time)``.
        memory_bytes: peak memory of rank 0's step (CUDA allocator peak, or the
            CPU estimate of :mod:`profilers.memory`).
        steps: synchronised steps timed.
    """

    num_replicas: int
    local_bsz: int
    step_time: float
    step_time_std: float
    compute_time: float
    sync_time: float
    memory_bytes: int
    steps: int


@dataclass
class SyncOutcome:
    """How a synchronisation run ended: ``stopped`` is ``"done"``, ``"time_budget"`` or ``"oom"``."""

    results: list[SyncResult] = field(default_factory=list)
    stopped: str = "done"
    seconds: float = 0.0


def sync_time_of(step_time: float, compute_time: float) -> float:
    """``clip(step_time - compute_time, 0, step_time)``: synchronisation not hidden behind compute, seconds."""
    return float(min(max(step_time - compute_time, 0.0), step_time))


# ---------------------------------------------------------------------------- worker (child process)


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    backend: str,
    devices: Sequence[str],
    payload: tuple[Any, bytes],
    sizes: Sequence[int],
    settings: dict[str, Any],
    results: Any,
) -> None:
    """One replica. Reports ``("result", dict)``, ``("stopped", reason)``, ``("oom", bsz)``,
    ``("error", bsz, text, traceback)`` and finally ``("done",)`` (rank 0) on ``results``."""
    current = 0
    try:
        import torch

        if backend == "gloo":
            torch.set_num_threads(int(settings["threads"]))
        import datetime

        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        device = torch.device(devices[rank])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=float(settings["collective_timeout_s"])),
        )
        model, functions = payload
        optimizer_factory, loss_fn, make_batch = pickle.loads(functions)
        # Spawning pickled the model's CPU tensors into shared memory, one copy for all replicas. They
        # stay the initial state each size starts from (read only, with a fresh optimizer, as the
        # sweep's sizes do); each replica trains its own copy, as DDP replicas do: stepping the shared
        # weights, the replicas would race, at world_size × the learning rate.
        initial = {name: value.detach() for name, value in model.state_dict().items()}
        model = model.to(device) if device.type == "cuda" else copy.deepcopy(model)
        model.train()
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      find_unused_parameters=bool(settings["find_unused_parameters"]))
        _run_sizes(rank, ddp, optimizer_factory, initial, loss_fn, make_batch, device, sizes, settings, results, dist)
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            results.put(("done",))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        current = getattr(exc, "_profiler_bsz", current)
        from .memory import is_out_of_memory

        if is_out_of_memory(exc):
            results.put(("oom", current))
        else:
            text = f"{type(exc).__name__}: {exc}"
            results.put(("error", current, text, "".join(traceback.format_exception(exc))[-4000:]))
    # Flush the messages, then leave without the interpreter's slow teardown (torch, gloo threads):
    # everything this process measured has been sent.
    results.close()
    results.join_thread()
    os._exit(0)


def _run_sizes(
    rank: int,
    ddp: Any,
    optimizer_factory: Any,
    initial: dict[str, Any],
    loss_fn: Any,
    make_batch: Any,
    device: Any,
    sizes: Sequence[int],
    settings: dict[str, Any],
    results: Any,
    dist: Any,
) -> None:
    """Measure every size in turn (all ranks run the same collectives); rank 0 reports.

    Every size starts from the ``initial`` weights (a state dict) with a fresh
    optimizer from ``optimizer_factory``: the steps repeat two batches, and
    training carried from size to size could diverge.
    """
    import torch

    from .memory import CpuStepMemory, cuda_peak, reset_cuda_peak
    from .timing import StepClock

    cuda = device.type == "cuda"
    control = torch.zeros(2, dtype=torch.float64, device=device)
    for index, bsz in enumerate(sizes):
        try:
            if rank == 0:
                # Start a size only if its warm-up and minimum timed steps should end before the deadline
                # (from the single-replica step time where known; DDP adds its synchronisation on top).
                # The first (smallest) size always runs once the replicas are up, as the sweep's first
                # size does: a slow start-up must not leave the replicas with nothing measured.
                estimate = settings["estimates"].get(int(bsz), 0.0)
                cost = 1.25 * estimate * (int(settings["warmup"]) + 1 + 2 * int(settings["min_steps"]))
                control[0] = 1.0 if index == 0 or time.time() + cost < settings["deadline"] else 0.0
            dist.broadcast(control, 0)
            if control[0].item() == 0.0:
                if rank == 0:
                    results.put(("stopped", "time_budget"))
                return
            optimizer = None  # the previous size's optimizer state is freed first
            ddp.module.load_state_dict(initial)
            optimizer = optimizer_factory(ddp.parameters())
            batches = [make_batch(bsz, device) for _ in range(2)]
            losses: list[Any] = []
            meter = CpuStepMemory() if (rank == 0 and not cuda) else None

            def step(sync: bool, i: int, measure_memory: bool = False) -> None:
                optimizer.zero_grad(set_to_none=True)
                batch = batches[i % 2]
                # DDP broadcasts buffers (BatchNorm statistics) in a forward pass when the *previous* one
                # synchronised; with local and synchronised steps interleaved, the broadcast would be timed
                # in the local steps. Training synchronises every step, so its sync steps pay for it.
                ddp.require_forward_param_sync = sync
                with contextlib.ExitStack() as stack:
                    if not sync:
                        stack.enter_context(ddp.no_sync())
                    if measure_memory:
                        stack.enter_context(meter.forward(ddp.module, batch))
                        loss = loss_fn(ddp, batch)
                    else:
                        loss = loss_fn(ddp, batch)
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
                    loss.backward()
                optimizer.step()
                losses.append(loss.detach())

            if cuda:
                reset_cuda_peak(device)
            # Warm-up, discarded: synchronised steps (the first one measures CPU memory), then a local one.
            warm_start = time.perf_counter()
            for i in range(int(settings["warmup"])):
                step(True, i, measure_memory=(meter is not None and i == 0))
            step(False, 0)
            if cuda:
                torch.cuda.synchronize(device)
            warm = (time.perf_counter() - warm_start) / (int(settings["warmup"]) + 1)
            if rank == 0:
                pair = max(2.0 * warm, 1e-6)
                planned = math.ceil(float(settings["target_seconds"]) / pair)
                left = (settings["deadline"] - time.time()) / pair
                planned = min(planned, max(int(settings["min_steps"]), int(left)))
                control[1] = float(min(int(settings["max_steps"]), max(int(settings["min_steps"]), planned)))
            dist.broadcast(control, 0)
            steps = int(control[1].item())
            clock = StepClock(device)
            for i in range(steps):
                with clock.measure("local"):
                    step(False, i)
                with clock.measure("sync"):
                    step(True, i + 1)
            synced = clock.samples("sync")
            local = clock.samples("local")
            if not bool(torch.isfinite(torch.stack([loss.float().reshape(()) for loss in losses])).all()):
                raise FloatingPointError("non-finite loss")
            compute = torch.tensor([statistics.median(local)], dtype=torch.float64, device=device)
            dist.all_reduce(compute, op=dist.ReduceOp.MAX)  # the slowest rank's compute bounds the step
            if rank == 0:
                step_time = float(statistics.median(synced))
                memory = cuda_peak(device) if cuda else meter.total(ddp.module, optimizer, batches[0])
                results.put((
                    "result",
                    {
                        "local_bsz": int(bsz),
                        "step_time": step_time,
                        "step_time_std": float(statistics.stdev(synced)) if len(synced) > 1 else 0.0,
                        "compute_time": float(compute.item()),
                        "sync_time": sync_time_of(step_time, float(compute.item())),
                        "memory_bytes": int(memory),
                        "steps": len(synced),
                    },
                ))
            batches.clear()  # free the inputs before the next size allocates its own
            losses.clear()
        except BaseException as exc:
            exc._profiler_bsz = bsz  # type: ignore[attr-defined]
            raise


# ---------------------------------------------------------------------------- parent


def _payload(pieces: tuple[Any, Any, Any, Any]) -> tuple[Any, bytes]:
    """``(model, the three callables cloudpickled)``: what each replica receives.

    The callables go by value where they are not importable (lambdas, closures, functions
    of ``__main__``), as Ray ships functions; the model is left to torch's pickler, which
    puts its tensors in shared memory. Raises :class:`~goodput.errors.ValidationError`
    naming what does not pickle, before any process is spawned.
    """
    import cloudpickle

    from goodput.errors import ValidationError

    model, *functions = pieces
    for name, piece in (("model", model), ("optimizer_factory, loss_fn, make_batch", functions)):
        try:
            packed = pickle.dumps(piece) if name == "model" else cloudpickle.dumps(tuple(piece))
        except Exception as exc:  # noqa: BLE001 - any pickling failure means the same thing
            raise ValidationError(
                "replicas",
                "sync profiling",
                f"spawned replicas receive the job by pickling, and the {name} did not pickle "
                f"(what a lambda or closure captures must pickle too): {type(exc).__name__}: {exc}",
            ) from None
    return model, packed


def _death(rank: int, code: int) -> str:
    """Why replica ``rank`` ended with exit code ``code``, in words."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"replica {rank} died (killed by {name}: the host's OOM killer, or a signal from outside)"
    return (f"replica {rank} died (exit code {code}); see its output above. A script that calls profile_job must do "
            "so under `if __name__ == \"__main__\":` (replicas are spawned)")


def _killed_replica(procs: Sequence[Any], wait_s: float = 1.0) -> tuple[int, int] | None:
    """(rank, exit code) of a replica killed by a signal, waiting up to ``wait_s`` for one to show; ``None``.

    A replica whose model raised reports it and exits by itself (exit code 0 or 1): only a signal says
    that the process was ended from outside."""
    end = time.monotonic() + wait_s
    while True:
        for rank, proc in enumerate(procs):
            if proc.exitcode is not None and proc.exitcode < 0:
                return rank, proc.exitcode
        if time.monotonic() >= end:
            return None
        time.sleep(0.05)


def profile_sync(
    pieces: tuple[Any, Any, Any, Any],
    devices: Sequence[str],
    num_replicas: int,
    sizes: Sequence[int],
    *,
    gpu_type: str,
    deadline: float,
    threads: int = 1,
    warmup: int = 2,
    min_steps: int = 3,
    max_steps: int = 30,
    target_seconds: float = 1.0,
    on_result: Callable[[SyncResult], None] | None = None,
    estimates: dict[int, float] | None = None,
    grace_s: float = 20.0,
    find_unused_parameters: bool = False,
) -> SyncOutcome:
    """Measure synchronised steps of ``num_replicas`` DDP processes at each local batch size.

    Args:
        pieces: ``(model, optimizer_factory, loss_fn, make_batch)``; the model
            is copied to each process (pickled), so the caller's is untouched.
        devices: ``["cpu"]`` (gloo; every replica on the host) or the CUDA
            devices of one type, one per replica (NCCL).
        num_replicas: processes, >= 2.
        sizes: local batch sizes, ascending.
        gpu_type: the device type, for error messages.
        deadline: a ``time.time()`` value; no batch size after the first starts
            unless its minimum steps should end before it.
        threads: intra-op threads of each CPU replica.
        warmup, min_steps, max_steps, target_seconds: as in :func:`profilers.timing.time_steps`.
        on_result: called in this process with each :class:`SyncResult` as soon as it arrives.
        estimates: seconds of a single-replica step per local batch size; a
            size whose warm-up and minimum steps would end past ``deadline`` is
            not started (the run stops there, ``"time_budget"``).
        grace_s: processes still running this long past ``deadline`` are killed.
        find_unused_parameters: DDP's option of that name, for a model some of whose trainable
            parameters get no gradient (without it, DDP fails at the second step).

    Raises:
        ModelFailureError: a replica failed (names the device type and batch size).
        ValidationError: ``devices`` is not a list of device names (a bare ``"cpu"``), holds fewer CUDA
            devices than replicas, or ``num_replicas`` is below 2.
    """
    import torch.multiprocessing as mp

    from goodput.errors import ValidationError
    from goodput.validation import check_int

    from .errors import ModelFailureError

    num_replicas = check_int("num_replicas", num_replicas, minimum=2)
    if isinstance(devices, str) or not devices or not all(isinstance(d, str) for d in devices):
        raise ValidationError("devices", devices, 'expected a list of device names: ["cpu"] or CUDA devices, one per replica')
    cpu = devices[0] == "cpu"
    if not cpu and len(devices) < num_replicas:
        raise ValidationError("devices", list(devices), f"{num_replicas} replicas need as many CUDA devices")
    if cpu:
        backend, replica_devices = "gloo", ["cpu"] * num_replicas
    else:
        backend, replica_devices = "nccl", list(devices[:num_replicas])
    payload = _payload(tuple(pieces))
    settings = {
        "threads": int(threads),
        "deadline": float(deadline),
        "warmup": int(warmup),
        "min_steps": int(min_steps),
        "max_steps": int(max_steps),
        "target_seconds": float(target_seconds),
        "collective_timeout_s": 120.0,
        "estimates": {int(k): float(v) for k, v in (estimates or {}).items()},
        "find_unused_parameters": bool(find_unused_parameters),
    }
    outcome = SyncOutcome()
    started = time.perf_counter()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="goodput-sync-")
    init_file = os.path.join(store_dir, "store")
    procs = []
    finished = False  # rank 0 said "done": the processes are exiting cleanly
    try:
        for rank in range(num_replicas):
            proc = ctx.Process(
                target=_worker,
                args=(rank, num_replicas, init_file, backend, replica_devices, payload, list(sizes), settings, results),
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        while True:
            try:
                message = results.get(timeout=0.1)
            except queue_module.Empty:
                if time.time() > deadline + grace_s:
                    outcome.stopped = "time_budget"
                    break
                dead = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    raise ModelFailureError(gpu_type, int(sizes[0]), _death(*dead[0]), num_replicas)
                if all(p.exitcode == 0 for p in procs) and results.empty():
                    break
                continue
            kind = message[0]
            if kind == "result":
                result = SyncResult(num_replicas=num_replicas, **message[1])
                outcome.results.append(result)
                if on_result is not None:
                    on_result(result)
            elif kind == "stopped":  # the workers finish cleanly and send "done"
                outcome.stopped = message[1]
            elif kind == "oom":
                outcome.stopped = "oom"
                break
            elif kind == "error":
                _, bsz, text, trace = message
                killed = _killed_replica(procs)
                if killed is not None:  # the peers of a replica killed (the OOM killer) fail in their collective
                    error = ModelFailureError(gpu_type, int(bsz or sizes[0]), _death(*killed), num_replicas)
                    error.__notes__ = [f"another replica then failed in its collective: {text}"]
                else:
                    error = ModelFailureError(gpu_type, int(bsz or sizes[0]), text, num_replicas)
                    error.__notes__ = [f"in a spawned replica:\n{trace}"]
                raise error
            elif kind == "done":
                finished = True
                break
    finally:
        for proc in procs:  # after an error the other replicas wait in a collective: don't wait for them
            proc.join(timeout=10.0 if finished else 0.2)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        results.close()
        results.join_thread()
        shutil.rmtree(store_dir, ignore_errors=True)
        outcome.seconds = time.perf_counter() - started
    return outcome
