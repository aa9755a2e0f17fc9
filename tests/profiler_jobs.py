"""Small real jobs for the profiler tests (importable, so spawned replicas can unpickle them).

``python -m tests.profiler_jobs OUT`` profiles :func:`sweep_job` into ``OUT``
(the kill-and-resume test runs it in a subprocess and kills it midway).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from profilers import zoo

# Small sizes finish in milliseconds, the last one takes about a second: a kill lands midway.
KILL_GRID = [4, 8, 16, 32, 64, 128, 32768]


def tiny_mlp(init_batch_size: int = 16) -> zoo.Workload:
    """A 16 → 32 → 4 MLP: steps of well under a millisecond at small batches."""
    return zoo.mlp(in_features=16, width=32, depth=1, classes=4, init_batch_size=init_batch_size, max_batch_size=None)


def wide_mlp() -> zoo.Workload:
    """A 64 → 256 → 256 → 10 MLP: step time clearly grows with the batch."""
    return zoo.mlp(in_features=64, width=256, depth=2, classes=10, init_batch_size=32, max_batch_size=None)


def workload_dict() -> dict:
    """A factory returning a mapping (the CLI's MODULE:FACTORY contract)."""
    work = tiny_mlp()
    return {"model": work.model, "optimizer_factory": work.optimizer_factory, "loss_fn": work.loss_fn,
            "make_batch": work.make_batch, "job": "dict-job", "init_batch_size": 8}


class ShapeMismatch(nn.Module):
    """Its second layer expects 7 features but gets 8: fails on any batch."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 8)
        self.second = nn.Linear(7, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


class KilledReplica:
    """A ``make_batch`` whose replica of rank 1 kills its own process (SIGKILL, as the OOM killer would) from
    ``threshold`` samples on; the tiny MLP's batches otherwise."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold

    def __call__(self, bsz: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        import os
        import signal

        import torch.distributed as dist

        if bsz >= self.threshold and dist.is_initialized() and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return tiny_mlp().make_batch(bsz, device)


class NanFromBatch(nn.Module):
    """Finite outputs below ``threshold`` samples, NaN from there on (a numerically broken model at large batches)."""

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold = threshold
        self.net = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if x.shape[0] >= self.threshold:
            out = out * float("nan")
        return out


class NanAfterTraining(nn.Module):
    """A linear classifier that turns NaN after ``limit`` training forward passes from its initial state.

    The count is a buffer, so it belongs to the state a copy of the model or
    ``load_state_dict`` starts from: a stand-in for training that diverges
    when carried on for too long, deterministic in the sweep and in DDP replicas alike.
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.net = nn.Linear(16, 4)
        self.register_buffer("trained", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.training:
            self.trained += 1
            if int(self.trained) > self.limit:
                out = out * float("nan")
        return out


class HostOomFromBatch(nn.Module):
    """A linear classifier whose forward asks the host for 4 PiB from ``threshold`` samples on (torch's CPU allocator refuses)."""

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold = threshold
        self.net = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.threshold:
            torch.empty(2**52, dtype=torch.uint8)
        return self.net(x)


class BufferedClassifier(nn.Module):
    """A linear layer behind a BatchNorm: a model with buffers that DDP broadcasts from rank 0."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(16)
        self.net = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.norm(x))


class SpareHead(nn.Module):
    """The tiny MLP's shape with a second head its forward never uses: a trainable parameter without a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.spare = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def vector_loss(model: nn.Module, batch) -> torch.Tensor:
    """A broken loss function: per-sample losses, not their mean."""
    x, y = batch
    return nn.functional.cross_entropy(model(x), y, reduction="none")


def sweep_job(out: str) -> None:
    """What the kill test runs: a sweep whose large sizes take seconds, no replicas."""
    from profilers import profile_job

    work = wide_mlp()
    profile_job(**work.profile_args(), batch_sizes=KILL_GRID, replicas=[], out=out, time_budget_s=60.0,
                min_steps=3, max_steps=5, cpu_threads=1, progress=False)


if __name__ == "__main__":
    sweep_job(sys.argv[1])
