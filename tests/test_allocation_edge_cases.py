"""Edge cases of tables, batch optimisation, allocation and ``goodput fit``: what a scheduler may hand them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from goodput import Cluster, GoodputTable, Observation, Profile, ValidationError, allocate
from goodput.allocator import JobAllocation, JobSpec
from goodput.allocator.placement import place
from cli import main
from goodput.efficiency import efficiency
from goodput.optimize import BatchLimits, candidate_batches, optimize_goodput

ROW = {"gpu_type": "t4", "num_nodes": 1, "num_gpus": 1, "goodput": 1.0}


# ---------------------------------------------------------------------------- goodput fit
def test_fit_with_no_profiled_gpu_type_in_the_cluster_is_a_clean_error(tmp_path, capsys):
    obs = [Observation(job="j", gpu_type="t4", num_nodes=1, num_replicas=r, local_bsz=b,
                       step_time=0.02 + 0.001 * b + 0.01 * (r > 1), sync_time=0.01 * (r > 1), grad_sqr=1.0, grad_var=2.0)
           for r in (1, 2, 4) for b in (32, 64)]
    path = tmp_path / "p.jsonl"
    Profile(obs, job="j", init_batch_size=64, max_batch_size=1024).save(path)
    assert main(["fit", str(path), "--cluster", "a100:2x8"]) == 2
    err = capsys.readouterr().err
    assert "a100" in err and "t4" in err and "Traceback" not in err


# ---------------------------------------------------------------------------- allocation shapes
def _one_gpu_table(job: str = "a") -> dict[str, GoodputTable]:
    return {job: GoodputTable(job, [dict(ROW, goodput=10.0)])}


def test_fifo_keeps_a_running_multi_node_allocation_that_is_not_whole_nodes():
    cluster = Cluster.parse("t4:2x8")
    current = {"a": JobAllocation("t4", 2, 6, {"t4-0": 3, "t4-1": 3})}
    result = allocate(_one_gpu_table(), cluster, current=current, policy="fifo")
    assert result["a"] == current["a"]


@pytest.mark.parametrize("policy", ["sia", "fifo"])
def test_pinned_multi_node_allocation_without_placement_spans_its_nodes(policy):
    cluster = Cluster.parse("t4:2x8")
    current = {"a": JobAllocation("t4", 2, 6)}
    result = allocate(_one_gpu_table(), cluster, current=current, policy=policy,
                      jobs={"a": JobSpec(age=100, preemptible=False)})
    alloc = result["a"]
    assert alloc.configuration == ("t4", 2, 6)
    assert len(alloc.placement) == 2 and sum(alloc.placement.values()) == 6


def test_partial_multi_node_placement_splits_over_the_free_gpus():
    cluster = Cluster.parse("t4:3x4")
    # b keeps 3 GPUs of t4-2; a (3 nodes, 7 GPUs) must use the 4 + 4 + 1 left
    current = {"b": JobAllocation("t4", 1, 3, {"t4-2": 3})}
    result = place(cluster, {"a": ("t4", 3, 7), "b": ("t4", 1, 3)}, current)
    assert result.placements["b"] == {"t4-2": 3}
    assert result.placements["a"] == {"t4-0": 3, "t4-1": 3, "t4-2": 1}
    # too few GPUs left on 3 distinct nodes: reported, never half-placed
    result = place(cluster, {"a": ("t4", 3, 10), "b": ("t4", 1, 3)}, current)
    assert "a" not in result.placements and "fragmentation" in result.failed["a"]


def test_current_allocation_larger_than_its_nodes_is_rejected():
    cluster = Cluster.parse("t4:2x8")
    with pytest.raises(ValidationError, match=r"current\[a\]") as info:
        allocate(_one_gpu_table(), cluster, current={"a": JobAllocation("t4", 1, 12)},
                 jobs={"a": JobSpec(preemptible=False)})
    assert "12" in str(info.value)


def test_unaware_reports_why_a_job_is_infeasible():
    cluster = Cluster.parse("t4:2x4")
    for rows, reason in (([], "table is empty"), ([dict(ROW, goodput=0.0)], "positive goodput")):
        result = allocate({"a": GoodputTable("a", rows)}, cluster, policy="unaware")
        assert result["a"] is None and reason in result.unallocated["a"]


# ---------------------------------------------------------------------------- tables
@pytest.mark.parametrize("job, gpu_type", [("007", "t4"), ("1e3", "t4"), ("nan", "t4"), ("a", "1080"), ("NA", "t4")])
def test_csv_round_trip_keeps_names_as_text(tmp_path, job, gpu_type):
    table = GoodputTable(job, [dict(ROW, gpu_type=gpu_type)])
    back = GoodputTable.from_csv(table.to_csv(tmp_path / "t.csv"))
    assert back.job == job and back.gpu_types == [gpu_type]
    assert back.lookup(gpu_type, 1, 1)["goodput"] == 1.0


@pytest.mark.parametrize("quantile", [0.5, 0.1])
def test_empty_table_round_trips_through_csv(tmp_path, quantile):
    table = GoodputTable("a", [])
    if quantile != 0.5:
        table = table.at_quantile(quantile)
    back = GoodputTable.from_csv(table.to_csv(tmp_path / "t.csv"))
    assert back.job == "a" and len(back) == 0 and back.quantile == quantile


@pytest.mark.parametrize("rows, quantile", [([], 0.5), ([ROW], 0.5), ([ROW], 0.1)])
def test_missing_gpu_types_round_trip_through_csv_and_json(tmp_path, rows, quantile):
    table = GoodputTable("a", rows, missing_gpu_types=["a100", "1080"], quantile=quantile)
    for back in (GoodputTable.from_csv(table.to_csv(tmp_path / "t.csv")), GoodputTable.from_json(table.to_json(tmp_path / "t.json"))):
        assert back.missing_gpu_types == ("a100", "1080") and back.quantile == quantile and len(back) == len(rows)
    assert GoodputTable.from_csv(GoodputTable("a", [ROW]).to_csv(tmp_path / "n.csv")).missing_gpu_types == ()


def test_a_csv_s_leading_columns_stay_put_whatever_the_table_carries():
    """Scripts read a table's CSV by position (deploy/slurm-goodput-table.sh: $4 GPUs, $5 goodput)."""
    plain = GoodputTable("a", [ROW]).csv_text().splitlines()[0].split(",")
    assert plain[:5] == ["job", "gpu_type", "num_nodes", "num_gpus", "goodput"]
    full = GoodputTable("a", [ROW], missing_gpu_types=["a100"], quantile=0.1).csv_text().splitlines()[0].split(",")
    assert full[:len(plain)] == plain and full[len(plain):] == ["quantile", "missing_gpu_types"]
    empty = GoodputTable("a", [], missing_gpu_types=["a100"])
    assert len(empty.csv_text().splitlines()) == 2  # a file: the job's name alone on a row, so it reads back
    assert len(empty.csv_text(placeholder=False).splitlines()) == 1  # goodput table's output: no configuration rows


def test_a_table_s_odd_missing_types_and_rows_are_refused():
    with pytest.raises(ValidationError, match="missing_gpu_types"):
        GoodputTable("a", [], missing_gpu_types="a100")  # one name, not the letters of one
    for rows in (None, "rows", [1, 2]):
        with pytest.raises(ValidationError) as caught:
            GoodputTable.from_dict({"job": "a", "rows": rows})
        assert caught.value.field == "rows"


@pytest.mark.parametrize("column", ["num_nodes", "num_gpus", "batch_size"])
def test_counts_too_large_for_an_integer_are_rejected(column):
    row = dict(ROW, **{column: 1e30})
    with pytest.raises(ValidationError, match=rf"{column}\[0\]=.*too large"):
        GoodputTable("a", [row])


def test_boolean_goodput_is_rejected():
    with pytest.raises(ValidationError, match="goodput"):
        GoodputTable("a", [dict(ROW, goodput=True)])


def test_efficiency_rejects_text_batch_sizes():
    with pytest.raises(ValidationError, match="batch_size"):
        efficiency(1.0, 1.0, 128, "256")
    with pytest.raises(ValidationError, match="batch_size"):
        efficiency(1.0, 1.0, 128, True)


# ---------------------------------------------------------------------------- batch optimisation
def test_strong_scaling_uses_more_accumulation_to_stay_within_the_limit():
    best = optimize_goodput(lambda n, r, b, a: 0.01 + 0.001 * b * (a + 1), lambda m: 1.0 + 0 * m,
                            [1], [4], BatchLimits(168, 168, 6, 9))
    batch, local, accum = int(best.batch_size[0]), int(best.local_bsz[0]), int(best.accum_steps[0])
    assert batch == 168 == 4 * local * (accum + 1) and 6 <= local <= 9


def _in_limit_exists(replicas: int, limits: BatchLimits) -> bool:
    max_local = limits.max_local_bsz or limits.max_batch_size
    steps = range(1, limits.max_batch_size + 1) if limits.accumulation else [1]
    return any(limits.init_batch_size <= replicas * m * s <= limits.max_batch_size
               for m in range(limits.min_local_bsz, max_local + 1) for s in steps)


@pytest.mark.parametrize("m0, spread, min_local, max_local, accumulation",
                         list(itertools.product([7, 60, 100, 168], [0, 5], [1, 6], [None, 9, 16], [True, False])))
def test_batch_exceeds_the_maximum_only_when_nothing_fits(m0, spread, min_local, max_local, accumulation):
    if max_local is not None and max_local < min_local:
        return
    limits = BatchLimits(m0, m0 + spread, min_local, max_local, accumulation)
    replicas = np.array([1, 2, 3, 4, 5, 6, 8, 12])
    batch, micro, accum, valid = candidate_batches(replicas, limits)
    assert np.all(batch[valid] == (np.broadcast_to(replicas, batch.shape) * micro * (accum + 1))[valid])
    assert np.all(micro[valid] >= min_local) and (max_local is None or np.all(micro[valid] <= max_local))
    for k, r in enumerate(replicas):
        column = valid[:, k]
        if column.any() and np.any(batch[column, k] > limits.max_batch_size):
            assert not _in_limit_exists(int(r), limits), (r, batch[column, k])


def test_num_candidates_must_be_positive():
    with pytest.raises(ValidationError, match="num_candidates"):
        optimize_goodput(lambda n, r, b, a: 0.1 + 0 * b, lambda m: 1.0 + 0 * m, [1], [1], BatchLimits(128, 256),
                         num_candidates=0)


def test_the_best_batch_at_the_memory_limit_is_a_candidate():
    """Goodput often peaks at the largest micro-batch that fits (the cheapest samples before one more
    micro-batch); the geometric grid of total batches had rounded past it, 1.6-2.2% below the best."""
    from goodput.throughput import ThroughputParams, predict_step_time

    truth = ThroughputParams(0.01, 0.002, 0.02, 0.001, 0.05, 0.002, 1.5)
    limits = BatchLimits(64, 2048, 4, 48, True)

    def step_time(nodes, replicas, micro, accum):
        return predict_step_time(truth, nodes, replicas, micro, accum)

    def eff(m):
        return efficiency(1.0, 20.0, 64, m)

    nodes, replicas = np.array([1, 1, 2, 4]), np.array([1, 4, 8, 16])
    chosen = optimize_goodput(step_time, eff, nodes, replicas, limits)
    for k, (n, r) in enumerate(zip(nodes, replicas)):
        best = max((r * m * (a + 1) / float(step_time(n, r, m, a)) * eff(r * m * (a + 1)), m, a)
                   for m in range(4, 49) for a in range(0, 2048 // (r * m))
                   if 64 <= r * m * (a + 1) <= 2048)
        assert chosen.goodput[k] == pytest.approx(best[0], rel=1e-3), (n, r, best, chosen.local_bsz[k], chosen.accum_steps[k])
