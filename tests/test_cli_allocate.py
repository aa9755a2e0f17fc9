"""``goodput allocate`` end to end: tables file in, allocation table and solver facts out, rounds chained."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from goodput import Cluster, save_tables
from goodput.allocator import Allocation
from goodput.cli import main
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
    result = subprocess.run([sys.executable, "-m", "goodput.cli", "allocate", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--policy" in result.stdout and "--current" in result.stdout
