"""Profiling one device type for :func:`profilers.profile_job`: gradient noise, the batch-size sweep, synchronisation.

:class:`TypeRun` does the three phases on one :class:`~profilers.devices.DeviceType`
within its share of the time budget (seconds of wall time):

0. one untimed warm-up step, so that the process's first-call costs (torch's imports,
   CUDA's start-up) fall in the budget but before the noise phase's share starts;
1. gradient noise at M0, in at most ``NOISE_SHARE`` of the budget (:mod:`profilers.noise`);
2. the batch-size sweep, ascending, each size from the initial weights with a fresh
   optimizer, until ``SWEEP_SHARE_WITH_SYNC`` of the budget when replicas are profiled
   (else all of it), ending at the grid's end, a CUDA out-of-memory, a CPU memory cap
   or the sweep's deadline (:mod:`profilers.timing`);
3. synchronisation: DDP replicas at a few of the sweep's sizes (:mod:`profilers.sync`).

Each observation goes to a :class:`Sink` (the profile being built and its JSON Lines
file) the moment it is measured, and :class:`TypeReport` records what was done.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from goodput.observations import Observation, ProfileWriter

from .devices import DeviceType, usable_cpus
from .errors import ModelFailureError
from .memory import CpuStepMemory, cuda_peak, is_out_of_memory, release_cuda_memory, reset_cuda_peak
from .noise import GradientStats, gradient_noise
from .timing import time_steps

__all__ = ["JobPieces", "TypeReport", "TypeRun", "Sink", "ProgressBars", "NOISE_SHARE", "SWEEP_SHARE_WITH_SYNC"]

NOISE_SHARE = 0.15  # of the budget, at most, for gradient statistics
SWEEP_SHARE_WITH_SYNC = 0.6  # the sweep's deadline when replicas are profiled
SYNC_MIN_SECONDS = 1.5  # spawning replicas costs about this on a small host; less left: skip
SYNC_EXIT_SECONDS = 0.5  # kept back from the replicas' deadline for their exit


class JobPieces(NamedTuple):
    """What :func:`profilers.profile_job` is given to run the job: the model and three callables."""

    model: Any  # a torch.nn.Module, on the CPU
    optimizer_factory: Callable[[Any], Any]  # optimizer_factory(params) -> optimizer
    loss_fn: Callable[[Any, Any], Any]  # loss_fn(model, batch) -> scalar mean loss
    make_batch: Callable[[int, Any], Any]  # make_batch(batch_size, device) -> batch


@dataclass
class TypeReport:
    """What profiling one device type did (stored in the profile's metadata as ``profiler.<type>``)."""

    gpu_type: str
    devices: list[str]
    names: list[str]
    grid: list[int]
    measured: list[int] = field(default_factory=list)
    max_local_bsz: int | None = None
    sweep_stopped: str = "grid_end"
    sync: dict[str, Any] = field(default_factory=dict)
    grad: dict[str, Any] | None = None
    threads: int | None = None
    seconds: float = 0.0
    resumed: int = 0
    complete: bool = False
    signature: dict[str, Any] = field(default_factory=dict)
    phase_seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    import torch

    if threads is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _check_loss(loss: Any, gpu_type: str, bsz: int, replicas: int = 1) -> None:
    import torch

    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ModelFailureError(gpu_type, bsz, f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""), replicas)
    if not loss.requires_grad:
        raise ModelFailureError(gpu_type, bsz, "the loss does not require grad (is the model's output detached?)", replicas)


def _check_finite(losses: list[Any], gpu_type: str, bsz: int) -> None:
    import torch

    values = torch.stack([loss.detach().float().reshape(()) for loss in losses])
    if not bool(torch.isfinite(values).all()):
        bad = float(values[~torch.isfinite(values)][0])
        raise ModelFailureError(gpu_type, bsz, f"non-finite loss ({bad})")


def _failure(exc: BaseException, gpu_type: str, bsz: int) -> ModelFailureError:
    if isinstance(exc, ModelFailureError):
        return exc
    return ModelFailureError(gpu_type, bsz, f"{type(exc).__name__}: {exc}")


def _sync_sizes(measured: list[int], init_batch_size: int, replicas: int, count: int) -> list[int]:
    """Up to ``count`` measured sizes: the smallest, the one nearest M0/replicas, the largest, then others spread."""
    if not measured or count <= 0:
        return []
    target = max(1.0, init_batch_size / replicas)
    nearest = min(measured, key=lambda b: (abs(math.log(b / target)), b))
    chosen = [measured[0], nearest, measured[-1]]
    chosen = list(dict.fromkeys(chosen))[:count]
    rest = [b for b in measured if b not in chosen]
    while len(chosen) < count and rest:
        chosen.append(rest.pop(len(rest) // 2))
    return sorted(chosen)


class Sink:
    """Where observations go as they are measured: the profile being built, the JSON Lines file and the
    caller's ``on_observation``, if given (in that order: on disk before anyone is told)."""

    def __init__(self, writer: ProfileWriter | None, on_observation: Callable[[Observation], None] | None = None) -> None:
        self.writer = writer
        self.on_observation = on_observation
        self.new: list[Observation] = []

    def write(self, obs: Observation) -> None:
        if self.writer is not None:
            self.writer.write(obs)
        self.new.append(obs)
        if self.on_observation is not None:
            self.on_observation(obs)

    def meta(self, **meta: Any) -> None:
        if self.writer is not None:
            self.writer.write_meta(**meta)


class ProgressBars:
    """A rich progress bar per device type (or nothing)."""

    def __init__(self, enabled: bool, console: Any) -> None:
        self.enabled = enabled
        self._progress = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]{task.fields[gpu]}[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=console,
            )

    def __enter__(self) -> ProgressBars:
        if self._progress is not None:
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def task(self, gpu_type: str, total: int) -> Any:
        if self._progress is None:
            return None
        return self._progress.add_task("starting", total=total, gpu=gpu_type)

    def update(self, task: Any, description: str | None = None, advance: float = 0, total: int | None = None) -> None:
        if self._progress is None or task is None:
            return
        kwargs: dict[str, Any] = {"advance": advance}
        if description is not None:
            kwargs["description"] = description
        if total is not None:
            kwargs["total"] = total
        self._progress.update(task, **kwargs)


class TypeRun:
    """Profiles one device type: gradient noise, the batch-size sweep, synchronisation."""

    def __init__(
        self,
        dtype: DeviceType,
        pieces: JobPieces,
        *,
        job: str,
        init_batch_size: int,
        grid: list[int],
        budget: float,
        replicas: list[int],
        memory_cap: int | None,
        cpu_threads: int | None,
        settings: dict[str, int],
        sink: Sink,
        bar: ProgressBars,
        existing: list[Observation],
    ) -> None:
        self.dtype = dtype
        self.gpu = dtype.gpu_type
        self.device = dtype.device
        self.model, self.optimizer_factory, self.loss_fn, self.make_batch = pieces
        self.job, self.m0, self.grid, self.budget = job, init_batch_size, grid, budget
        self.replicas, self.memory_cap, self.settings, self.sink, self.bar = replicas, memory_cap, settings, sink, bar
        self.existing = {(o.num_replicas, o.local_bsz): o for o in existing if o.num_nodes == 1 and o.accum_steps == 0}
        self.has_grad = any(o.grad_sqr is not None for o in existing)
        if dtype.is_cuda:
            self.threads = None
        else:
            self.threads = cpu_threads or max(1, usable_cpus() // max([1, *replicas]))
        self.report = TypeReport(self.gpu, list(dtype.devices), list(dtype.names), list(grid), threads=self.threads,
                                 resumed=len(existing))
        self.stats: GradientStats | None = None
        self.unused_parameters = False  # some trainable parameter gets no gradient (seen at the warm-up step)
        self.measured_points: list[tuple[int, float, int | None]] = []
        self._advanced = 0

    # -------------------------------------------------------------- orchestration
    def run(self) -> TypeReport:
        self.start = time.perf_counter()
        self.wall_start = time.time()
        sync_planned = bool(self.replicas) and self.settings["sync_sizes"] > 0
        self.sweep_deadline = self.start + (SWEEP_SHARE_WITH_SYNC if sync_planned else 1.0) * self.budget
        total = len(self.grid) + 1 + (self.settings["sync_sizes"] * len(self.replicas) if sync_planned else 0)
        self.task = self.bar.task(self.gpu, total)
        phases = self.report.phase_seconds
        with _torch_threads(self.threads):
            self._warm_up()
            phases["warm_up"] = round(time.perf_counter() - self.start, 3)
            before = time.perf_counter()
            self.noise_deadline = before + NOISE_SHARE * self.budget
            self._noise()
            phases["noise"] = round(time.perf_counter() - before, 3)
            before = time.perf_counter()
            self._sweep()
            phases["sweep"] = round(time.perf_counter() - before, 3)
            if sync_planned:
                before = time.perf_counter()
                self._sync()
                self.report.phase_seconds["sync"] = round(time.perf_counter() - before, 3)
        self.report.seconds = round(time.perf_counter() - self.start, 3)
        self.report.complete = True
        # Sizes skipped (memory, budget) never advance the bar: close it at what was done.
        self.bar.update(self.task, description=f"done in {self.report.seconds:.1f} s", total=self._advanced)
        return self.report

    def _advance(self, description: str) -> None:
        self._advanced += 1
        self.bar.update(self.task, description=description, advance=1)

    def _fresh(self) -> tuple[Any, Any]:
        model = copy.deepcopy(self.model).to(self.device)
        model.train()
        return model, self.optimizer_factory(model.parameters())

    def _observation(self, replicas: int, bsz: int, **values: Any) -> Observation:
        return Observation(job=self.job, gpu_type=self.gpu, num_nodes=1, num_replicas=replicas, local_bsz=bsz,
                           placement=(replicas,), source="profile", timestamp=time.time(), **values)

    # -------------------------------------------------------------- 0. warm-up
    def _warm_up(self) -> None:
        """One untimed step (forward, backward, optimizer step) at the grid's smallest size on a fresh copy.

        A process's first calls cost seconds: torch imports ``torch._dynamo`` when the first optimizer is
        built (1.7 s on this project's 2-core host; 4-6 s on an H200 machine with torch 2.11+cu130, where
        it is the noise phase's whole share of a 20 s budget and left the noise 2 rounds of 8), and CUDA
        loads its context, libraries and kernels at their first use. Here they fall in the type's budget
        but before the noise phase's share starts, and in no timed step. A failure is left to the phases
        after it, which name it. A trainable parameter the step leaves without a gradient (a spare head)
        makes the replicas' DDP look for unused parameters, as training such a model under DDP must.
        """
        self.bar.update(self.task, description="warm-up step")
        with contextlib.suppress(Exception):
            model, optimizer = self._fresh()
            self.loss_fn(model, self.make_batch(min(self.grid), self.device)).backward()
            self.unused_parameters = any(p.requires_grad and p.grad is None for p in model.parameters())
            optimizer.step()
            del model, optimizer
        if self.dtype.is_cuda:
            release_cuda_memory(self.device)

    # -------------------------------------------------------------- 1. gradient noise
    def _noise(self) -> None:
        if self.has_grad:
            self._advance("gradient statistics: resumed")
            return
        self.bar.update(self.task, description=f"gradient noise at M0={self.m0}")
        micro_batches = 4
        while True:
            model, _ = self._fresh()
            oom = False
            try:
                self.stats = gradient_noise(
                    model, self.loss_fn, self.make_batch, self.device, self.m0,
                    micro_batches=micro_batches, rounds=self.settings["noise_rounds"], deadline=self.noise_deadline,
                    check_loss=lambda loss, b: _check_loss(loss, self.gpu, b),
                )
            except Exception as exc:  # noqa: BLE001 - classified below
                if not is_out_of_memory(exc):
                    raise _failure(exc, self.gpu, max(1, self.m0 // micro_batches)) from exc
                oom = True
            del model
            if not oom:
                break
            release_cuda_memory(self.device)
            if self.m0 // micro_batches <= 1:
                self.report.grad = {"skipped": "out of memory at micro-batch size 1"}
                break
            micro_batches *= 2
        if self.stats is not None:
            self.report.grad = {"grad_sqr": self.stats.grad_sqr, "grad_var": self.stats.grad_var,
                                "noise_scale": self.stats.noise_scale, "micro_bsz": self.stats.micro_bsz,
                                "micro_batches": self.stats.micro_batches, "rounds": self.stats.rounds}
        self._advance("gradient statistics")

    # -------------------------------------------------------------- 2. batch-size sweep
    def _sweep(self) -> None:
        model = optimizer = None
        reference = min(self.grid, key=lambda b: (abs(math.log(b / self.m0)), b))
        points: list[tuple[int, float, int | None]] = []  # (bsz, step_time, memory) of sizes that ran
        grad_attached = self.has_grad
        stopped = "grid_end"
        for bsz in self.grid:
            done = self.existing.get((1, bsz))
            if done is not None:
                # measured under earlier settings: a tighter memory cap now ends the sweep here too
                over = (done.memory_bytes > self.memory_cap if done.memory_bytes is not None
                        else bool(points) and self._over_cap(points, bsz)) if self.memory_cap is not None else False
                if over:
                    stopped = "memory_cap"
                    break
                points.append((bsz, done.step_time, done.memory_bytes))
                self.report.measured.append(bsz)
                self._advance(f"b={bsz}: resumed")
                continue
            if points and self._too_slow(points[-1], bsz):
                stopped = "time_budget"
                break
            if points and self._over_cap(points, bsz):
                stopped = "memory_cap"
                break
            self.bar.update(self.task, description=f"sweep b={bsz}")
            attach = self.stats if (bsz == reference and not grad_attached) else None
            # Every size starts from the job's initial weights and a fresh optimizer: the timed steps
            # repeat two batches, and training carried from size to size can diverge (a NaN loss that is
            # the sweep's doing, not the job's) and makes each size's numbers depend on the ones before.
            if model is None:
                model, optimizer = self._fresh()
            else:  # copied in place from the caller's model: a large model is not copied anew per size
                optimizer = None  # the previous size's optimizer state is freed first
                model.load_state_dict(self.model.state_dict())
                optimizer = self.optimizer_factory(model.parameters())
            result = self._measure(model, optimizer, bsz, attach)
            if isinstance(result, str):
                stopped = result
                break
            points.append((bsz, result.step_time, result.memory_bytes))
            self.report.measured.append(bsz)
            grad_attached = grad_attached or attach is not None
            self._advance(f"b={bsz}: {result.step_time * 1e3:.3g} ms")
        del model, optimizer
        if self.dtype.is_cuda:
            release_cuda_memory(self.device)  # after an OOM, and before the replicas start on the same device
        self.report.sweep_stopped = stopped
        if points:
            self.report.max_local_bsz = max(b for b, _, _ in points)
        if not grad_attached and self.stats is not None and points:
            # M0 was not reached: time the largest size that ran once more and carry the statistics there.
            model, optimizer = self._fresh()
            result = self._measure(model, optimizer, points[-1][0], self.stats, check_cap=False)
            if not isinstance(result, str):
                self.report.grad = {**(self.report.grad or {}), "attached_to_local_bsz": points[-1][0]}
        elif self.report.grad is not None and grad_attached and not self.has_grad:
            self.report.grad["attached_to_local_bsz"] = reference
        self.measured_points = points

    def _too_slow(self, last: tuple[int, float, int | None], bsz: int) -> bool:
        """Whether the next size's warm-up and minimum timed steps would end past the sweep's deadline."""
        last_bsz, last_time, _ = last
        predicted = last_time * max(1.0, bsz / last_bsz)  # linear in the batch: pessimistic
        cost = predicted * (self.settings["warmup"] + self.settings["min_steps"])
        return time.perf_counter() + cost > self.sweep_deadline

    def _over_cap(self, points: list[tuple[int, float, int | None]], bsz: int) -> bool:
        """Linear extrapolation of memory from the last two sizes exceeds the cap."""
        if self.memory_cap is None:
            return False
        known = [(b, m) for b, _, m in points if m is not None]
        if len(known) < 2:
            return False
        (b1, m1), (b2, m2) = known[-2], known[-1]
        predicted = m2 + (m2 - m1) / (b2 - b1) * (bsz - b2)
        return predicted > self.memory_cap

    def _measure(self, model: Any, optimizer: Any, bsz: int, stats: GradientStats | None, check_cap: bool = True) -> Observation | str:
        """Time one local batch size; write and return its observation, or the reason the sweep ends."""
        cuda = self.dtype.is_cuda
        remaining = max(0.0, self.sweep_deadline - time.perf_counter())
        left = max(1, len(self.grid) - len(self.report.measured))
        target = min(2.0, max(0.05, 0.5 * remaining / left))
        oom = False
        try:
            batches = [self.make_batch(bsz, self.device) for _ in range(2)]
            meter = None if cuda else CpuStepMemory()
            counter = [0]
            loss_fn = self.loss_fn

            def step() -> Any:
                i = counter[0]
                counter[0] += 1
                optimizer.zero_grad(set_to_none=True)
                if i == 0 and meter is not None:
                    with meter.forward(model, batches[0]):
                        loss = loss_fn(model, batches[0])
                else:
                    loss = loss_fn(model, batches[i % 2])
                if i == 0:
                    _check_loss(loss, self.gpu, bsz)
                loss.backward()
                optimizer.step()
                return loss.detach()

            if cuda:
                reset_cuda_peak(self.device)
            timing, losses = time_steps(step, self.device, warmup=self.settings["warmup"], min_steps=self.settings["min_steps"],
                                        max_steps=self.settings["max_steps"], target_seconds=target, deadline=self.sweep_deadline)
            _check_finite(losses, self.gpu, bsz)
            memory = cuda_peak(self.device) if cuda else meter.total(model, optimizer, batches[0])
            batches.clear()  # free the inputs before the next size allocates its own
            losses.clear()
        except Exception as exc:  # noqa: BLE001 - classified below
            if not is_out_of_memory(exc):
                raise _failure(exc, self.gpu, bsz) from exc
            oom = True
        if oom:
            return "oom"
        if check_cap and self.memory_cap is not None and memory > self.memory_cap:
            return "memory_cap"
        grad = {"grad_sqr": stats.grad_sqr, "grad_var": stats.grad_var} if stats is not None else {}
        obs = self._observation(1, bsz, step_time=timing.median, step_time_std=timing.std, memory_bytes=int(memory), **grad)
        self.sink.write(obs)
        return obs

    # -------------------------------------------------------------- 3. synchronisation
    def _sync(self) -> None:
        from .sync import profile_sync

        measured = sorted(b for b, _, _ in self.measured_points)
        for r in self.replicas:
            sizes = _sync_sizes(measured, self.m0, r, self.settings["sync_sizes"])
            todo = [b for b in sizes if (r, b) not in self.existing]
            entry: dict[str, Any] = {"sizes": sizes, "resumed": [b for b in sizes if b not in todo]}
            self.report.sync[str(r)] = entry
            for b in sizes:
                if b not in todo:
                    self._advance(f"{r} replicas b={b}: resumed")
            if not todo:
                entry["stopped"] = "done"
                continue
            deadline = self.wall_start + self.budget - SYNC_EXIT_SECONDS
            if deadline - time.time() < SYNC_MIN_SECONDS:
                entry["stopped"] = "time_budget"
                continue
            self.bar.update(self.task, description=f"{r} replicas: starting processes")

            def on_result(result: Any, r: int = r) -> None:
                self.sink.write(self._observation(r, result.local_bsz, step_time=result.step_time,
                                                  step_time_std=result.step_time_std, sync_time=result.sync_time,
                                                  memory_bytes=result.memory_bytes))
                self._advance(f"{r} replicas b={result.local_bsz}: sync {result.sync_time * 1e3:.3g} ms")

            pieces = JobPieces(copy.deepcopy(self.model).cpu(), self.optimizer_factory, self.loss_fn, self.make_batch)
            remaining = max(0.0, deadline - time.time())
            target = min(2.0, max(0.05, 0.4 * remaining / max(1, len(todo))))
            outcome = profile_sync(
                pieces, self.dtype.devices, r, todo, gpu_type=self.gpu, deadline=deadline, threads=self.threads or 1,
                warmup=self.settings["warmup"], min_steps=self.settings["min_steps"], max_steps=self.settings["max_steps"],
                target_seconds=target, on_result=on_result,
                estimates={b: t for b, t, _ in self.measured_points}, find_unused_parameters=self.unused_parameters,
            )
            entry.update(stopped=outcome.stopped, measured=[x.local_bsz for x in outcome.results],
                         seconds=round(outcome.seconds, 3),
                         compute_time={str(x.local_bsz): x.compute_time for x in outcome.results})
