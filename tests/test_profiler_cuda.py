"""The profiler's CUDA paths: event timing, the out-of-memory sweep, NCCL replicas (skipped without a GPU)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from goodput.observations import Profile
from profilers import profile_job
from profilers.devices import cuda_device_types, resolve_devices
from profilers.timing import time_steps
from tests.profiler_jobs import tiny_mlp

pytestmark = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class ActivationHog(nn.Module):
    """Every sample keeps ~32 MiB of activations for backward (two 4M-float vectors): a sweep must run out of memory."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 1 << 22)
        self.down = nn.Linear(1 << 22, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@needs_cuda
def test_cuda_devices_are_grouped_by_normalised_type():
    types = cuda_device_types()
    assert sum(len(t.devices) for t in types) == torch.cuda.device_count()
    assert [t.gpu_type for t in resolve_devices(None)] == [t.gpu_type for t in types]
    for t in types:
        assert t.is_cuda and t.memory_bytes > 0 and t.gpu_type != "cpu"


@needs_cuda
def test_cuda_steps_are_timed_with_events():
    x = torch.randn(2048, 2048, device="cuda:0")
    timing, outputs = time_steps(lambda: x @ x, "cuda:0", warmup=2, min_steps=5, max_steps=5)
    assert timing.steps == 5 and len(outputs) == 7
    assert all(s > 0 for s in timing.samples) and timing.median < 1.0


@needs_cuda
def test_cuda_steps_add_up_to_the_loops_wall_time(monkeypatch):
    """The chained boundary events count the GPU's waits for the host: a launch-bound step (hundreds of tiny
    kernels) with 2 ms of host work between steps (the deadline's clock, slowed) is timed as the loop sees it."""
    from profilers import timing as timing_module

    def slow_clock() -> float:
        time.sleep(0.002)
        return time.perf_counter()

    x = torch.ones(16, device="cuda:0")

    def step() -> torch.Tensor:
        y = x
        for _ in range(300):
            y = y + 1
        return y

    step()
    torch.cuda.synchronize()
    monkeypatch.setattr(timing_module, "_clock", slow_clock)
    start = time.perf_counter()
    timing, _ = time_steps(step, "cuda:0", warmup=0, min_steps=1, max_steps=30, deadline=start + 3600)
    wall = time.perf_counter() - start
    assert timing.steps == 30
    assert 0.9 * wall <= timing.seconds <= wall  # per-step event pairs summed to about half of it


@needs_cuda
def test_cuda_sweep_ends_at_out_of_memory_and_frees_it(tmp_path):
    work = tiny_mlp()
    gpu = cuda_device_types()[0]
    grid = [2**k for k in range(0, 16)]  # 1 .. 32768 samples x 32 MiB = 1 TiB: no GPU holds the top of it
    profile = profile_job(ActivationHog(), work.optimizer_factory, work.loss_fn, work.make_batch, job="hog",
                          init_batch_size=4, batch_sizes=grid, devices=gpu.device, replicas=[], time_budget_s=60,
                          out=tmp_path / "hog.jsonl", progress=False)
    report = profile.metadata[f"profiler.{gpu.gpu_type}"]
    assert report["sweep_stopped"] == "oom"
    largest = profile.max_local_bsz[gpu.gpu_type]
    assert largest == max(o.local_bsz for o in profile.observations) and largest < grid[-1]
    memory = [o.memory_bytes for o in sorted(profile.observations, key=lambda o: o.local_bsz) if o.grad_sqr is None]
    assert memory == sorted(memory) and memory[-1] <= gpu.memory_bytes
    assert torch.cuda.memory_allocated(gpu.device) < 1 << 30  # the failed batch was released


@needs_cuda
def test_a_fresh_processs_first_calls_leave_the_noise_phase_its_share(tmp_path):
    """A fresh process's first calls (4-6 s on an H200 machine, torch 2.11) ate the noise phase's 3 s share, which
    then ran its minimum of 2 rounds. The warm-up step takes them before the share starts (passed on an H200, 2026-11-27)."""
    out = tmp_path / "mlp.jsonl"
    subprocess.run([sys.executable, "-m", "cli", "profile", "--zoo", "mlp", "--devices", "cuda:0", "--replicas", "0",
                    "--out", str(out), "--no-progress"], check=True, cwd=Path(__file__).resolve().parents[1])
    profile = Profile.load(out)
    report = profile.metadata[f"profiler.{profile.gpu_types[0]}"]
    assert report["phase_seconds"]["warm_up"] > 0 and report["grad"]["rounds"] == 8  # the default noise_rounds


@needs_cuda
def test_nccl_replicas_record_sync_time(tmp_path):
    types = [t for t in cuda_device_types() if len(t.devices) >= 2]
    if not types:
        pytest.skip("needs two GPUs of one type")
    gpu = types[0]
    work = tiny_mlp()
    profile = profile_job(**work.profile_args(), devices=gpu.gpu_type, batch_sizes=[4, 64], replicas=[2],
                          time_budget_s=30, progress=False)
    multi = [o for o in profile.observations if o.num_replicas == 2]
    assert multi and all(0 <= o.sync_time <= o.step_time and o.memory_bytes > 0 for o in multi)
