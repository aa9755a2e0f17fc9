"""``goodput allocate`` end to end: tables file in, allocation table and solver facts out, rounds chained."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from goodput import Cluster, save_tables
from goodput.allocator import Allocation
from cli import main
from tests.allocator_cases import random_tables, table

CLUSTER = "t4:6x4,a100:2x8"


def _tables(tmp_path, n_jobs=10):
    path = tmp_path / "tables.json"
    save_tables(random_tables(Cluster.parse(CLUSTER), n_jobs, np.random.default_rng(5)), path)
    return path


def test_allocate_prints_allocation_placement_and_solver(tmp_path, capsys):
    path = _tables(tmp_path)
    out_path = tmp_path / "round1.json"
    assert main(["allocate", str(path), "--cluster", CLUSTER, "--out", str(out_path)]) == 0
    out = capsys.readouterr().out
    assert "sia allocation" in out and "placement" in out and "milp (optimal)" in out
    assert "t4-" in out and "GPUs used" in out
    first = Allocation.from_json(out_path)
    assert len(first) == 10 and first.info.policy == "sia"
    # the next round from the saved one: nothing changes for the same tables
    assert main(["allocate", str(path), "--cluster", CLUSTER, "--current", str(out_path), "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["allocations"] == first.to_dict()["allocations"]
    assert not any(d["changed"] for d in second["details"].values())


def test_allocate_policies_specs_and_options(tmp_path, capsys):
    path = _tables(tmp_path)
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps({"job0": {"rigid_gpus": 2}, "job1": {"gpu_types": ["a100"]}}))
    assert main(["allocate", str(path), "--cluster", CLUSTER, "--jobs", str(jobs), "--solver", "lagrangian",
                 "-p", "-1", "--lam", "1.5", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["info"]["solver"] == "lagrangian"
    assert payload["allocations"]["job0"] is None or payload["allocations"]["job0"]["num_gpus"] == 2
    assert payload["allocations"]["job1"] is None or payload["allocations"]["job1"]["gpu_type"] == "a100"
    for policy in ("gavel", "gavel-throughput", "unaware", "fifo"):
        assert main(["allocate", str(path), "--cluster", CLUSTER, "--policy", policy]) == 0
        assert f"{policy} allocation" in capsys.readouterr().out


def test_allocate_errors_name_the_job(tmp_path, capsys):
    path = tmp_path / "tables.json"
    save_tables({"odd": table("odd", {("h100", 1, 1): 5.0})}, path)
    assert main(["allocate", str(path), "--cluster", CLUSTER]) == 2
    assert "odd" in capsys.readouterr().err
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps({"ghost": {}}))
    assert main(["allocate", str(_tables(tmp_path)), "--cluster", CLUSTER, "--jobs", str(jobs)]) == 2
    assert "ghost" in capsys.readouterr().err


def test_console_script_has_allocate():
    result = subprocess.run([sys.executable, "-m", "cli", "allocate", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--policy" in result.stdout and "--current" in result.stdout


def test_json_output_stays_clean_when_the_solver_prints_to_stdout(tmp_path, capfd, monkeypatch):
    # HiGHS writes a debug line to file descriptor 1 in some solves, whatever its options
    # (ERGO-Code/HiGHS#2783): `goodput allocate --json` must still print only JSON on stdout.
    import os

    from goodput.allocator import sia

    real = sia.milp

    def noisy(*args, **kwargs):
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(sia, "milp", noisy)
    assert main(["allocate", str(_tables(tmp_path)), "--cluster", CLUSTER, "--solver", "milp", "--json"]) == 0
    captured = capfd.readouterr()
    assert json.loads(captured.out)["info"]["solver"] == "milp"
    assert "HighsMipSolverData" in captured.err


def test_stdout_redirection_nests_and_restores_across_threads(capfd):
    import os
    import threading

    from goodput.io import native_stdout_to_stderr

    barrier = threading.Barrier(4)

    def solve(i):
        with native_stdout_to_stderr():
            barrier.wait()
            with native_stdout_to_stderr():
                os.write(1, f"native {i}\n".encode())

    threads = [threading.Thread(target=solve, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.write(1, b"after\n")
    captured = capfd.readouterr()
    assert captured.out == "after\n"
    assert sorted(line for line in captured.err.splitlines() if line.startswith("native")) == [f"native {i}" for i in range(4)]
