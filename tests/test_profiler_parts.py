"""The profiler's parts on the CPU: device names, timing, memory, gradient noise, the zoo."""

from __future__ import annotations

import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from goodput.errors import ValidationError
from goodput.validation import normalize_gpu_type
from profilers import zoo
from profilers.devices import cpu_device_type, normalize_device_name, resolve_devices
from profilers.memory import CpuStepMemory, tensor_bytes
from profilers.noise import gradient_noise
from profilers.profile import default_grid, trainable_parameters
from profilers.sync import sync_time_of
from profilers import timing
from profilers.timing import StepClock, summarize, time_steps
from profilers.type_run import _sync_sizes
from tests.profiler_jobs import tiny_mlp, wide_mlp

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    """Two busy cores: one intra-op thread avoids OpenMP stalls when the other core is taken."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# ---------------------------------------------------------------------------- device names

NAMES = [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-PCIE-40GB", "a100"),
    ("Tesla T4", "t4"),
    ("Tesla V100-SXM2-16GB", "v100"),
    ("Tesla V100-PCIE-32GB", "v100"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", "l40s"),
    ("Tesla K80", "k80"),
    ("Tesla P100-PCIE-16GB", "p100"),
    ("NVIDIA A10G", "a10g"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA GeForce RTX 2080 Ti", "rtx2080ti"),
    ("NVIDIA GeForce RTX 3090", "rtx3090"),
    ("NVIDIA GeForce RTX 4070 SUPER", "rtx4070super"),
    ("NVIDIA GeForce GTX 1080 Ti", "gtx1080ti"),
    ("Quadro RTX 6000", "rtx6000"),
    ("NVIDIA RTX A6000", "rtxa6000"),
    ("NVIDIA RTX 6000 Ada Generation", "rtx6000ada"),
    ("cpu", "cpu"),
    # a MIG slice is a type of its own (a 1g.10gb slice is about a seventh of an A100)
    ("NVIDIA A100-SXM4-80GB MIG 1g.10gb", "a100-mig-1g.10gb"),
    ("NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb", "h100-mig-1c.3g.40gb"),
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb+me", "a100-mig-1g.5gb-me"),
]


@pytest.mark.parametrize("name,expected", NAMES)
def test_device_names_normalise(name, expected):
    assert normalize_device_name(name) == expected


def test_unknown_device_names_get_stable_valid_slugs():
    first = normalize_device_name("Acme Tensor Engine 9 (rev B)")
    assert first == normalize_device_name("Acme Tensor Engine 9 (rev B)") == "acme-tensor-engine-9-rev-b"
    assert normalize_gpu_type(first) == first  # usable as a gpu_type everywhere
    assert normalize_device_name("NVIDIA TITAN RTX") == "titan-rtx"
    with pytest.raises(ValidationError, match="device_name"):
        normalize_device_name("  ")


def test_resolve_devices_on_this_host():
    cpu = cpu_device_type()
    assert cpu.gpu_type == "cpu" and cpu.devices == ("cpu",) and not cpu.is_cuda
    assert [d.gpu_type for d in resolve_devices("cpu")] == ["cpu"]
    assert [d.gpu_type for d in resolve_devices(["cpu", "cpu"])] == ["cpu"]
    if not torch.cuda.is_available():
        assert [d.gpu_type for d in resolve_devices(None)] == ["cpu"]
        with pytest.raises(ValidationError, match="no CUDA device"):
            resolve_devices("cuda")
    with pytest.raises(ValidationError, match="devices"):
        resolve_devices(["tpu"])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_the_cpu_type_counts_the_cores_this_process_may_use():
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from profilers.devices import cpu_device_type; print(cpu_device_type().count)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "1"  # one core allowed (taskset, a cpuset), whatever the host has
    assert cpu_device_type().count == len(os.sched_getaffinity(0))


# ---------------------------------------------------------------------------- timing


class FakeClock:
    """A deterministic host clock: each step advances it by the seconds the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_time_steps_discards_warmup_and_takes_the_median(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing, "_clock", clock)
    durations = iter([0.5, 0.4, 0.002, 0.003, 0.001, 0.002, 0.010])  # two slow warm-up steps, then five

    def step():
        clock.now += next(durations)
        return clock.now

    result, outputs = time_steps(step, "cpu", warmup=2, min_steps=5, max_steps=5)
    assert result.warmup == 2 and result.steps == 5 and len(outputs) == 7
    assert result.samples == pytest.approx((0.002, 0.003, 0.001, 0.002, 0.010))
    assert result.median == pytest.approx(0.002)  # the warm-up steps are not in it
    assert result.std == pytest.approx(statistics.stdev([0.002, 0.003, 0.001, 0.002, 0.010]))


def test_time_steps_adapts_to_target_and_deadline(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing, "_clock", clock)
    tick = 2.0**-10  # about 1 ms, exact in binary so that the arithmetic below is exact

    def step():
        clock.now += tick

    result, _ = time_steps(step, "cpu", warmup=1, min_steps=2, max_steps=1000, target_seconds=50 * tick)
    assert result.steps == 50  # fills the target
    result, _ = time_steps(step, "cpu", warmup=1, min_steps=2, max_steps=20, target_seconds=50 * tick)
    assert result.steps == 20  # capped
    result, _ = time_steps(step, "cpu", warmup=1, min_steps=2, max_steps=1000, target_seconds=50 * tick,
                           deadline=clock.now + 10.5 * tick)
    assert result.steps == 10  # steps start until the deadline passes (the warm-up used one tick of it)
    result, _ = time_steps(step, "cpu", warmup=1, min_steps=3, max_steps=1000, target_seconds=10, deadline=clock.now - 1)
    assert result.steps == 3  # past the deadline: the minimum only
    result, _ = time_steps(step, "cpu", warmup=0, min_steps=2, max_steps=1000, target_seconds=50.5 * tick)
    assert result.steps == 51  # no warm-up step to plan from: steps start until the target's time has passed


def test_time_steps_on_the_real_clock():
    result, _ = time_steps(lambda: time.sleep(0.01), "cpu", warmup=1, min_steps=3, max_steps=3)
    assert result.steps == 3 and 0.01 <= result.median < 1.0  # a sleep never ends early


def test_step_clock_and_summarize_validate():
    clock = StepClock("cpu")
    with clock.measure("a"):
        time.sleep(0.001)
    assert clock.samples("a")[0] >= 0.001 and clock.samples("b") == []
    with pytest.raises(ValidationError):
        summarize([])
    with pytest.raises(ValidationError):
        time_steps(lambda: None, "cpu", min_steps=5, max_steps=2)
    assert sync_time_of(0.010, 0.007) == pytest.approx(0.003)
    assert sync_time_of(0.010, 0.012) == 0.0  # compute noise never gives negative sync


# ---------------------------------------------------------------------------- memory


def test_tensor_bytes_counts_each_storage_once():
    x = torch.zeros(100)
    assert tensor_bytes([x, x[:10], {"y": x.view(10, 10)}]) == 400
    assert tensor_bytes((x, torch.zeros(5, dtype=torch.float64))) == 440


def test_tensor_bytes_reads_dataclass_batches_and_sparse_tensors():
    from collections import UserDict
    from dataclasses import dataclass

    @dataclass
    class Batch:
        inputs: torch.Tensor
        labels: torch.Tensor
        name: str = "b"

    x, y = torch.zeros(100), torch.zeros(10, dtype=torch.int64)
    assert tensor_bytes(Batch(x, y)) == tensor_bytes((x, y)) == 480  # a dataclass had counted 0 bytes
    assert tensor_bytes(UserDict(inputs=x)) == 400  # a Mapping that is not a dict (HF BatchEncoding)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.tensor([1.0, 2.0]), (1000,), check_invariants=True)
    assert tensor_bytes(sparse) == 2 * 8 + 2 * 4  # its indices and values, not 1000 floats


def test_sparse_gradients_are_profiled():
    from profilers import profile_job

    class Bag(torch.nn.Module):  # a recommendation job's shape: a sparse embedding trained by plain SGD
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.EmbeddingBag(1000, 16, sparse=True)
            self.head = torch.nn.Linear(16, 1)

        def forward(self, ids):
            return self.head(self.embed(ids)).squeeze(1)

    def make_batch(n, device):
        return torch.randint(0, 1000, (n, 4), device=device), torch.randn(n, device=device)

    profile = profile_job(Bag(), lambda ps: torch.optim.SGD(ps, lr=0.01), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(),
                          make_batch, job="bag", init_batch_size=8, batch_sizes=[4, 8], devices="cpu", replicas=[],
                          progress=False, cpu_threads=1, min_steps=3, max_steps=5, time_budget_s=20)
    assert sorted({o.local_bsz for o in profile.observations}) == [4, 8]  # had failed: reshape of a sparse .grad
    assert all(o.memory_bytes > 0 for o in profile.observations)
    carrier = next(o for o in profile.observations if o.grad_sqr is not None)
    assert 0 < carrier.grad_sqr < float("inf") and 0 < carrier.grad_var < float("inf")


def _step_memory(work, optimizer, bsz):
    meter = CpuStepMemory()
    batch = work.make_batch(bsz, "cpu")
    optimizer.zero_grad()
    with meter.forward(work.model, batch):
        loss = work.loss_fn(work.model, batch)
    loss.backward()
    optimizer.step()
    return meter.total(work.model, optimizer, batch)


def test_cpu_step_memory_counts_state_and_grows_with_activations():
    work = wide_mlp()
    optimizer = work.optimizer_factory(work.model.parameters())
    param_bytes = sum(p.numel() * 4 for p in work.model.parameters())
    small, large = _step_memory(work, optimizer, 8), _step_memory(work, optimizer, 512)
    assert small >= 3 * param_bytes  # parameters, gradients, SGD momentum
    # Two 256-wide hidden layers save at least 2 x 256 floats per sample for backward.
    assert large - small >= (512 - 8) * 2 * 256 * 4


# ---------------------------------------------------------------------------- gradient noise


def test_gradient_noise_is_positive_finite_and_leaves_the_model_alone():
    work = tiny_mlp(init_batch_size=32)
    before = [p.detach().clone() for p in work.model.parameters()]
    stats = gradient_noise(work.model, work.loss_fn, work.make_batch, "cpu", 32, rounds=6)
    assert stats.rounds == 6 and stats.micro_bsz == 8 and stats.micro_batches == 4
    assert 0 < stats.grad_sqr < float("inf") and 0 < stats.grad_var < float("inf")
    assert stats.noise_scale == pytest.approx(32 * stats.grad_var / stats.grad_sqr)
    assert all(torch.equal(a, b) for a, b in zip(before, work.model.parameters()))
    assert all(p.grad is None for p in work.model.parameters())


def test_gradient_noise_puts_the_models_mode_and_buffers_back():
    from tests.profiler_jobs import BufferedClassifier

    model = BufferedClassifier().eval()
    buffers = {name: b.clone() for name, b in model.named_buffers()}

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m(batch[0]), batch[1])

    def make_batch(n, device):
        return torch.randn(n, 16, device=device) * 3 + 1, torch.randint(0, 4, (n,), device=device)

    gradient_noise(model, loss_fn, make_batch, "cpu", 16, rounds=3)
    assert not model.training  # had been left in training mode, its BatchNorm statistics moved by 12 batches
    assert all(torch.equal(buffers[name], b) for name, b in model.named_buffers())


def test_gradient_noise_respects_its_deadline():
    work = tiny_mlp(init_batch_size=8)
    stats = gradient_noise(work.model, work.loss_fn, work.make_batch, "cpu", 8, rounds=50, min_rounds=2,
                           deadline=time.perf_counter() - 1)
    assert stats.rounds == 2


# ---------------------------------------------------------------------------- grids, zoo


def test_default_grid_and_sync_sizes():
    assert default_grid(64) == [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert default_grid(100, max_batch_size=400) == [6, 12, 24, 48, 96, 100, 192, 384]
    assert default_grid(1, points=3) == [1, 2, 4]
    assert _sync_sizes([4, 8, 16, 32, 64], init_batch_size=32, replicas=2, count=3) == [4, 16, 64]
    assert _sync_sizes([4, 8, 16, 32, 64], init_batch_size=32, replicas=2, count=4) == [4, 16, 32, 64]
    assert _sync_sizes([4], 32, 2, 3) == [4]


@pytest.mark.parametrize("name,options", [
    ("resnet", {"channels": (4, 8), "image_size": 8}),
    ("transformer", {"d_model": 16, "heads": 2, "layers": 1, "seq_len": 8, "vocab": 32}),
    ("mlp", {"width": 16}),
])
def test_zoo_models_train_and_pickle(name, options):
    work = zoo.get(name, **options)
    clone = pickle.loads(pickle.dumps((work.model, work.optimizer_factory, work.loss_fn, work.make_batch)))
    model, optimizer_factory, loss_fn, make_batch = clone
    optimizer = optimizer_factory(model.parameters())
    batch = make_batch(4, "cpu")
    losses = []
    for _ in range(3):  # the same batch: a few real steps lower its loss
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    assert work.profile_args()["job"] == f"zoo-{name}"
    with pytest.raises(ValidationError, match="unknown zoo model"):
        zoo.get("vgg")


def test_trainable_parameters_count_what_gradient_sync_moves():
    """Frozen parameters send no gradient, shared ones are counted once; a 16 -> 32 -> 4 MLP has 16*32+32+32*4+4."""
    work = tiny_mlp()
    assert trainable_parameters(work.model) == 16 * 32 + 32 + 32 * 4 + 4
    first = work.model.net[0]
    first.weight.requires_grad_(False)
    assert trainable_parameters(work.model) == 32 + 32 * 4 + 4
    tied = torch.nn.Sequential(first, torch.nn.ReLU(), first.__class__(32, 32), torch.nn.ReLU())
    tied.append(tied[2])  # the same layer twice: one set of gradients
    assert trainable_parameters(tied) == 32 + 32 * 32 + 32


@pytest.mark.parametrize("message, expected", [
    ("CUDA out of memory. Tried to allocate 2.00 GiB", True),
    ("CUDA error: out of memory", True),  # CUDA itself, inside a kernel or the runtime
    ("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", True),
    ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED", True),
    ("MPS backend out of memory (MPS allocated: 1.00 GB)", True),
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1000 bytes", True),
    ("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)", False),  # a bug in the job: not the sweep's end
])
def test_out_of_memory_is_recognised_in_the_words_each_library_uses(message, expected):
    """A sweep ends at the largest batch that fit when memory runs out; the last four texts had ended it with a
    ModelFailureError instead (found in review)."""
    from profilers.memory import is_out_of_memory

    assert is_out_of_memory(RuntimeError(message)) is expected
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("any")) and not is_out_of_memory(ValueError(message))
