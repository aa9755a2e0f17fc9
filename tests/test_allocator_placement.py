"""Placement by Sia's rules, and invariants of every policy as property tests over random clusters and tables."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from goodput import Cluster, GoodputTable, ValidationError, allocate
from goodput.allocator import POLICIES, JobAllocation, JobSpec
from goodput.allocator.placement import place
from tests.allocator_cases import check_invariants, random_tables


def _per_node(result):
    used: dict[str, int] = {}
    for layout in result.placements.values():
        for node, gpus in layout.items():
            used[node] = used.get(node, 0) + gpus
    return used


def test_sub_node_allocations_pack_best_fit_and_whole_nodes_come_from_the_end():
    cluster = Cluster.parse("t4:4x4")
    result = place(cluster, {"w": ("t4", 2, 8), "a": ("t4", 1, 2), "b": ("t4", 1, 1), "c": ("t4", 1, 1)}, {})
    assert result.placements["w"] == {"t4-2": 4, "t4-3": 4}
    assert result.placements["a"] == {"t4-0": 2}
    assert result.placements["b"] == {"t4-0": 1} and result.placements["c"] == {"t4-0": 1}  # best fit packs node 0
    assert not result.failed


def test_unchanged_jobs_keep_their_gpus():
    cluster = Cluster.parse("t4:2x4")
    current = {"a": JobAllocation("t4", 1, 2, {"t4-1": 2}), "b": JobAllocation("t4", 1, 1, {"t4-0": 1})}
    result = place(cluster, {"a": ("t4", 1, 2), "b": ("t4", 1, 2), "c": ("t4", 1, 2)}, current)
    assert result.placements["a"] == {"t4-1": 2}  # same configuration: same GPUs
    assert sum(result.placements["b"].values()) == 2  # grown: placed afresh
    assert not result.moved
    assert max(_per_node(result).values()) <= 4


def test_fragmentation_evicts_the_smallest_single_node_jobs_and_retries():
    cluster = Cluster.parse("t4:2x4")
    # two 1-GPU jobs kept on different nodes fragment the pool; a whole-node job needs one of them to move
    current = {"a": JobAllocation("t4", 1, 1, {"t4-0": 1}), "b": JobAllocation("t4", 1, 1, {"t4-1": 1})}
    result = place(cluster, {"a": ("t4", 1, 1), "b": ("t4", 1, 1), "w": ("t4", 1, 4)}, current)
    assert not result.failed
    assert list(result.placements["w"].values()) == [4]
    assert len(result.moved) == 1  # exactly one of the small jobs moved
    assert _per_node(result) == {"t4-0": 4, "t4-1": 2} or _per_node(result) == {"t4-0": 2, "t4-1": 4}
    # a sub-node job that fits nowhere evicts smaller ones on the node needing least
    current = {f"s{i}": JobAllocation("t4", 1, 1, {f"t4-{i % 2}": 1}) for i in range(4)}
    result = place(cluster, {**{k: ("t4", 1, 1) for k in current}, "x": ("t4", 1, 4)}, current)
    assert not result.failed and result.placements["x"] in ({"t4-0": 4}, {"t4-1": 4})
    assert max(_per_node(result).values()) == 4


def test_a_running_job_is_moved_for_a_newcomer_only_where_it_fits_elsewhere():
    cluster = Cluster.parse("t4:2x4")
    # a runs 2 GPUs on t4-0; c and d want 3 each: evicting a would give d its node and leave a nowhere
    current = {"a": JobAllocation("t4", 1, 2, {"t4-0": 2})}
    result = place(cluster, {"a": ("t4", 1, 2), "c": ("t4", 1, 3), "d": ("t4", 1, 3)}, current)
    assert result.placements["a"] == {"t4-0": 2} and not result.moved
    assert set(result.failed) == {"d"} and max(_per_node(result).values()) <= 4
    fifo = allocate({job: _rows(job, {("t4", 1, g): 1.0}) for job, g in (("a", 2), ("c", 3), ("d", 3))}, cluster,
                    current=current, policy="fifo", jobs={"a": JobSpec(arrival=0), "c": JobSpec(arrival=1), "d": JobSpec(arrival=2)})
    assert fifo["a"] == current["a"]  # FIFO does not preempt a running job
    # a whole-node job that cannot get its nodes moves nobody
    cluster = Cluster.parse("t4:4x4")
    current = {"p": JobAllocation("t4", 1, 1, {"t4-0": 1}), "q": JobAllocation("t4", 1, 1, {"t4-1": 1}),
               "a": JobAllocation("t4", 1, 1, {"t4-2": 1})}
    result = place(cluster, {"p": ("t4", 1, 1), "q": ("t4", 1, 1), "a": ("t4", 1, 1), "w": ("t4", 3, 12)}, current,
                   pinned={"p", "q"})
    assert set(result.failed) == {"w"} and not result.moved and result.placements["a"] == {"t4-2": 1}


def _rows(job: str, goodput: dict) -> GoodputTable:
    return GoodputTable(job, [{"gpu_type": t, "num_nodes": n, "num_gpus": g, "goodput": v} for (t, n, g), v in goodput.items()])


def test_unplaceable_jobs_fail_rather_than_split():
    cluster = Cluster.parse("t4:2x6")  # 6-GPU nodes: 4 + 4 + 4 does not fit although 12 GPUs exist
    result = place(cluster, {"a": ("t4", 1, 4), "b": ("t4", 1, 4), "c": ("t4", 1, 4)}, {})
    assert len(result.failed) == 1 and "fragmentation" in next(iter(result.failed.values()))
    assert all(len(p) == 1 for p in result.placements.values())


def test_pinned_collisions_are_an_error():
    cluster = Cluster.parse("t4:1x4")
    current = {"a": JobAllocation("t4", 1, 3, {"t4-0": 3}), "b": JobAllocation("t4", 1, 2, {"t4-0": 2})}
    with pytest.raises(ValidationError, match=r"current\[b\]"):
        place(cluster, {"a": ("t4", 1, 3), "b": ("t4", 1, 2)}, current, pinned={"a", "b"})


def test_sia_resolves_when_a_placement_fails():
    from tests.allocator_cases import table

    cluster = Cluster.parse("t4:2x6")
    rows = {("t4", 1, 1): 1.0, ("t4", 1, 2): 2.0, ("t4", 1, 4): 4.0, ("t4", 1, 6): 6.0, ("t4", 2, 12): 12.0}
    tables = {j: table(j, rows) for j in "abc"}
    result = allocate(tables, cluster, lam=3.0)  # a large λ: everyone runs; 4+4+4 cannot be placed
    check_invariants(result, tables, cluster)
    assert len(result.allocated) == 3
    assert result.info.attempts == 2 and "placement failed" in result.info.notes[0]
    # the retry's bound is the first solve's, which holds for every placeable answer: the retry's own
    # (of a problem with options excluded) had claimed "optimal" with gap 0 while a better placeable answer existed
    assert result.info.status == "heuristic" and result.info.gap > 0
    # the retries share the time limit: with none left after the first solve, no second one
    hurried = allocate(tables, cluster, lam=3.0, time_limit=1e-6)
    assert hurried.info.attempts == 1 and "no time left" in hurried.info.notes[0]
    check_invariants(hurried, tables, cluster)


def test_sia_after_a_placement_retry_claims_no_optimum_that_a_placeable_answer_beats():
    from tests.allocator_cases import table

    cluster = Cluster.parse("t4:2x6")
    configs = [("t4", 1, 1), ("t4", 1, 2), ("t4", 1, 4), ("t4", 1, 6), ("t4", 2, 12)]
    goodput = {"a": [1.0, 1.24833, 1.55833, 1.77422, 2.21482], "b": [1.0, 2.0, 4.0, 6.0, 12.0],
               "c": [1.0, 1.34723, 1.81504, 2.16075, 2.91104]}
    tables = {j: table(j, dict(zip(configs, values))) for j, values in goodput.items()}
    placeable = sum(goodput[j][configs.index(("t4", 1, g))] ** -0.5 for j, g in (("a", 2), ("b", 6), ("c", 4)))
    for solver in ("milp", "auto"):
        result = allocate(tables, cluster, p=-0.5, solver=solver)  # minimised: a bound lies below every answer
        check_invariants(result, tables, cluster)
        assert result.info.attempts == 2 and result.info.status != "optimal"
        assert result.info.bound <= placeable + 1e-9 and result.info.gap > 0


# ---------------------------------------------------------------------------- properties
@st.composite
def instances(draw):
    n_types = draw(st.integers(1, 3))
    pools = []
    for t in range(n_types):
        nodes = draw(st.integers(1, 4))
        gpn = draw(st.sampled_from([1, 2, 4, 8]))
        pools.append(f"{['t4', 'a100', 'v100'][t]}:{nodes}x{gpn}")
    cluster = Cluster.parse(",".join(pools))
    seed = draw(st.integers(0, 2**32 - 1))
    n_jobs = draw(st.integers(1, 12))
    policy = draw(st.sampled_from(POLICIES))
    return cluster, seed, n_jobs, policy


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_invariants_hold_for_every_policy(instance):
    cluster, seed, n_jobs, policy = instance
    rng = np.random.default_rng(seed)
    tables = random_tables(cluster, n_jobs, rng, drop=0.3)
    names = list(tables)
    jobs = {}
    for name in names[: n_jobs // 2]:
        age = float(rng.uniform(0, 2000))
        jobs[name] = JobSpec(age=age, restarts=int(rng.integers(0, 4)), attained=age * float(rng.uniform(0, 1)),
                             min_gpus=int(rng.choice([1, 1, 2])), requested_gpus=int(rng.choice([1, 2, 4])))
    first = allocate(tables, cluster, jobs=jobs, policy=policy)
    check_invariants(first, tables, cluster)
    # GPUs per type within capacity already in the decision: with power-of-two nodes and nothing
    # kept from a previous round, placing it never fails (divisible sizes pack perfectly)
    assert not any("placement failed" in reason for reason in first.unallocated.values())
    assert first.info.attempts == 1
    # a second round from the first: unchanged configurations keep their GPUs unless evicted
    second = allocate(tables, cluster, current=first, jobs=jobs, policy=policy)
    check_invariants(second, tables, cluster)
    for job, alloc in second.allocated.items():
        old = first[job]
        if old is not None and old.configuration == alloc.configuration and not second.details[job]["moved"]:
            assert alloc.placement == old.placement
