"""Gavel (max-min fairness, max-sum-throughput), the heterogeneity-unaware policy and FIFO."""

from __future__ import annotations

import numpy as np
import pytest

from goodput import Cluster, allocate
from goodput.allocator import JobAllocation, JobSpec
from tests.allocator_cases import check_invariants, random_tables, scaling_table, table

HET = Cluster.parse("t4:1x4,a100:1x4")


def _affinity_tables():
    # "fast" gains 10x on a100, "flat" gains nothing: a heterogeneity-aware policy gives a100 to "fast"
    return {"fast": scaling_table("fast", HET, {"t4": 1.0, "a100": 10.0}),
            "flat": scaling_table("flat", HET, {"t4": 1.0, "a100": 1.0})}


@pytest.mark.parametrize("policy", ["gavel", "gavel-throughput"])
def test_gavel_is_heterogeneity_aware_and_uses_the_requested_count(policy):
    tables = _affinity_tables()
    jobs = {"fast": JobSpec(requested_gpus=4), "flat": JobSpec(requested_gpus=4)}
    result = allocate(tables, HET, jobs=jobs, policy=policy)
    assert result["fast"].configuration == ("a100", 1, 4)
    assert result["flat"].configuration == ("t4", 1, 4)
    assert result.info.solver == "linprog" and result.info.policy == policy and result.info.objective > 0
    check_invariants(result, tables, HET)


def test_gavel_rounds_up_requests_missing_from_the_configuration_set():
    cluster = Cluster.parse("t4:2x4")
    tables = {"a": scaling_table("a", cluster, {"t4": 1.0})}
    result = allocate(tables, cluster, jobs={"a": JobSpec(requested_gpus=3)}, policy="gavel")
    assert result["a"].num_gpus == 4


def test_gavel_priorities_favour_jobs_that_received_less():
    cluster = Cluster.parse("t4:1x4")
    tables = {j: scaling_table(j, cluster, {"t4": 1.0}) for j in ("rich", "poor")}
    jobs = {"rich": JobSpec(age=1000.0, attained=900.0, requested_gpus=4),
            "poor": JobSpec(age=1000.0, attained=100.0, requested_gpus=4)}
    result = allocate(tables, cluster, jobs=jobs, policy="gavel")
    assert result["poor"] is not None and result["rich"] is None
    swapped = {"rich": JobSpec(age=1000.0, attained=100.0, requested_gpus=4),
               "poor": JobSpec(age=1000.0, attained=900.0, requested_gpus=4)}
    assert allocate(tables, cluster, jobs=swapped, policy="gavel")["rich"] is not None
    assert "not selected" in result.unallocated["rich"]


def test_gavel_lp_optima():
    # x gains 8x on a100, y 2x; one GPU of each type. Normalisers (capacity-proportional share):
    # x: (1 + 8)/2 = 4.5, y: (1 + 2)/2 = 1.5. Giving y a share a of the a100 (and x the t4 time y
    # leaves): x = (8 - 7a)/4.5, y = (1 + a)/1.5. Max-min: equal at a = 1/2, level 1. Max-sum:
    # decreasing in a, so a = 0 and the sum is 8/4.5 + 1/1.5.
    cluster = Cluster.parse("t4:1x1,a100:1x1")
    tables = {"x": table("x", {("t4", 1, 1): 1.0, ("a100", 1, 1): 8.0}),
              "y": table("y", {("t4", 1, 1): 1.0, ("a100", 1, 1): 2.0})}
    fair = allocate(tables, cluster, policy="gavel")
    total = allocate(tables, cluster, policy="gavel-throughput")
    assert fair.info.objective == pytest.approx(1.0, rel=1e-6)
    assert total.info.objective == pytest.approx(8 / 4.5 + 1 / 1.5, rel=1e-6)
    assert total["x"].gpu_type == "a100" and total["y"].gpu_type == "t4"
    assert len(fair.allocated) == 2  # both run this round, one on each type
    check_invariants(fair, tables, cluster)


def test_unaware_ignores_gpu_types_in_its_decisions():
    cluster = Cluster.parse("t4:1x8,a100:1x4")
    tables = {"a": scaling_table("a", cluster, {"t4": 1.0, "a100": 10.0})}
    aware = allocate(tables, cluster)
    unaware = allocate(tables, cluster, policy="unaware")
    assert aware["a"].gpu_type == "a100"
    assert unaware["a"].gpu_type == "t4"  # the pool with the most free GPUs, not the fastest
    assert unaware.info.policy == "unaware" and unaware.info.objective is not None


def test_unaware_keeps_running_jobs_on_their_type():
    cluster = Cluster.parse("t4:1x8,a100:1x8")
    tables = {"a": scaling_table("a", cluster, {"t4": 1.0, "a100": 1.0})}
    first = allocate(tables, cluster, policy="unaware")
    current = {"a": JobAllocation("a100", 1, 8, {"a100-0": 8})}
    second = allocate(tables, cluster, current=current, policy="unaware")
    assert first["a"].num_gpus == 8 and second["a"] == current["a"]


def test_fifo_order_blocking_and_backfill():
    cluster = Cluster.parse("t4:1x4")
    tables = {j: scaling_table(j, cluster, {"t4": 1.0}) for j in ("first", "big", "small")}
    jobs = {"first": JobSpec(arrival=0.0, requested_gpus=2), "big": JobSpec(arrival=1.0, requested_gpus=4),
            "small": JobSpec(arrival=2.0, requested_gpus=1)}
    strict = allocate(tables, cluster, jobs=jobs, policy="fifo")
    assert strict["first"].num_gpus == 2 and strict["big"] is None and strict["small"] is None
    assert "behind big" in strict.unallocated["small"]
    backfilled = allocate(tables, cluster, jobs=jobs, policy="fifo", backfill=True)
    assert backfilled["small"].num_gpus == 1 and backfilled["big"] is None


def test_fifo_never_preempts_running_jobs():
    cluster = Cluster.parse("t4:1x4")
    tables = {j: scaling_table(j, cluster, {"t4": 1.0}) for j in ("early", "late")}
    current = {"late": JobAllocation("t4", 1, 4, {"t4-0": 4})}
    jobs = {"early": JobSpec(arrival=0.0), "late": JobSpec(arrival=5.0)}
    result = allocate(tables, cluster, current=current, jobs=jobs, policy="fifo")
    assert result["late"] == current["late"] and result["early"] is None


def test_fifo_orders_by_age_without_arrival_times():
    cluster = Cluster.parse("t4:1x1")
    tables = {j: scaling_table(j, cluster, {"t4": 1.0}) for j in ("young", "old")}
    result = allocate(tables, cluster, jobs={"young": JobSpec(age=10.0), "old": JobSpec(age=500.0)}, policy="fifo")
    assert result["old"] is not None and result["young"] is None


@pytest.mark.parametrize("policy", ["gavel", "gavel-throughput", "unaware", "fifo"])
def test_policies_respect_options_and_pinned_jobs(policy):
    cluster = Cluster.parse("t4:2x4,a100:1x8")
    tables = random_tables(cluster, 8, np.random.default_rng(11))
    names = list(tables)
    current = {names[0]: JobAllocation("t4", 1, 2, {"t4-0": 2})}
    jobs = {names[0]: JobSpec(preemptible=False), names[1]: JobSpec(gpu_types=("t4",), requested_gpus=2),
            names[2]: JobSpec(rigid_gpus=4)}
    result = allocate(tables, cluster, current=current, jobs=jobs, policy=policy)
    assert result[names[0]] == current[names[0]]
    if result[names[1]] is not None:
        assert result[names[1]].gpu_type == "t4"
    if result[names[2]] is not None:
        assert result[names[2]].num_gpus == 4
    check_invariants(result, tables, cluster)


def test_unknown_policy_option():
    cluster = Cluster.parse("t4:1x4")
    tables = {"a": scaling_table("a", cluster, {"t4": 1.0})}
    with pytest.raises(ValueError, match="backfill.*sia"):
        allocate(tables, cluster, backfill=True)


@pytest.mark.parametrize("policy", ["sia", "gavel", "gavel-throughput", "unaware", "fifo"])
def test_no_jobs_no_allocation(policy):
    result = allocate({}, Cluster.parse("t4:1x4"), policy=policy)
    assert len(result) == 0 and result.unallocated == {} and result.info.policy == policy


@pytest.mark.parametrize("policy", ["sia", "gavel", "gavel-throughput", "unaware", "fifo"])
@pytest.mark.parametrize("p", [0.0, float("nan"), "x"])
def test_every_policy_validates_p(policy, p):
    cluster = Cluster.parse("t4:1x4")
    tables = {"a": scaling_table("a", cluster, {"t4": 1.0})}
    with pytest.raises(ValueError) as info:
        allocate(tables, cluster, p=p, policy=policy)
    assert info.value.field == "p"


@pytest.mark.parametrize("policy", ["sia", "unaware"])
@pytest.mark.parametrize("option, value", [("lam", -1.0), ("lam", float("nan")), ("time_limit", -1.0),
                                           ("mip_rel_gap", -0.1), ("presolve", "yes"), ("exact_limit", -5),
                                           ("solver", "cplex")])
def test_goodput_policies_validate_their_solver_options(policy, option, value):
    cluster = Cluster.parse("t4:1x4")
    tables = {"a": scaling_table("a", cluster, {"t4": 1.0})}
    with pytest.raises(ValueError) as info:
        allocate(tables, cluster, policy=policy, **{option: value})
    assert info.value.field == option


def test_unaware_offers_no_configuration_worth_nothing():
    """p > 0 makes every option's cost negative; options whose restart factor is 0 must still not be chosen (as Sia)."""
    cluster = Cluster.parse("t4:1x4,a100:1x4")
    tables = {"moved": scaling_table("moved", cluster, {"t4": 1.0, "a100": 2.0})}
    current = {"moved": JobAllocation("t4", 1, 3, {"t4-0": 3})}  # 3 GPUs: no configuration keeps it in place
    # age 100 s, 10 restarts of 30 s: r = max(100 - 300, 0) / (100 + 30) = 0 for every configuration offered
    jobs = {"moved": JobSpec(age=100.0, restarts=10, restart_cost=30.0)}
    for policy in ("sia", "unaware"):
        result = allocate(tables, cluster, current=current, jobs=jobs, p=0.5, policy=policy)
        assert result["moved"] is None and "moved" in result.unallocated, policy
    sia = allocate(tables, cluster, current=current, jobs=jobs, p=0.5)
    assert "no configuration worth running" in sia.unallocated["moved"]
