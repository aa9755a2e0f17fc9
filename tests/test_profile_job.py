"""profile_job on the CPU with real models: the sweep, its stops, gradient statistics, failures, resuming."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from goodput import JobModel, Observation, Profile
from goodput.errors import ValidationError
from profilers import ModelFailureError, profile_job, zoo
from profilers.profile import default_grid
from tests.profiler_jobs import KILL_GRID, HostOomFromBatch, NanAfterTraining, NanFromBatch, ShapeMismatch, tiny_mlp, vector_loss, wide_mlp

REPO = Path(__file__).resolve().parents[1]
QUICK = {"replicas": [], "progress": False, "cpu_threads": 1, "min_steps": 3, "max_steps": 10}


def test_sweep_measures_real_steps_that_grow_with_the_batch(tmp_path):
    work = wide_mlp()  # M0 = 32
    out = tmp_path / "wide.jsonl"
    profile = profile_job(**work.profile_args(), batch_sizes=[8, 32, 512, 8192], out=out, time_budget_s=30,
                          **{**QUICK, "max_steps": 30})

    single = sorted(profile.observations, key=lambda o: o.local_bsz)
    assert [o.local_bsz for o in single] == [8, 32, 512, 8192]
    times = [o.step_time for o in single]
    # 16x the samples each time from 32 on (8 -> 32 is close to the fixed per-step cost: not compared).
    assert times[1] < times[2] < times[3] and times[3] > 4 * times[1]
    memory = [o.memory_bytes for o in single]
    assert memory == sorted(memory) and memory[0] > 0
    for o in single:
        assert (o.gpu_type, o.num_nodes, o.num_replicas, o.placement, o.source) == ("cpu", 1, 1, (1,), "profile")
        assert o.step_time_std is not None and o.step_time_std >= 0 and o.timestamp > time.time() - 120
    # Gradient statistics ride on the observation at M0 only, positive and finite.
    with_grad = [o for o in single if o.grad_sqr is not None]
    assert [o.local_bsz for o in with_grad] == [32]
    assert 0 < with_grad[0].grad_sqr < float("inf") and 0 < with_grad[0].grad_var < float("inf")

    assert profile.job == "zoo-mlp" and profile.init_batch_size == 32 and profile.max_local_bsz == {"cpu": 8192}
    report = profile.metadata["profiler.cpu"]
    assert report["sweep_stopped"] == "grid_end" and report["complete"] and 0 < report["seconds"] < 30
    assert report["grad"]["noise_scale"] == pytest.approx(32 * with_grad[0].grad_var / with_grad[0].grad_sqr)
    # 64 -> 256 -> 256 -> 10 with biases: the gradient elements every step synchronises.
    assert profile.metadata["num_parameters"] == 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10

    # What is on disk is what was returned, and it bootstraps the job's model.
    loaded = Profile.load(out)
    assert loaded.observations == profile.observations and loaded.max_local_bsz == {"cpu": 8192}
    model = JobModel.from_profile(loaded, max_batch_size=1024)
    assert model.has_gradient_stats and model.limits("cpu").max_local_bsz == 8192
    assert model.model_size == 85_002  # places the job on the cluster prior's size slopes (goodput.hierarchy)
    assert 0 < model.predict("cpu", 1, 1, 256).step_time < float("inf")


def test_sweep_stops_at_the_memory_cap_and_grad_stats_move_to_the_largest_batch(tmp_path):
    grid = [4, 8, 16, 32, 64, 128]
    free = profile_job(**tiny_mlp(init_batch_size=128).profile_args(), batch_sizes=grid, time_budget_s=20, **QUICK)
    memory = {o.local_bsz: o.memory_bytes for o in free.observations if o.grad_sqr is None}
    cap = (memory[16] + memory[32]) // 2

    capped = profile_job(**tiny_mlp(init_batch_size=128).profile_args(), batch_sizes=grid, time_budget_s=20,
                         memory_cap_bytes=cap, out=tmp_path / "capped.jsonl", **QUICK)
    sizes = [o.local_bsz for o in capped.observations]
    assert max(sizes) == 16 and capped.max_local_bsz == {"cpu": 16}
    assert all(o.memory_bytes <= cap for o in capped.observations)
    assert capped.metadata["profiler.cpu"]["sweep_stopped"] == "memory_cap"
    # M0 = 128 never ran: the statistics ride on one more observation at the largest batch that fit.
    carriers = [o for o in capped.observations if o.grad_sqr is not None]
    assert [o.local_bsz for o in carriers] == [16] and sizes.count(16) == 2
    assert JobModel.from_profile(capped).limits("cpu").max_local_bsz == 16


def test_a_tighter_memory_cap_on_a_rerun_also_stops_at_sizes_already_measured(tmp_path):
    grid = [4, 8, 16, 32, 64, 128]
    out = tmp_path / "rerun.jsonl"
    free = profile_job(**tiny_mlp(init_batch_size=128).profile_args(), batch_sizes=grid, time_budget_s=20, out=out, **QUICK)
    assert free.max_local_bsz == {"cpu": 128}
    memory = {o.local_bsz: o.memory_bytes for o in free.observations if o.grad_sqr is None}
    cap = (memory[16] + memory[32]) // 2
    rerun = profile_job(**tiny_mlp(init_batch_size=128).profile_args(), batch_sizes=grid, time_budget_s=20,
                        memory_cap_bytes=cap, out=out, **QUICK)
    report = rerun.metadata["profiler.cpu"]
    assert report["sweep_stopped"] == "memory_cap" and report["measured"] == [4, 8, 16]
    assert rerun.max_local_bsz == {"cpu": 16} and JobModel.from_profile(rerun).limits("cpu").max_local_bsz == 16


def test_a_resumed_type_keeps_the_noise_measured_before(tmp_path):
    out = tmp_path / "resume.jsonl"
    first = profile_job(**tiny_mlp().profile_args(), batch_sizes=[4, 16], time_budget_s=10, out=out, **QUICK)
    grad = first.metadata["profiler.cpu"]["grad"]
    assert grad["rounds"] >= 2 and grad["noise_scale"] > 0
    again = profile_job(**tiny_mlp().profile_args(), batch_sizes=[4, 8, 16], time_budget_s=10, out=out, **QUICK)
    report = again.metadata["profiler.cpu"]
    assert 8 in report["measured"] and report["resumed"] == len(first.observations)  # it did resume, and measure
    assert report["grad"] == grad and Profile.load(out).metadata["profiler.cpu"]["grad"] == grad


def test_running_out_of_host_memory_ends_the_sweep_like_a_cuda_oom(tmp_path):
    work = tiny_mlp()
    profile = profile_job(HostOomFromBatch(threshold=64), work.optimizer_factory, work.loss_fn, work.make_batch, job="oom",
                          init_batch_size=16, batch_sizes=[8, 16, 32, 64, 128], time_budget_s=20, **QUICK)
    report = profile.metadata["profiler.cpu"]
    assert report["sweep_stopped"] == "oom" and report["measured"] == [8, 16, 32]
    assert profile.max_local_bsz == {"cpu": 32}


def test_a_type_that_measures_nothing_warns_and_keeps_its_summary_row(tmp_path):
    from rich.console import Console

    from profilers.summary import summary_rows

    work = tiny_mlp()
    with pytest.warns(RuntimeWarning, match=r"nothing measured on cpu \(oom\)"):
        profile = profile_job(HostOomFromBatch(threshold=1), work.optimizer_factory, work.loss_fn, work.make_batch,
                              job="oom", init_batch_size=16, batch_sizes=[8, 16], time_budget_s=20,
                              **{**QUICK, "progress": True}, console=Console(file=open(os.devnull, "w")))
    assert profile.observations == []
    rows = summary_rows(profile)  # had been no row at all: a table with a header alone
    assert [(r["device type"], r["batch sizes"], r["largest batch"]) for r in rows] == [("cpu", "0", "- (oom)")]


def test_out_that_is_a_directory_is_refused_by_name(tmp_path):
    with pytest.raises(ValidationError, match="out=.*is a directory"):
        profile_job(**tiny_mlp().profile_args(), batch_sizes=[4], out=tmp_path, time_budget_s=5, **QUICK)


def test_profiling_leaves_the_callers_random_generators_as_they_were():
    import random

    import numpy as np

    work = tiny_mlp()
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    expected = (torch.rand(4), random.random(), np.random.rand())
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    profile_job(**work.profile_args(), batch_sizes=[4, 8], time_budget_s=5, **QUICK)
    after = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(after[0], expected[0]) and after[1:] == expected[1:]


def test_sweep_honours_the_time_budget(tmp_path):
    work = wide_mlp()
    grid = [2**k for k in range(3, 20)]  # up to 524288 samples: far more than 2 s allows
    start = time.perf_counter()
    profile = profile_job(**work.profile_args(), batch_sizes=grid, time_budget_s=2.0, **QUICK)
    elapsed = time.perf_counter() - start
    report = profile.metadata["profiler.cpu"]
    assert report["sweep_stopped"] == "time_budget" and 1 <= len(report["measured"]) < len(grid)
    assert report["max_local_bsz"] == max(report["measured"])
    # A size that would end past the deadline is not started (the margin covers a busy 2-core host).
    assert report["seconds"] <= elapsed + 0.01 and elapsed < 2.0 + 4.0


def test_a_broken_model_gets_an_error_naming_device_and_batch(tmp_path):
    work = tiny_mlp()
    with pytest.raises(ModelFailureError) as info:
        profile_job(ShapeMismatch(), work.optimizer_factory, work.loss_fn, work.make_batch, job="broken",
                    init_batch_size=16, batch_sizes=[4, 8], **QUICK)
    err = info.value
    assert isinstance(err, ValueError) and err.gpu_type == "cpu" and err.local_bsz == 4  # the first micro-batch
    assert "'cpu'" in str(err) and "local batch size 4" in str(err) and "shapes" in str(err)

    out = tmp_path / "nan.jsonl"
    with pytest.raises(ModelFailureError, match=r"'cpu' at local batch size 32: non-finite loss") as info:
        profile_job(NanFromBatch(threshold=32), work.optimizer_factory, work.loss_fn, work.make_batch, job="nan",
                    init_batch_size=8, batch_sizes=[8, 16, 32, 64], out=out, **QUICK)
    assert info.value.local_bsz == 32
    # What ran before the failure is on disk.
    assert sorted(o.local_bsz for o in Profile.load(out).observations) == [8, 16]

    with pytest.raises(ModelFailureError, match="scalar"):
        profile_job(work.model, work.optimizer_factory, vector_loss, work.make_batch, job="vector",
                    init_batch_size=8, batch_sizes=[8], **QUICK)


@pytest.mark.parametrize("kwargs,field", [
    ({"init_batch_size": 0}, "init_batch_size"),
    ({"time_budget_s": -1.0}, "time_budget_s"),
    ({"batch_sizes": []}, "batch_sizes"),
    ({"batch_sizes": [8, -1]}, "batch_sizes"),
    ({"replicas": [1]}, "replicas"),
    ({"replicas": [4096]}, "replicas"),
    ({"devices": "tpu"}, "devices"),
    ({"memory_cap_bytes": 0}, "memory_cap_bytes"),
    ({"max_batch_size": 4}, "max_batch_size"),
    ({"max_batch_size": 64, "batch_sizes": [16, 64, 512]}, "batch_sizes"),  # 512 had been swept and reported
    ({"model": "not a module"}, "model"),
])
def test_arguments_are_validated(kwargs, field):
    args = {**tiny_mlp().profile_args(), "progress": False, **kwargs}
    with pytest.raises(ValidationError) as info:
        profile_job(**args)
    assert info.value.field == field


def test_out_of_another_job_is_refused(tmp_path):
    out = tmp_path / "p.jsonl"
    profile_job(**tiny_mlp().profile_args(), batch_sizes=[4], out=out, time_budget_s=5, **QUICK)
    other = {**tiny_mlp().profile_args(), "job": "other"}
    with pytest.raises(ValidationError, match="zoo-mlp"):
        profile_job(**other, batch_sizes=[4], out=out, **QUICK)


def test_out_profiled_with_another_reference_batch_is_refused(tmp_path):
    """grad_var is relative to M0: resuming with another init_batch_size would misread it."""
    out = tmp_path / "p.jsonl"
    args = tiny_mlp().profile_args()
    profile_job(**args, batch_sizes=[4], out=out, time_budget_s=5, **QUICK)
    with pytest.raises(ValidationError) as info:
        profile_job(**{**args, "init_batch_size": args["init_batch_size"] * 2}, batch_sizes=[4], out=out, **QUICK)
    assert info.value.field == "init_batch_size"


@pytest.mark.parametrize("max_batch_size", [0, -3, 2.5, "x"])
def test_default_grid_validates_its_cap(max_batch_size):
    with pytest.raises(ValidationError) as info:
        default_grid(64, max_batch_size=max_batch_size)
    assert info.value.field == "max_batch_size"


def _observations_in(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(1 for line in path.read_bytes().splitlines() if b'"record":"observation"' in line)


def test_a_killed_profiler_leaves_a_loadable_file_and_a_rerun_completes_it(tmp_path):
    out = tmp_path / "killed.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.profiler_jobs", str(out)], env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while _observations_in(out) < 2:
            assert proc.poll() is None, "the profiler ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    killed = Profile.load(out)
    before = {o.local_bsz: o for o in killed.observations}
    assert 2 <= len(before) < len(KILL_GRID)  # killed midway (the last size takes about a second)

    from tests.profiler_jobs import sweep_job

    sweep_job(str(out))  # the same call, in this process
    resumed = Profile.load(out)
    sizes = sorted(o.local_bsz for o in resumed.observations)
    assert sizes == KILL_GRID  # complete, nothing measured twice
    after = {o.local_bsz: o for o in resumed.observations}
    assert all(after[b] == obs for b, obs in before.items())  # earlier records kept as they were
    assert resumed.metadata["profiler.cpu"]["complete"] and resumed.max_local_bsz == {"cpu": KILL_GRID[-1]}
    assert sum(o.grad_sqr is not None for o in resumed.observations) == 1

    # A third run with the same settings finds the type finished and adds nothing.
    lines = out.read_bytes().count(b"\n")
    again = profile_job(**wide_mlp().profile_args(), batch_sizes=KILL_GRID, replicas=[], out=out, time_budget_s=60.0,
                        min_steps=3, max_steps=5, cpu_threads=1, progress=False)
    assert len(again.observations) == len(KILL_GRID) and _observations_in(out) == len(KILL_GRID)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert out.read_bytes().count(b"\n") == lines + 1 and records[-1]["record"] == "meta"  # only the run's meta line


def test_progress_bar_and_summary_table(capsys):
    work = tiny_mlp()
    profile_job(**work.profile_args(), batch_sizes=[4, 16], time_budget_s=5, **{**QUICK, "progress": True})
    out = capsys.readouterr().out
    for text in ("profile of zoo-mlp", "device type", "batch sizes", "step time (ms)", "largest batch", "seconds",
                 "2: 4–16", "16 (grid_end)"):
        assert text in out


def test_zoo_workloads_profile(tmp_path):
    work = zoo.get("transformer", d_model=16, heads=2, layers=1, seq_len=8, vocab=32, init_batch_size=4)
    profile = profile_job(**work.profile_args(), batch_sizes=[2, 4], time_budget_s=5, **QUICK)
    assert sorted(o.local_bsz for o in profile.observations) == [2, 4]
    assert profile.observations[1].grad_sqr is not None


def test_summary_says_when_the_noise_scale_is_unresolved():
    from goodput.efficiency import GRAD_SQR_FLOOR
    from profilers.summary import summary_rows

    obs = [Observation("j", "cpu", 1, 1, 16, step_time=0.01)]
    for grad, shown in (({"grad_sqr": 0.5, "grad_var": 2.0, "noise_scale": 256.0}, "256"),
                        ({"grad_sqr": GRAD_SQR_FLOOR, "grad_var": 2.0, "noise_scale": 64 * 2.0 / GRAD_SQR_FLOOR},
                         "unresolved (|g|² ≤ 0)"),
                        ({"skipped": "out of memory at micro-batch size 1"}, "-")):
        profile = Profile(obs, job="j", init_batch_size=64, metadata={"profiler.cpu": {"grad": grad}})
        assert summary_rows(profile)[0]["noise scale"] == shown


def test_each_sweep_size_starts_from_the_initial_state_so_training_carried_over_cannot_diverge(tmp_path):
    """4 training steps per size (1 warm-up, 3 timed); NanAfterTraining(12) fails on the 4th size if
    the sizes share one model (the gradient noise's 2 rounds of 4 forwards run on a copy of their own)."""
    work = tiny_mlp()
    carried = NanAfterTraining(limit=12)
    x, _ = work.make_batch(4, "cpu")
    assert all(torch.isfinite(carried(x)).all() for _ in range(12)) and not torch.isfinite(carried(x)).any()

    out = tmp_path / "carried.jsonl"
    profile = profile_job(NanAfterTraining(limit=12), work.optimizer_factory, work.loss_fn, work.make_batch,
                          job="carried", init_batch_size=8, batch_sizes=[4, 8, 16, 32], warmup=1, noise_rounds=2,
                          **{**QUICK, "min_steps": 3, "max_steps": 3}, out=out)
    assert sorted(o.local_bsz for o in profile.observations) == [4, 8, 16, 32]
    assert all(o.step_time > 0 for o in profile.observations)


def test_on_observation_sees_each_new_observation_and_a_named_device_type_labels_them(tmp_path):
    from profilers.devices import DeviceType

    work = tiny_mlp()
    out = tmp_path / "named.jsonl"
    seen = []
    host = DeviceType("Xeon-Gold", ("cpu",), ("the host",))  # what a cluster calls this node's CPU
    profile = profile_job(**work.profile_args(), batch_sizes=[4, 8], devices=[host], out=out, time_budget_s=10,
                          on_observation=seen.append, **QUICK)
    assert seen == profile.observations and [o.local_bsz for o in seen] == [4, 8]
    assert {o.gpu_type for o in seen} == {"xeon-gold"} and profile.metadata["profiler.xeon-gold"]["complete"]
    assert Profile.load(out).observations == seen  # on disk before the callback saw them
    seen.clear()
    profile_job(**work.profile_args(), batch_sizes=[4, 8, 16], devices=[host], out=out, time_budget_s=10,
                on_observation=seen.append, **QUICK)
    assert [o.local_bsz for o in seen] == [16]  # resumed: only the new size is news
    with pytest.raises(ValidationError, match="on_observation"):
        profile_job(**work.profile_args(), on_observation="print", **QUICK)
    with pytest.raises(ValidationError, match="devices=.*CUDA devices present"):
        profile_job(**work.profile_args(), devices=[DeviceType("a100", ("cuda:7",), ("A100",))], **QUICK)
