"""Synchronisation profiling with real gloo processes on the CPU (DistributedDataParallel, 2 replicas)."""

from __future__ import annotations

import threading
import time

import pytest

from goodput import Cluster, JobModel
from goodput.errors import ValidationError
from profilers import ModelFailureError, profile_job
from profilers.sync import profile_sync
from tests.profiler_jobs import BufferedClassifier, KilledReplica, NanAfterTraining, NanFromBatch, SpareHead, tiny_mlp


def test_two_gloo_replicas_record_sync_time(tmp_path):
    work = tiny_mlp(init_batch_size=16)
    out = tmp_path / "sync.jsonl"
    profile = profile_job(**work.profile_args(), batch_sizes=[4, 16, 64], replicas=[2], cpu_threads=1,
                          sync_sizes=2, time_budget_s=20, out=out, progress=False, min_steps=5, max_steps=20)
    multi = sorted((o for o in profile.observations if o.num_replicas == 2), key=lambda o: o.local_bsz)
    assert [o.local_bsz for o in multi] == [4, 64]  # the smallest and the largest measured size
    for o in multi:
        assert o.placement == (2,) and o.num_nodes == 1 and o.batch_size == 2 * o.local_bsz
        # A tiny model's gradients take a gloo all-reduce that its compute cannot hide.
        assert 0 < o.sync_time <= o.step_time and o.compute_time > 0
        assert o.memory_bytes > 0 and o.step_time_std >= 0 and o.source == "profile"
    report = profile.metadata["profiler.cpu"]
    assert report["threads"] == 1 and report["sync"]["2"]["stopped"] == "done" and report["sync"]["2"]["measured"] == [4, 64]
    assert set(report["sync"]["2"]["compute_time"]) == {"4", "64"}

    # The replicas' observations bootstrap the synchronisation terms of the job's model.
    model = JobModel.from_profile(profile)
    params = model.params("cpu")
    assert params.alpha_r > 0
    table = model.table(Cluster.parse("cpu:1x2"))
    assert list(table.frame["num_gpus"]) == [1, 2] and (table.frame["goodput"] > 0).all()

    # Rerun: every configuration is on disk already, nothing is measured again.
    size = out.stat().st_size
    again = profile_job(**work.profile_args(), batch_sizes=[4, 16, 64], replicas=[2], cpu_threads=1, sync_sizes=2,
                        time_budget_s=20, out=out, progress=False, min_steps=5, max_steps=20)
    assert again.observations == profile.observations
    added = out.read_text()[size:].splitlines()
    assert len(added) == 1 and '"record":"meta"' in added[0]  # this run's settings, no observation


def test_a_model_with_a_parameter_without_gradient_is_synchronised(tmp_path):
    """DDP must look for unused parameters then (a spare head), or its second step fails."""
    work = tiny_mlp(init_batch_size=16)
    args = {**work.profile_args(), "model": SpareHead()}
    profile = profile_job(**args, batch_sizes=[4, 16], replicas=[2], cpu_threads=1, sync_sizes=1, time_budget_s=20,
                          out=tmp_path / "spare.jsonl", progress=False, min_steps=3, max_steps=5)
    multi = [o for o in profile.observations if o.num_replicas == 2]
    assert len(multi) == 1 and 0 < multi[0].sync_time <= multi[0].step_time


def test_a_replica_failure_names_device_batch_and_replicas():
    work = tiny_mlp()
    pieces = (NanFromBatch(threshold=16), work.optimizer_factory, work.loss_fn, work.make_batch)
    seen = []
    with pytest.raises(ModelFailureError, match=r"'cpu' at local batch size 16 with 2 replicas: .*non-finite") as info:
        profile_sync(pieces, ["cpu"], 2, [4, 16], gpu_type="cpu", deadline=time.time() + 30, threads=1,
                     min_steps=2, max_steps=3, target_seconds=0.01, on_result=seen.append)
    assert info.value.num_replicas == 2 and info.value.local_bsz == 16
    assert [r.local_bsz for r in seen] == [4]  # what was measured before the failure was delivered


def test_a_replica_killed_from_outside_is_named_not_blamed_on_the_model():
    """Rank 0's collective fails first ('Connection reset by peer'): that had been raised as the model's failure."""
    work = tiny_mlp()
    pieces = (work.model, work.optimizer_factory, work.loss_fn, KilledReplica(threshold=16))
    with pytest.raises(ModelFailureError, match=r"replica 1 died \(killed by SIGKILL") as info:
        profile_sync(pieces, ["cpu"], 2, [4, 16], gpu_type="cpu", deadline=time.time() + 30, threads=1,
                     min_steps=2, max_steps=3, target_seconds=0.01)
    assert info.value.local_bsz == 16


def test_lambdas_reach_the_replicas_and_what_does_not_pickle_is_refused_before_spawning():
    work = tiny_mlp()
    seen = []
    pieces = (work.model, work.optimizer_factory, lambda model, batch: work.loss_fn(model, batch),
              lambda bsz, device: work.make_batch(bsz, device))  # by value, as Ray ships functions
    outcome = profile_sync(pieces, ["cpu"], 2, [4], gpu_type="cpu", deadline=time.time() + 30, threads=1,
                           min_steps=2, max_steps=3, target_seconds=0.01, on_result=seen.append)
    assert [r.local_bsz for r in outcome.results] == [4] == [r.local_bsz for r in seen]
    lock = threading.Lock()
    pieces = (work.model, work.optimizer_factory, lambda model, batch: (lock, work.loss_fn(model, batch))[1], work.make_batch)
    with pytest.raises(ValidationError, match="optimizer_factory, loss_fn, make_batch did not pickle.*lock"):
        profile_sync(pieces, ["cpu"], 2, [4], gpu_type="cpu", deadline=time.time() + 10)


def test_a_bare_device_name_is_refused_naming_devices():
    """'cpu' as a string had been read a character at a time, and blamed on the model ('device string: p')."""
    work = tiny_mlp()
    pieces = (work.model, work.optimizer_factory, work.loss_fn, work.make_batch)
    for devices, replicas in (("cpu", 2), ([], 2), (["cuda:0"], 2)):
        with pytest.raises(ValidationError, match="devices"):
            profile_sync(pieces, devices, replicas, [4], gpu_type="cpu", deadline=time.time() + 10)
    with pytest.raises(ValidationError, match="num_replicas"):
        profile_sync(pieces, ["cpu"], 1, [4], gpu_type="cpu", deadline=time.time() + 10)


def test_replicas_measure_the_first_size_then_stop_at_the_deadline():
    work = tiny_mlp()
    pieces = (work.model, work.optimizer_factory, work.loss_fn, work.make_batch)
    outcome = profile_sync(pieces, ["cpu"], 2, [4, 8, 16], gpu_type="cpu", deadline=time.time() - 1, threads=1,
                           min_steps=2, max_steps=3, target_seconds=0.01)
    assert outcome.stopped == "time_budget" and [r.local_bsz for r in outcome.results] == [4]
    result = outcome.results[0]
    assert result.num_replicas == 2 and 2 <= result.steps <= 3 and result.sync_time <= result.step_time
    assert result.compute_time > 0 and outcome.seconds > 0


def test_each_replicated_size_starts_from_the_initial_state():
    """A replica trains through its sizes in one process: 8 training steps per size (1 warm-up
    synchronised step, 1 local, 3 pairs); NanAfterTraining(12) fails at the second size if the
    sizes share the state (checked first with 8 pairs at one size), and at the first if the
    replicas share the model's memory (spawning pickles tensors into shared memory)."""
    work = tiny_mlp()
    pieces = (NanAfterTraining(limit=12), work.optimizer_factory, work.loss_fn, work.make_batch)
    quick = {"gpu_type": "cpu", "threads": 1, "warmup": 1, "target_seconds": 10.0}
    with pytest.raises(ModelFailureError, match="non-finite"):
        profile_sync(pieces, ["cpu"], 2, [4], deadline=time.time() + 30, min_steps=8, max_steps=8, **quick)
    outcome = profile_sync(pieces, ["cpu"], 2, [4, 8], deadline=time.time() + 30, min_steps=3, max_steps=3, **quick)
    assert [r.local_bsz for r in outcome.results] == [4, 8] and outcome.stopped == "done"
    assert int(pieces[0].trained) == 0  # the caller's model is untouched: each replica trained its own copy


def test_buffer_broadcasts_are_timed_in_the_synchronised_steps(tmp_path):
    """DDP broadcasts buffers (BatchNorm statistics) in a forward pass when the previous one synchronised.
    Training synchronises every step, so the sync steps must pay for it, not the local ones."""
    import queue

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from profilers.sync import _run_sizes

    work = tiny_mlp()
    model = BufferedClassifier()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        counts = {"local": 0, "sync": 0}
        broadcast = ddp._sync_buffers

        def counted() -> None:
            counts["sync" if ddp.require_backward_grad_sync else "local"] += 1
            broadcast()

        ddp._sync_buffers = counted
        results: queue.Queue = queue.Queue()
        settings = {"threads": 1, "deadline": time.time() + 30, "warmup": 1, "min_steps": 4, "max_steps": 4,
                    "target_seconds": 0.01, "estimates": {}}
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        _run_sizes(0, ddp, work.optimizer_factory, initial, work.loss_fn, work.make_batch, torch.device("cpu"), [8],
                   settings, results, dist)
    finally:
        dist.destroy_process_group()
    kind, result = results.get_nowait()
    assert kind == "result" and result["steps"] == 4
    # 1 synchronised warm-up step and 4 timed ones broadcast; the warm-up's local step and the 4 timed ones do not
    assert counts == {"local": 0, "sync": 5}
