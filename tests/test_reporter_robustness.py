"""GoodputReporter where real training scripts get odd: two runs of one job on a host, a server's body limit, a
server that hangs, forks, numpy integers, steps after close; and the client's checks of what it sends."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from goodput.client import Client, NotReadyError, ServiceUnavailableError
from goodput.errors import ValidationError
from profilers.reporter import GoodputReporter
from tests.service_helpers import live_server
from tests.test_reporter import _stored, _train


def test_two_live_reporters_of_one_job_keep_their_own_buffers_and_a_dead_ones_records_are_adopted(tmp_path):
    url = "http://127.0.0.1:9"  # nothing listens: everything stays buffered
    first = GoodputReporter("twin", url, init_batch_size=8, buffer_dir=tmp_path, flush_interval=60, timeout=1)
    second = GoodputReporter("twin", url, init_batch_size=8, buffer_dir=tmp_path, flush_interval=60, timeout=1)
    assert first.buffer_path.name == "twin.rank0.jsonl" and second.buffer_path.name == f"twin.rank0.pid{os.getpid()}.jsonl"
    _train(first, 6, 8)
    _train(second, 6, 16)
    assert first.close(timeout=5) >= 1 and second.close(timeout=5) >= 1
    first_ids = {json.loads(line)["id"] for line in first.buffer_path.read_text().splitlines()}
    second_ids = {json.loads(line)["id"] for line in second.buffer_path.read_text().splitlines()}
    assert first_ids and second_ids and not first_ids & second_ids
    # both died with records unsent: the next run of the job holds them all, and sends them
    with live_server(f"sqlite:///{tmp_path / 'g.db'}", model_options={"bayesian": False}) as (live, client):
        third = GoodputReporter("twin", live, init_batch_size=8, buffer_dir=tmp_path, flush_interval=0.05)
        assert third.close() == 0
        assert {o["id"] for o in _stored(client, "twin")} == first_ids | second_ids
    assert sorted(p.name for p in tmp_path.glob("twin.*.jsonl")) == []


def _body_limited(max_records: int, seen: list[int]) -> httpx.MockTransport:
    """A service that answers 413 to more than ``max_records`` observations in one POST."""
    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "PUT":
            return httpx.Response(200, json={"job": "big"})
        count = len(json.loads(request.content)["observations"])
        if count > max_records:
            return httpx.Response(413, json={"detail": "request body too large"})
        seen.append(count)
        return httpx.Response(200, json={"accepted": count, "total": count})
    return httpx.MockTransport(handle)


def test_a_backlog_over_the_servers_body_limit_is_sent_in_halves(tmp_path):
    backlog = [{"id": f"{i:032x}", "job": "big", "gpu_type": "cpu", "num_nodes": 1, "num_replicas": 1, "local_bsz": 8,
                "accum_steps": 0, "step_time": 0.01} for i in range(600)]
    (tmp_path / "big.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in backlog))
    seen: list[int] = []
    reporter = GoodputReporter("big", "http://goodput.test", init_batch_size=8, buffer_dir=tmp_path,
                               flush_interval=60, transport=_body_limited(200, seen))
    assert reporter.close() == 0 and reporter.sent == 600 and max(seen) <= 200 and sum(seen) == 600
    # a single record the service still refuses is set aside, not retried forever
    (tmp_path / "big.rank0.jsonl").write_text(json.dumps(backlog[0]) + "\n")
    reporter = GoodputReporter("big", "http://goodput.test", init_batch_size=8, buffer_dir=tmp_path,
                               flush_interval=60, transport=_body_limited(0, []))
    assert reporter.close() == 0 and reporter.faults["rejected"] == 1
    assert (tmp_path / "big.rank0.rejected.jsonl").read_text().count("\n") == 1


def test_close_returns_in_about_its_timeout_when_the_service_hangs(tmp_path, caplog):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)  # accepts connections, never answers
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        reporter = GoodputReporter("hang", url, init_batch_size=8, buffer_dir=tmp_path, flush_interval=0.05, timeout=5)
        _train(reporter, 6, 8)
        time.sleep(0.3)  # the background thread is inside a request now
        started = time.monotonic()
        left = reporter.close(timeout=1.0)
        assert time.monotonic() - started < 3.0
        assert left >= 1 and len((tmp_path / "hang.rank0.jsonl").read_text().splitlines()) >= 1  # kept for the next run
        # and said where the script's log shows it (close had returned the count alone)
        assert f"{left} record(s) not sent, kept in {tmp_path / 'hang.rank0.jsonl'}" in caplog.text
    finally:
        server.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_records_and_sends_nothing_and_exits_at_once(tmp_path):
    reporter = GoodputReporter("forked", "http://127.0.0.1:9", init_batch_size=8, buffer_dir=tmp_path,
                               flush_interval=60, timeout=1)
    _train(reporter, 5, 8)  # pending steps the child must not send again
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            with reporter.step(local_bsz=8):
                pass
            started = time.monotonic()
            left = reporter.close(timeout=30)
            os.write(write, json.dumps([reporter.active, len(reporter._samples), left, time.monotonic() - started]).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    active, samples, left, seconds = json.loads(os.read(read, 1000))
    assert (active, samples, left) == (False, 0, 0) and seconds < 1.0
    assert reporter.active and len(reporter._samples) >= 1  # the parent's are untouched
    assert reporter.close(timeout=5) >= 1


def test_numpy_batch_sizes_count_and_steps_after_close_are_refused_aloud(tmp_path):
    with live_server(f"sqlite:///{tmp_path / 'g.db'}", model_options={"bayesian": False}) as (url, client):
        reporter = GoodputReporter("npint", url, init_batch_size=8, buffer_dir=tmp_path, flush_interval=60, warmup_steps=0)
        for _ in range(3):
            with reporter.step(local_bsz=np.int64(8), accum_steps=np.int32(0)):
                time.sleep(0.001)
        assert reporter.close() == 0 and reporter.sent == 1 and not reporter.faults
        with reporter.step(local_bsz=8):
            pass
        assert reporter.faults["closed"] == 1 and not reporter._samples
        (stored,) = _stored(client, "npint")
        assert stored["local_bsz"] == 8 and stored["accum_steps"] == 0


@pytest.mark.parametrize("call, field", [
    (lambda c: c.put_job("j", 8, gpu_types="t4"), "gpu_types"),
    (lambda c: c.put_job("j", 8, local_bsz_bounds=5), "local_bsz_bounds"),
    (lambda c: c.put_job("j", 8, local_bsz_bounds={"t4": (1, 2, 3)}), "local_bsz_bounds['t4']"),
    (lambda c: c.put_job("j", 8, model_size=math.nan), "model_size"),
    (lambda c: c.post_observations("j", [{"step_time": math.inf}]), "observations[0].step_time"),
])
def test_the_client_refuses_what_it_cannot_send_naming_the_field(call, field):
    client = Client("http://127.0.0.1:9", transport=httpx.MockTransport(lambda r: httpx.Response(500)))
    with pytest.raises(ValidationError) as caught:
        call(client)
    assert caught.value.field == field


@pytest.mark.parametrize("timeout", [0, -1, "10", math.nan])
def test_a_client_s_timeout_is_checked_when_it_is_made(timeout):
    with pytest.raises(ValidationError, match="timeout"):
        Client("http://127.0.0.1:9", timeout=timeout)
    with pytest.raises(ValidationError, match="timeout"):
        GoodputReporter("j", "http://127.0.0.1:9", timeout=timeout)


def test_queries_wait_while_a_new_job_s_model_is_built_as_retry_after_says():
    answers = iter([httpx.Response(503, json={"detail": "being fitted"}, headers={"Retry-After": "0.1"})] * 2
                   + [httpx.Response(200, json={"goodput": 5.0})])
    client = Client("http://goodput.test", transport=httpx.MockTransport(lambda r: next(answers)))
    started = time.monotonic()
    assert client.goodput("j", "t4")["goodput"] == 5.0 and time.monotonic() - started >= 0.2
    impatient = Client("http://goodput.test", wait=0, transport=httpx.MockTransport(
        lambda r: httpx.Response(503, json={"detail": "being fitted"}, headers={"Retry-After": "2"})))
    with pytest.raises(NotReadyError):
        impatient.goodput("j", "t4")
    with pytest.raises(ValidationError, match="wait"):
        Client("http://goodput.test", wait=-1)


def test_a_wait_shorter_than_retry_after_still_waits_and_tries_again():
    """The server asks for 2 s; Client(wait=0.3) had given up at once, as if wait were 0."""
    calls = []

    def answer(request):
        calls.append(time.monotonic())
        if len(calls) == 1:
            return httpx.Response(503, json={"detail": "being fitted"}, headers={"Retry-After": "2"})
        return httpx.Response(200, json={"goodput": 5.0})

    client = Client("http://goodput.test", wait=0.3, transport=httpx.MockTransport(answer))
    assert client.goodput("j", "t4")["goodput"] == 5.0 and 0.25 <= calls[1] - calls[0] < 1.5


@pytest.mark.parametrize("header, seconds", [
    ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # an HTTP date (a proxy's), past: had been a bare ValueError
    ("soon", 1.0), ("nan", 1.0), ("-3", 0.0), ("0.5", 0.5),
])
def test_retry_after_is_read_as_a_number_or_an_http_date(header, seconds):
    client = Client("http://goodput.test", wait=0, transport=httpx.MockTransport(
        lambda r: httpx.Response(503, json={"detail": "busy"}, headers={"Retry-After": header})))
    with pytest.raises(NotReadyError) as info:
        client.goodput("j", "t4")
    assert info.value.retry_after == seconds


def test_attach_refuses_a_model_that_is_not_ddp(tmp_path):
    import torch

    reporter = GoodputReporter("plain", "http://127.0.0.1:9", init_batch_size=8, buffer_dir=tmp_path, timeout=1)
    try:
        with pytest.raises(ValidationError, match="ddp_model"):
            reporter.attach(torch.nn.Linear(4, 1))
    finally:
        reporter.close(timeout=2)


def test_a_third_reporter_in_one_process_gets_a_locked_file_of_its_own(tmp_path):
    url = "http://127.0.0.1:9"
    reporters = [GoodputReporter("trio", url, init_batch_size=8, buffer_dir=tmp_path, flush_interval=60, timeout=1)
                 for _ in range(3)]
    try:
        paths = [r.buffer_path for r in reporters]
        assert len(set(paths)) == 3 and all(r._lock_fd is not None for r in reporters)
    finally:
        for r in reporters:
            r.close(timeout=2)
    # a dead reporter that left no records leaves no lock file behind for good
    stale = tmp_path / "trio.rank0.pid1.jsonl.lock"
    stale.write_text("")
    GoodputReporter("trio", url, init_batch_size=8, buffer_dir=tmp_path, flush_interval=60, timeout=1).close(timeout=2)
    assert not stale.exists()


def test_close_is_bounded_when_its_own_last_send_meets_a_hung_service(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    try:
        reporter = GoodputReporter("idle", f"http://127.0.0.1:{server.getsockname()[1]}", init_batch_size=8,
                                   buffer_dir=tmp_path, flush_interval=60, timeout=10)  # the thread never sends
        _train(reporter, 6, 8)
        started = time.monotonic()
        assert reporter.close(timeout=1.0) >= 1 and time.monotonic() - started < 3.0
    finally:
        server.close()


def test_attach_takes_a_compiled_ddp_model():
    """torch.compile(DDP(model)), the order PyTorch recommends: the hook goes on the DDP inside."""
    code = """
import os, tempfile, torch, torch.distributed as dist
from profilers.reporter import GoodputReporter
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
compiled = torch.compile(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1)))
reporter = GoodputReporter("c", "http://127.0.0.1:9", init_batch_size=8, buffer_dir=tempfile.mkdtemp(), timeout=1)
assert reporter.attach(compiled) is reporter
reporter.close(timeout=2)
dist.destroy_process_group()
print("attached")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "attached" in result.stdout, result.stderr[-2000:]


def test_the_hook_times_each_steps_exposed_sync_and_a_step_without_buckets_leaves_it_unmeasured():
    """One gloo replica under DDP: every timed step's buckets carry their ready and reduced times, so each
    observation has a ``sync_time`` within its step; steps whose hook did not run (outside DDP) carry none."""
    code = """
import json, tempfile, torch, torch.distributed as dist
from profilers.reporter import GoodputReporter
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
buffer = tempfile.mkdtemp()
reporter = GoodputReporter("s", "http://127.0.0.1:9", init_batch_size=8, buffer_dir=buffer, timeout=1, warmup_steps=1)
reporter.attach(ddp)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
for _ in range(6):
    with reporter.step(local_bsz=32):
        optimizer.zero_grad()
        ddp(torch.randn(32, 64)).pow(2).mean().backward()
        optimizer.step()
for _ in range(4):  # the module alone: no hook, no sync time
    with reporter.step(local_bsz=16):
        optimizer.zero_grad()
        model(torch.randn(16, 64)).pow(2).mean().backward()
        optimizer.step()
reporter.close(timeout=2)
print(json.dumps([json.loads(line) for line in open(reporter.buffer_path)]))
dist.destroy_process_group()
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    records = {r["local_bsz"]: r for r in json.loads(result.stdout.strip().splitlines()[-1])}
    assert set(records) == {32, 16}
    assert 0 < records[32]["sync_time"] < records[32]["step_time"]
    assert records[16].get("sync_time") is None


@pytest.mark.parametrize("timeout", [None, httpx.Timeout(5.0)])
def test_a_client_takes_httpx_s_own_timeouts(timeout):
    assert Client("http://127.0.0.1:9", timeout=timeout).timeout is timeout


def test_a_client_deadline_bounds_every_request_inside_it():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)  # accepts, never answers
    try:
        client = Client(f"http://127.0.0.1:{server.getsockname()[1]}", timeout=10)
        started = time.monotonic()
        with client.deadline(started + 0.5):
            with pytest.raises(ServiceUnavailableError):
                client.job("j")  # a settings read, as a reporter's gradient fold makes: cut to the deadline
            with pytest.raises(ServiceUnavailableError, match="deadline has passed"):
                client.job("j")
        assert time.monotonic() - started < 2.0
    finally:
        server.close()


@pytest.mark.parametrize("handler", ["default", "own"])
def test_sigterm_keeps_the_steps_timed_since_the_last_flush(tmp_path, handler):
    """How Slurm and Kubernetes stop a job: Python's default SIGTERM skips atexit, and the steps since the last
    flush (up to flush_interval of them) had been lost. The reporter closes first; the process then ends as
    SIGTERM would have ended it, or the training script's own handler runs."""
    import signal
    own = "signal.signal(signal.SIGTERM, lambda s, f: (print('own handler', flush=True), sys.exit(7)))\n"
    code = (
        "import signal, sys, time\n"
        + (own if handler == "own" else "")
        + "from profilers.reporter import GoodputReporter\n"
        f"reporter = GoodputReporter('preempted', 'http://127.0.0.1:9', init_batch_size=8, buffer_dir={str(tmp_path)!r},\n"
        "                           flush_interval=600, warmup_steps=0, timeout=1)\n"
        "for _ in range(20):\n"
        "    with reporter.step(local_bsz=8):\n"
        "        time.sleep(0.001)\n"
        "print('trained', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "trained"
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == (-signal.SIGTERM if handler == "default" else 7)
    assert ("own handler" in out) == (handler == "own")
    records = [json.loads(line) for path in tmp_path.glob("preempted.rank0*.jsonl") for line in path.read_text().splitlines()]
    assert len(records) == 1 and records[0]["job"] == "preempted" and records[0]["local_bsz"] == 8


def test_accumulation_without_no_sync_gives_no_gradient_statistics():
    """Accumulating micro-batches without ``no_sync()`` reduces each bucket at every micro-batch: the sums had mixed
    averaged gradients into the local norms (|G|² 49% high with 2 replicas; found in review). Such a step keeps its
    time and gives no gradient statistics; with ``no_sync()`` on all but the last micro-batch it gives them."""
    code = """
import contextlib, tempfile, torch, torch.distributed as dist
from profilers.reporter import GoodputReporter
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
reporter = GoodputReporter("a", "http://127.0.0.1:9", init_batch_size=8, buffer_dir=tempfile.mkdtemp(), timeout=1,
                           warmup_steps=1)
reporter.attach(ddp)
counts = []
for quiet_first in (False, True):
    before = len(reporter._grads)
    for _ in range(4):
        with reporter.step(local_bsz=8, accum_steps=1):
            for micro in range(2):
                quiet = ddp.no_sync() if quiet_first and micro == 0 else contextlib.nullcontext()
                with quiet:
                    ddp(torch.randn(8, 16)).pow(2).mean().backward()
    counts.append(len(reporter._grads) - before)
print("counts", counts[0], counts[1], len(reporter._samples))
reporter.close(timeout=2)
dist.destroy_process_group()
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    _, naive, quiet, timed = result.stdout.split()[-4:]
    assert (int(naive), int(quiet)) == (0, 4) and int(timed) >= 6  # the warm-up (the first step of the key) is a naive one


def test_a_configuration_whose_record_is_refused_loses_only_its_own_steps(tmp_path):
    """One configuration's median step beyond MAX_STEP_TIME (a clock that jumped) is an ``aggregate`` fault; the
    flush keeps the other configurations' records (it had dropped them all)."""
    from goodput.observations import MAX_STEP_TIME

    with socket.socket() as probe:  # a port nothing listens on: sending is not what is tested
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    reporter = GoodputReporter("bad", f"http://127.0.0.1:{port}", init_batch_size=8, buffer_dir=tmp_path,
                               flush_interval=3600, warmup_steps=0)
    try:
        now = time.time()
        for duration in (0.1, 0.12):
            reporter._samples.append(((1, 1, 8, 0), duration, now, None))
        for duration in (2 * MAX_STEP_TIME, 3 * MAX_STEP_TIME):
            reporter._samples.append(((1, 1, 16, 0), duration, now, None))
        records = reporter._aggregate(final=True)
        assert [(r["local_bsz"], r["step_time"]) for r in records] == [(8, pytest.approx(0.11))]
        assert reporter.faults["aggregate"] == 1
    finally:
        reporter.close(timeout=1.0)
