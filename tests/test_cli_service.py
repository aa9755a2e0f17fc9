"""`goodput table --server` (the Slurm-friendly export) and `goodput serve`'s arguments."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from cli import main
from goodput import GoodputTable, Profile
from profilers import zoo
from tests.service_helpers import live_server, profile, wait_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    with live_server(f"sqlite:///{folder / 'g.db'}", cluster="cpu:2x4", model_options={"bayesian": False}) as (url, client):
        prof = profile("mlp")
        client.put_job(prof.job, prof.init_batch_size, prof.max_batch_size)
        client.post_observations(prof.job, prof.observations)
        wait_for(lambda: client.goodput(prof.job, "cpu", 1, 1))
        yield url, client


def test_table_prints_csv_and_json_and_writes_a_file(server, capsys, tmp_path):
    url, client = server
    assert main(["table", "--server", url, "--job", "zoo-mlp", "--cluster", "cpu:3x2", "--format", "csv"]) == 0
    frame = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert list(frame.columns[:5]) == ["job", "gpu_type", "num_nodes", "num_gpus", "goodput"]
    assert frame["num_gpus"].tolist() == [1, 2, 4, 6] and (frame["job"] == "zoo-mlp").all()
    assert frame["goodput"].tolist() == pytest.approx(client.table("zoo-mlp", "cpu:3x2").frame["goodput"].tolist())
    assert main(["table", "--server", url, "--job", "zoo-mlp", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"] == "cpu:2x4" and len(data["rows"]) == 4
    out = tmp_path / "zoo-mlp.csv"
    assert main(["table", "--server", url, "--job", "zoo-mlp", "--out", str(out)]) == 0
    assert GoodputTable.from_csv(out).configurations() == [("cpu", 1, 1), ("cpu", 1, 2), ("cpu", 1, 4), ("cpu", 2, 8)]


def test_table_errors_are_one_line(server, capsys):
    url, _ = server
    assert main(["table", "--server", url, "--job", "nobody"]) == 2
    assert "404" in capsys.readouterr().err
    assert main(["table", "--server", url, "--job", "zoo-mlp", "--cluster", "t4:1x1"]) == 0
    assert "no observations on t4" in capsys.readouterr().err
    assert main(["table", "--server", "http://127.0.0.1:9", "--job", "zoo-mlp"]) == 2
    assert "ConnectError" in capsys.readouterr().err
    assert main(["table", "--server", "ftp://x", "--job", "zoo-mlp"]) == 2
    assert "url=" in capsys.readouterr().err


def test_profile_server_registers_the_job_with_its_size_first_and_a_refusal_is_one_line(tmp_path, capsys):
    from service.app import create_app
    from service.server import BackgroundServer
    from goodput.client import Client

    tokens = tmp_path / "tokens.txt"
    tokens.write_text("tok-0123456789abcdef0123\n")
    args = ["profile", "--zoo", "mlp", "--batch-sizes", "8", "--replicas", "0", "--time-budget", "3", "--no-progress"]
    with BackgroundServer(create_app(f"sqlite:///{tmp_path / 'g.db'}", token_file=tokens,
                                     model_options={"bayesian": False})) as server:
        out = tmp_path / "refused.jsonl"
        assert main([*args, "--out", str(out), "--server", server.url, "--token", "wrong-token-0123456789"]) == 2
        err = capsys.readouterr().err
        assert "HTTP 401" in err and "Traceback" not in err and not out.exists()  # refused before any profiling
        out = tmp_path / "mlp.jsonl"
        assert main([*args, "--out", str(out), "--server", server.url, "--token", "tok-0123456789abcdef0123"]) == 0
        settings = Client(server.url).job("zoo-mlp")["settings"]
        assert settings["model_size"] == Profile.load(out).metadata["num_parameters"] > 0  # the size a prior scales by


def test_serve_refuses_bad_arguments_before_starting(tmp_path, capsys):
    assert main(["serve", "--port", "-1"]) == 2
    assert "port" in capsys.readouterr().err
    (tmp_path / "tokens").write_text("short\n")
    assert main(["serve", "--port", "0", "--token-file", str(tmp_path / "tokens"), "--store", f"sqlite:///{tmp_path}/g.db"]) == 2
    assert "shorter than 16" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--token-file", str(tmp_path / "missing"), "--store", f"sqlite:///{tmp_path}/g.db"]) == 2
    assert "cannot be read" in capsys.readouterr().err
    assert main(["serve", "--export-dir", str(tmp_path), "--store", f"sqlite:///{tmp_path}/g.db"]) == 2
    assert "needs a cluster" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("not a database " * 100)
    assert main(["serve", "--port", "0", "--cluster", "cpu:1x2", "--export-dir", str(tmp_path / "a-file"),
                 "--store", f"sqlite:///{tmp_path}/g.db"]) == 2
    assert "export_dir" in capsys.readouterr().err
    for store in (f"sqlite:///{tmp_path}/missing/g.db", f"sqlite:///{tmp_path / 'a-file'}"):  # no folder; no database
        assert main(["serve", "--port", "0", "--store", store]) == 2
        err = capsys.readouterr().err
        assert "cannot be opened" in err and "Traceback" not in err
    # each refusal above came before the store was opened: no database was made (had been g.db, with its tables)
    assert not (tmp_path / "g.db").exists()
    assert main(["serve", "--port", "0", "--cluster-prior", str(tmp_path / "missing.json"),
                 "--store", f"sqlite:///{tmp_path}/g.db"]) == 2
    assert "cluster_prior=" in capsys.readouterr().err and not (tmp_path / "g.db").exists()


def test_a_second_server_on_a_store_is_refused_in_one_line(tmp_path, capsys):
    from service import create_app

    store = f"sqlite:///{tmp_path / 'g.db'}"
    app = create_app(store)
    app.state.registry.start()  # the first server
    try:
        assert main(["serve", "--port", "0", "--store", store]) == 2
        err = capsys.readouterr().err
        assert "another goodput serve holds it" in err and "Traceback" not in err
        from service.server import BackgroundServer
        from service.store import StoreBusyError

        second = BackgroundServer(create_app(store))  # from Python: the same one-line error, nothing left open
        with pytest.raises(StoreBusyError):
            second.start()
        assert second.sock.fileno() == -1
        second.app.state.registry.store.close()
    finally:
        app.state.registry.close()


def test_the_slurm_wrapper_picks_the_best_goodput_per_gpu(server):
    url, client = server
    env = {**os.environ, "GOODPUT_SERVER": url, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(ROOT / "deploy" / "slurm-goodput-table.sh"), "zoo-mlp", "cpu:2x4"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    frame = client.table("zoo-mlp", "cpu:2x4").frame
    best = frame.loc[(frame["goodput"] / frame["num_gpus"]).idxmax()]
    fields = result.stdout.strip().split(",")
    assert fields[:4] == ["zoo-mlp", "cpu", str(best["num_nodes"]), str(best["num_gpus"])]


def test_the_example_trains_two_ddp_replicas_that_report_once_with_gradient_noise(server, tmp_path):
    """examples/train_with_reporter.py under torchrun: real gloo replicas, the DDP hook (gradient noise, sync time),
    rank 0 reports."""
    url, client = server
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples" / "train_with_reporter.py"), "--server", url, "--job", "example-mlp",
               "--steps", "40", "--buffer-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, output
    printed = re.findall(r"example-mlp: (\d+) observations sent, (\d+) kept", result.stdout)
    assert len(printed) == 1, output  # only rank 0 reports
    sent, kept = map(int, printed[0])
    stored = [r["observation"] for r in client.stored("example-mlp")["records"]]
    assert sent >= 1 and kept == 0 and len(stored) == sent, output
    settings = client.job("example-mlp")["settings"]
    assert settings["init_batch_size"] == 64
    assert settings["model_size"] == sum(p.numel() for p in zoo.get("mlp").model.parameters() if p.requires_grad)  # by attach()
    assert all(o["num_replicas"] == 2 and o["num_nodes"] == 1 and o["local_bsz"] == 64 for o in stored)
    # the hook timed each step's exposed sync: the last all-reduce's end after the last bucket was ready
    assert all(0 < o["sync_time"] < o["step_time"] for o in stored), stored
    with_noise = [o for o in stored if "grad_sqr" in o]
    assert with_noise and all(o["grad_sqr"] > 0 and o["grad_var"] >= 0 for o in with_noise), (stored, output)
    assert not (tmp_path / "example-mlp.rank1.jsonl").exists()
