"""GoodputReporter in real training loops: against a live server, a dead one (buffer, then delivery), DDP on gloo."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from goodput.errors import ValidationError
from service import create_app
from service.server import BackgroundServer
from profilers.reporter import GoodputReporter
from tests.service_helpers import free_port, live_server


def _train(reporter: GoodputReporter, steps: int, bsz: int, seed: int = 0) -> None:
    """Real SGD steps of a small regression MLP, each inside reporter.step()."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    w = torch.randn(16, 1)
    for _ in range(steps):
        x = torch.randn(bsz, 16)
        y = x @ w + 0.1 * torch.randn(bsz, 1)
        with reporter.step(local_bsz=bsz):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


def _stored(client, job: str) -> list[dict]:
    return [r["observation"] | {"id": r["id"]} for r in client.stored(job)["records"]]


def test_reports_reach_a_live_server_and_register_the_job(tmp_path):
    with live_server(f"sqlite:///{tmp_path / 'g.db'}", model_options={"bayesian": False}) as (url, client):
        reporter = GoodputReporter("mlp-live", url, init_batch_size=32, max_batch_size=256, model_size=6.7e5,
                                   buffer_dir=tmp_path, flush_interval=0.1)
        _train(reporter, 25, 32)
        _train(reporter, 12, 8)
        assert reporter.close() == 0
        stored = _stored(client, "mlp-live")
        assert len(stored) == reporter.sent >= 2
        assert {(o["local_bsz"], o["num_replicas"], o["gpu_type"], o["source"]) for o in stored} == \
               {(32, 1, "cpu", "training"), (8, 1, "cpu", "training")}
        assert all(o["step_time"] > 0 and o["timestamp"] > 0 and len(o["id"]) == 32 for o in stored)
        assert client.job("mlp-live")["settings"] == {"init_batch_size": 32, "max_batch_size": 256, "model_size": 6.7e5}
        assert not (tmp_path / "mlp-live.rank0.jsonl").exists()  # everything acknowledged


def test_a_dead_server_buffers_and_delivers_later_nothing_lost(tmp_path):
    port = free_port()  # nothing listens there yet
    url = f"http://127.0.0.1:{port}"
    reporter = GoodputReporter("mlp-offline", url, init_batch_size=16, buffer_dir=tmp_path, flush_interval=0.05, timeout=1)
    _train(reporter, 30, 16)
    left = reporter.close()
    buffer = tmp_path / "mlp-offline.rank0.jsonl"
    buffered = [json.loads(line) for line in buffer.read_text().splitlines()]
    assert left == len(buffered) >= 1 and reporter.sent == 0 and reporter.faults["send"] >= 1

    # the service comes back on that port while a second run trains: the first run's records go too
    app = create_app(f"sqlite:///{tmp_path / 'g.db'}", model_options={"bayesian": False}, coalesce_s=0)
    second = GoodputReporter("mlp-offline", url, init_batch_size=16, buffer_dir=tmp_path, flush_interval=0.05, timeout=1)
    _train(second, 10, 16, seed=1)
    with BackgroundServer(app, port=port) as server:
        from goodput.client import Client

        _train(second, 10, 16, seed=2)
        assert second.close() == 0
        stored = _stored(Client(server.url), "mlp-offline")
    ids = [o["id"] for o in stored]
    assert len(ids) == len(set(ids)) == second.sent
    assert {r["id"] for r in buffered} <= set(ids)
    assert not buffer.exists()


def test_the_training_loop_never_sees_the_reporters_faults(tmp_path, caplog):
    reporter = GoodputReporter("mlp-faults", "http://127.0.0.1:9", init_batch_size=8, buffer_dir=tmp_path,
                               flush_interval=60, timeout=0.5)
    with caplog.at_level(logging.WARNING, logger="goodput.reporter"):
        with reporter.step(local_bsz=0):  # a bad argument: the step runs, is not recorded, a warning says why
            pass
        with reporter.step(local_bsz="64"):
            pass
    assert reporter.faults["arguments"] == 2 and "local_bsz" in caplog.text
    with pytest.raises(ZeroDivisionError):  # the training code's own exception passes through unchanged
        with reporter.step(local_bsz=8):
            1 / 0
    assert not reporter._samples
    (tmp_path / "mlp-faults.rank0.jsonl").mkdir()  # the buffer cannot be written: still nothing raised
    _train(reporter, 6, 8)
    assert reporter.close() == 1  # the service is down too: the record is counted unsent
    assert reporter.faults["buffer"] >= 1


def test_records_reach_a_live_server_when_the_buffer_cannot_be_written(tmp_path):
    """A failed buffer append had dropped the records before they were queued: none sent, close() said 0 unsent."""
    with live_server(f"sqlite:///{tmp_path / 'g.db'}", model_options={"bayesian": False}) as (url, client):
        (tmp_path / "mlp-ro.rank0.jsonl").mkdir()  # stands for a read-only cache folder
        reporter = GoodputReporter("mlp-ro", url, init_batch_size=8, buffer_dir=tmp_path, flush_interval=60)
        _train(reporter, 6, 8)
        assert reporter.close() == 0 and reporter.sent == 1 and reporter.faults["buffer"] >= 1
        assert [o["local_bsz"] for o in _stored(client, "mlp-ro")] == [8]


def test_a_torn_buffer_line_is_cut_so_the_next_records_survive(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: every run buffers
    first = GoodputReporter("mlp-torn", url, init_batch_size=8, buffer_dir=tmp_path, flush_interval=60, timeout=0.3)
    _train(first, 10, 8)
    assert first.close() == 1
    buffer = tmp_path / "mlp-torn.rank0.jsonl"
    buffer.write_text(buffer.read_text() + '{"accum_steps":0,"gpu_ty')  # a crash in the middle of an append
    second = GoodputReporter("mlp-torn", url, init_batch_size=8, buffer_dir=tmp_path, flush_interval=60, timeout=0.3)
    _train(second, 10, 16)
    assert second.close() == 2
    records = [json.loads(line) for line in buffer.read_text().splitlines()]  # every line whole
    assert sorted(r["local_bsz"] for r in records) == [8, 16]


def test_settings_the_service_would_refuse_are_refused_at_once(tmp_path):
    url = "http://127.0.0.1:9"
    for kwargs, field in (({"gpu_type": "A100 80GB"}, "gpu_type"), ({"init_batch_size": 64, "max_batch_size": 32}, "max_batch_size"),
                          ({"init_batch_size": 8, "local_bsz_bounds": (9, 3)}, "local_bsz_bounds")):
        with pytest.raises(ValidationError) as caught:
            GoodputReporter("mlp-args", url, buffer_dir=tmp_path, **kwargs)
        assert caught.value.field == field, caught.value
    with pytest.raises(ValidationError) as caught:
        GoodputReporter("bert#2", url, buffer_dir=tmp_path)
    assert caught.value.field == "job"
    reporter = GoodputReporter("mlp-args", url, gpu_type="A100", buffer_dir=tmp_path, flush_interval=60, timeout=0.3)
    assert reporter.gpu_type == "a100"
    assert reporter.close() == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_steps_are_timed_with_events_and_named_by_the_device(tmp_path):
    from profilers.devices import normalize_device_name

    device = torch.device("cuda:0")
    torch.cuda.init()
    with live_server(f"sqlite:///{tmp_path / 'g.db'}", model_options={"bayesian": False}) as (url, client):
        reporter = GoodputReporter("cuda-mlp", url, init_batch_size=256, buffer_dir=tmp_path, flush_interval=0.1,
                                   device=device)
        assert reporter.cuda and reporter.gpu_type == normalize_device_name(torch.cuda.get_device_name(0))
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1)).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(256, 1024, device=device), torch.randn(256, 1, device=device)
        for _ in range(30):
            with reporter.step(local_bsz=256):
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
        assert reporter.close() == 0
        stored = _stored(client, "cuda-mlp")
    assert stored and all(o["gpu_type"] == reporter.gpu_type and 0 < o["step_time"] < 1 for o in stored)
