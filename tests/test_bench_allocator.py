"""The allocator benchmark stays runnable: its smoke run saves figures (no timing asserted here)."""

from __future__ import annotations

import json

from experiments import bench_allocator


def test_bench_allocator_quick(tmp_path):
    assert bench_allocator.main(["--quick", "--sizes", "64", "--out-dir", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "bench_allocator.json").read_text())
    rows = {row["what"]: row for row in figures["rows"]}
    assert set(rows) == {"sim round 64", "sia 64"}
    sia = rows["sia 64"]
    assert sia["jobs"] == 160 and sia["median_ms"] > 0 and sia["binaries"] > 0
    assert sia["vs_opt"] is not None and sia["fast_gap"] >= 0  # the MILP finished and was compared
    assert figures["details"]["sia 64"]["milp_status"] == ["optimal"]
    assert figures["tables"]
