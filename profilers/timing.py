"""Timing training steps: warm-up discarded, then the median and spread of timed steps.

On CUDA one CUDA event is recorded on the device's current stream at every
step boundary, and the device is synchronised once after the loop: a step's
time is the time between its two boundaries on the GPU's timeline, with no
host synchronisation per step. Chained boundaries count the gaps in which the
GPU waited for the host to launch work (the loop's own overhead included), so
a launch-bound step is timed as a training loop sees it, and the steps add up
to the loop's wall time. (Bracketing each step with its own pair of events
leaves those gaps out: for the zoo's jobs on an H200 they were small, within
the host's run-to-run spread, but host work between steps is missed whole.)
On the CPU, where operations run synchronously, a step is timed with the
monotonic ``time.perf_counter``.

The number of timed steps adapts to the cost of a step: enough to fill
``target_seconds`` but at least ``min_steps`` and at most ``max_steps``, and
never past a ``deadline`` (a ``time.perf_counter`` value) once ``min_steps``
are done.

Example::

    timing, outputs = time_steps(step, "cpu", warmup=2, min_steps=5, target_seconds=0.5)
    timing.median, timing.std          # seconds of one step
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Timing", "StepClock", "time_steps", "summarize"]


@dataclass(frozen=True)
class Timing:
    """Seconds of the timed steps of one configuration.

    Attributes:
        median: median seconds of one step (the profile's ``step_time``).
        std: sample standard deviation of the timed steps, seconds (0 for one step).
        samples: every timed step, seconds, in the order run.
        warmup: steps run first and discarded.
    """

    median: float
    std: float
    samples: tuple[float, ...]
    warmup: int

    @property
    def steps(self) -> int:
        return len(self.samples)

    @property
    def seconds(self) -> float:
        """Seconds the timed steps took in total."""
        return float(sum(self.samples))


def summarize(samples: Any, warmup: int = 0) -> Timing:
    """Median and sample standard deviation of step times (seconds)."""
    from goodput.errors import ValidationError

    values = tuple(float(s) for s in samples)
    if not values:
        raise ValidationError("samples", samples, "need at least one timed step")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValidationError("samples", values, "step times must be finite and >= 0")
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return Timing(float(statistics.median(values)), float(std), values, warmup)


def _clock() -> float:
    """The host clock of CPU timing: monotonic, high resolution (seconds). Tests substitute it."""
    return time.perf_counter()


# goodput's validators are imported inside the functions that use them: spawned
# replicas import this module for StepClock alone and should not pay for goodput's
# scientific stack (pandas, scipy) at start-up.


def _is_cuda(device: Any) -> bool:
    return str(device).startswith("cuda")


def time_steps(
    step: Callable[[], Any],
    device: Any,
    *,
    warmup: int = 2,
    min_steps: int = 5,
    max_steps: int = 50,
    target_seconds: float = 1.0,
    deadline: float | None = None,
) -> tuple[Timing, list[Any]]:
    """Run ``warmup`` discarded steps, then time between ``min_steps`` and ``max_steps`` steps.

    Args:
        step: runs one training step (forward, backward, optimizer step) and
            returns what the caller wants back (e.g. the detached loss).
        device: ``"cpu"`` or a CUDA device (``"cuda:0"``): picks the clock.
        warmup: steps run first and discarded (allocator, cuDNN autotuning, caches).
        min_steps, max_steps: bounds on the timed steps.
        target_seconds: how long the timed steps should take in total (planned from the last
            warm-up step; without one, steps stop once that much time has passed).
        deadline: a ``time.perf_counter()`` value; no timed step starts after
            it once ``min_steps`` are done.

    Returns:
        ``(timing, outputs)``: the :class:`Timing` and every step's return value
        (warm-up steps included, timed steps last).
    """
    from goodput.validation import check_float, check_int

    warmup = check_int("warmup", warmup, minimum=0)
    min_steps = check_int("min_steps", min_steps, minimum=1)
    max_steps = check_int("max_steps", max_steps, minimum=min_steps)
    target_seconds = check_float("target_seconds", target_seconds, nonnegative=True)
    cuda = _is_cuda(device)
    if cuda:
        import torch

        def synchronize() -> None:
            torch.cuda.synchronize(device)
    else:

        def synchronize() -> None:
            return None

    outputs: list[Any] = []
    warm_seconds = []
    for _ in range(warmup):
        start = _clock()
        outputs.append(step())
        synchronize()
        warm_seconds.append(_clock() - start)
    # The last warm-up step is the best guess of a step's cost (the first pays for allocation).
    estimate = warm_seconds[-1] if warm_seconds else 0.0
    planned = max_steps if estimate <= 0 else int(min(max_steps, max(min_steps, math.ceil(target_seconds / estimate))))
    if estimate <= 0:  # no warm-up step to plan from: the timed steps stop once target_seconds have passed
        until = _clock() + target_seconds
        deadline = until if deadline is None else min(deadline, until)

    if cuda:
        return summarize(_chained_cuda_steps(step, device, planned, min_steps, deadline, outputs), warmup), outputs
    clock = StepClock(device)
    for i in range(planned):
        if _past_deadline(i, min_steps, deadline):
            break
        with clock.measure():
            outputs.append(step())
    return summarize(clock.samples(), warmup), outputs


def _past_deadline(step_index: int, min_steps: int, deadline: float | None) -> bool:
    """No further timed step starts: ``min_steps`` are done and the ``deadline`` (a ``_clock()`` value) has passed."""
    return step_index >= min_steps and deadline is not None and _clock() >= deadline


def _chained_cuda_steps(step: Callable[[], Any], device: Any, planned: int, min_steps: int, deadline: float | None,
                        outputs: list[Any]) -> list[float]:
    """Seconds of each step between consecutive CUDA events recorded at the step boundaries (see module doc)."""
    import torch

    stream = torch.cuda.current_stream(device)
    boundaries = [torch.cuda.Event(enable_timing=True) for _ in range(planned + 1)]
    boundaries[0].record(stream)
    done = 0
    for i in range(planned):
        if _past_deadline(i, min_steps, deadline):
            break
        outputs.append(step())
        boundaries[i + 1].record(stream)
        done += 1
    torch.cuda.synchronize(device)
    return [boundaries[i].elapsed_time(boundaries[i + 1]) / 1000.0 for i in range(done)]  # ms -> s


class StepClock:
    """Times blocks of work on one device: CUDA events on CUDA, ``perf_counter`` on the CPU.

    Each :meth:`measure` block is one sample under a tag; :meth:`samples`
    synchronises the device once and returns the seconds of each block.

    Example::

        clock = StepClock("cpu")
        with clock.measure("sync"):
            step()
        clock.samples("sync")    # [seconds]
    """

    def __init__(self, device: Any) -> None:
        self.device = device
        self.cuda = _is_cuda(device)
        self._pending: dict[str, list[Any]] = {}

    @contextlib.contextmanager
    def measure(self, tag: str = "step") -> Iterator[None]:
        if self.cuda:
            import torch

            stream = torch.cuda.current_stream(self.device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            self._pending.setdefault(tag, []).append((start, end))
        else:
            start = _clock()
            yield
            self._pending.setdefault(tag, []).append(_clock() - start)

    def samples(self, tag: str = "step") -> list[float]:
        """Seconds of every block measured under ``tag``, in order."""
        pending = self._pending.get(tag, [])
        if not self.cuda:
            return list(pending)
        import torch

        torch.cuda.synchronize(self.device)
        return [start.elapsed_time(end) / 1000.0 for start, end in pending]  # ms -> s
