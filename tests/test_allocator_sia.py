"""Sia's policy: exact against brute force, the restart factor, every job option, bad input, the fast path."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from goodput import Cluster, GoodputTable, JobModel, ValidationError, allocate
from goodput.allocator import Allocation, JobAllocation, JobSpec, restart_factor
from goodput.allocator.problem import prepare, sia_problem
from goodput.allocator.sia import solve_milp
from goodput.allocator.lagrangian import solve_lagrangian
from goodput.errors import UnknownGPUTypeError
from tests.allocator_cases import brute_force, check_invariants, random_tables, scaling_table, sia_objective, table

SMALL = Cluster.parse("t4:2x4,a100:1x4")


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("p", [-0.5, 0.5])
def test_matches_brute_force(seed, p):
    rng = np.random.default_rng(seed)
    tables = random_tables(SMALL, 4, rng, drop=0.3)
    current = jobs = None
    if seed % 2:  # running jobs with restart penalties
        names = list(tables)
        current = {names[0]: JobAllocation(*tables[names[0]].configurations()[0]),
                   names[1]: JobAllocation(*tables[names[1]].configurations()[-1])}
        jobs = {n: JobSpec(age=300.0 * (i + 1), restarts=i, restart_cost=60.0) for i, n in enumerate(names[:2])}
    result = allocate(tables, SMALL, current=current, p=p, jobs=jobs, solver="milp")
    best, _ = brute_force(tables, SMALL, p=p, current=current, jobs=jobs)
    got = sia_objective(tables, result, p=p, current=current, jobs=jobs)
    assert got == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert result.info.objective == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert result.info.solver == "milp" and result.info.status == "optimal" and result.info.gap <= 1e-6
    assert result.info.sense == ("minimize" if p < 0 else "maximize")
    check_invariants(result, tables, SMALL)


def test_fast_path_is_certified_on_small_instances():
    for seed in range(6):
        tables = random_tables(SMALL, 4, np.random.default_rng(100 + seed), drop=0.2)
        best, _ = brute_force(tables, SMALL)
        fast = allocate(tables, SMALL, solver="lagrangian")
        assert fast.info.solver == "lagrangian"
        value = sia_objective(tables, fast)
        assert value == pytest.approx(fast.info.objective)
        assert value >= best - 1e-9  # feasible, so no better than the optimum
        assert fast.info.bound <= best + 1e-9  # and the bound is a true lower bound
        assert fast.info.gap == pytest.approx(abs(fast.info.objective - fast.info.bound) / fast.info.objective)
        check_invariants(fast, tables, SMALL)


def test_fast_path_close_to_exact_at_scale():
    cluster = Cluster.parse("t4:6x4,a100:2x8,rtx2080ti:3x8")  # Sia's 64-GPU cluster
    tables = random_tables(cluster, 160, np.random.default_rng(7))
    prob = sia_problem(prepare(tables, cluster), -0.5, 1.1)
    exact = solve_milp(prob)
    fast = solve_lagrangian(prob)
    assert exact.status == "optimal"
    exact_obj, fast_obj = prob.objective(exact.total), prob.objective(fast.total)
    assert exact_obj <= fast_obj + 1e-9
    assert prob.objective(fast.bound) <= exact_obj + 1e-9
    assert (fast_obj - exact_obj) / exact_obj < 0.005  # within 0.5% of the optimum
    assert fast.gap < 0.005
    both = allocate(tables, cluster)  # auto: certified fast path or MILP
    assert both.info.objective == pytest.approx(exact_obj, rel=1e-6)


def test_uncontended_round_needs_no_solver():
    cluster = Cluster.parse("t4:6x4,a100:2x8,rtx2080ti:3x8")
    tables = random_tables(cluster, 3, np.random.default_rng(3), max_gpus=8)
    result = allocate(tables, cluster)
    exact = allocate(tables, cluster, solver="milp")
    assert result.info.solver == "unconstrained" and result.info.status == "optimal" and result.info.gap == 0
    assert result.info.objective == pytest.approx(exact.info.objective, rel=1e-9)
    for job in tables:  # each job got its own best configuration
        best = max(tables[job].frame.itertuples(), key=lambda r: r.goodput)
        assert result[job].configuration == (best.gpu_type, best.num_nodes, best.num_gpus)
    contended = random_tables(SMALL, 6, np.random.default_rng(4))
    assert allocate(contended, SMALL).info.solver == "milp"  # the best options overfill the cluster


def _dual_bound(prob, prices):
    reduced = prob.opt_cost + prices[prob.opt_type] * prob.opt_gpus
    best = np.zeros(len(prob.names))
    np.minimum.at(best, prob.opt_job, reduced)
    return best.sum() - prices @ prob.capacity


@pytest.mark.parametrize("p", [-0.5, 0.5])
def test_smoothed_prices_reach_the_lp_bound(p):
    """The fast path's bound is L at its prices, a true lower bound, and at least as tight as the LP relaxation's
    (HiGHS) to 1e-8: the smoothed Newton steps find the dual optimum where coordinate ascent alone stalls."""
    from scipy.optimize import linprog
    from scipy import sparse

    cluster = Cluster.parse("t4:24x4,a100:8x8,rtx2080ti:12x8")  # 256 GPUs
    tables = random_tables(cluster, 160, np.random.default_rng(11))
    prob = sia_problem(prepare(tables, cluster), p, 1.1)
    m, n = prob.num_options, len(prob.names)
    rows = sparse.vstack([sparse.csr_array((np.ones(m), (prob.opt_job, np.arange(m))), shape=(n, m)),
                          sparse.csr_array((prob.opt_gpus.astype(float), (prob.opt_type, np.arange(m))),
                                           shape=(len(prob.gpu_types), m))])
    lp = linprog(prob.opt_cost, A_ub=rows, b_ub=np.r_[np.ones(n), prob.capacity], bounds=(0, 1), method="highs")
    fast = solve_lagrangian(prob)
    plain = solve_lagrangian(prob, smoothing=False)
    assert fast.bound == pytest.approx(_dual_bound(prob, fast.prices)) or fast.bound == pytest.approx(fast.total)
    assert fast.bound <= lp.fun + 1e-9 * abs(lp.fun)  # weak duality
    assert fast.bound >= lp.fun - 1e-8 * abs(lp.fun)  # and tight (what certifies a gap of mip_rel_gap = 1e-6)
    assert fast.bound >= plain.bound - 1e-12 * abs(lp.fun)
    exact = solve_milp(prob)
    assert exact.total <= fast.total + 1e-12 and fast.bound <= exact.total + 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_reduced_cost_fixing_keeps_the_optimum(seed):
    """auto's exact fallback: options whose reduced cost exceeds the gap are dropped, jobs left with one fixed,
    and the MILP on the rest finds the full MILP's optimum."""
    from goodput.allocator.lagrangian import fix_by_reduced_costs
    from goodput.allocator.sia import solve

    cluster = Cluster.parse("t4:6x4,a100:2x8,rtx2080ti:3x8")
    tables = random_tables(cluster, 40, np.random.default_rng(200 + seed))
    prob = sia_problem(prepare(tables, cluster), 0.5 if seed % 2 else -0.5, 1.1)
    exact = solve_milp(prob)
    fast = solve_lagrangian(prob)
    reduced = fix_by_reduced_costs(prob, fast.prices, fast.total)
    assert reduced.problem.num_options < prob.num_options
    optimum = np.flatnonzero(exact.choice >= 0)
    chosen = set(exact.choice[optimum].tolist())
    if exact.total < fast.total - 1e-9:  # a better solution exists: its options all survive
        kept = set(reduced.problem.opt_row.tolist()) | set(reduced.choice[reduced.choice >= 0].tolist())
        assert chosen <= kept
    solution, notes = solve(prob, milp_first=0)  # force the fast path first
    assert solution.total == pytest.approx(exact.total, rel=1e-9, abs=1e-12)
    assert solution.bound is not None and solution.bound <= exact.total + 1e-9
    if fast.gap > 1e-6:
        assert solution.solver == "lagrangian+milp" and "reduced-cost fixing left" in notes[-1]
    used = np.bincount(prob.opt_type[solution.choice[solution.choice >= 0]],
                       weights=prob.opt_gpus[solution.choice[solution.choice >= 0]], minlength=3)
    assert np.all(used <= prob.capacity + 1e-9)


def test_capacity_forces_tradeoffs_and_unallocated_reasons():
    cluster = Cluster.parse("t4:1x4")
    tables = {f"j{i}": scaling_table(f"j{i}", cluster, {"t4": 1.0}) for i in range(6)}
    result = allocate(tables, cluster)
    assert sum(a.num_gpus for a in result.allocated.values()) == 4
    best, _ = brute_force(tables, cluster)
    assert result.info.objective == pytest.approx(best)
    # growing a job from 1 to 2 GPUs saves 1 - 2^(-0.4) = 0.24 > λ - 1 = 0.1 saved by admitting one more
    assert len(result.allocated) == 2
    for job in set(tables) - set(result.allocated):
        assert "not selected" in result.unallocated[job]
    check_invariants(result, tables, cluster)


def test_lambda_trades_admission_against_growth():
    cluster = Cluster.parse("t4:1x4")
    tables = {f"j{i}": scaling_table(f"j{i}", cluster, {"t4": 1.0}, exponent=0.8) for i in range(4)}
    assert len(allocate(tables, cluster, lam=1.1).allocated) == 2
    assert len(allocate(tables, cluster, lam=2.0).allocated) == 4  # a large penalty admits every job
    # a small one lets one job take the node: 4^-0.4 + 3·0.7 < 2·2^-0.4 + 2·0.7 and < 4·0.7
    assert len(allocate(tables, cluster, lam=0.7).allocated) == 1


# ---------------------------------------------------------------------------- restart factor
def test_restart_factor_formula():
    assert restart_factor(10.0, 0, 30.0) == 1.0  # younger than one restart
    assert restart_factor(600.0, 2, 30.0) == pytest.approx((600 - 60) / 630)
    assert restart_factor(100.0, 10, 30.0) == 0.0
    assert JobSpec(age=600.0, restarts=2).restart_factor == pytest.approx(540 / 630)


@pytest.mark.parametrize("gain, moves", [(1.05, False), (3.0, True)])
def test_restart_factor_keeps_small_gains_in_place(gain, moves):
    cluster = Cluster.parse("t4:1x4,a100:1x4")
    tab = table("a", {("t4", 1, 4): 400.0, ("a100", 1, 4): 400.0 * gain, ("t4", 1, 1): 100.0})
    current = {"a": JobAllocation("t4", 1, 4, {"t4-0": 4})}
    old = JobSpec(age=600.0, restarts=9, restart_cost=30.0)  # r = 330/630 ≈ 0.52
    result = allocate({"a": tab}, cluster, current=current, jobs={"a": old})
    assert (result["a"].gpu_type == "a100") is moves
    if not moves:
        assert result["a"].placement == {"t4-0": 4} and result.details["a"]["changed"] is False
    # without the restart factor (a young job) even the small gain moves it
    young = allocate({"a": tab}, cluster, current=current, jobs={"a": JobSpec(age=0.0)})
    assert young["a"].gpu_type == "a100"


def test_zero_restart_factor_pins_job_in_effect():
    cluster = Cluster.parse("t4:1x4,a100:1x4")
    tab = table("a", {("t4", 1, 4): 400.0, ("a100", 1, 4): 4000.0, ("t4", 1, 1): 100.0})
    current = {"a": JobAllocation("t4", 1, 4, {"t4-0": 4})}
    result = allocate({"a": tab}, cluster, current=current, jobs={"a": JobSpec(age=300.0, restarts=10)})
    assert result["a"].configuration == ("t4", 1, 4)


# ---------------------------------------------------------------------------- job options
def _pair(cluster):
    return {"a": scaling_table("a", cluster, {t: 1.0 for t in cluster.gpu_types}, exponent=0.95),
            "b": scaling_table("b", cluster, {t: 1.0 for t in cluster.gpu_types}, exponent=0.95)}


def test_rigid_jobs_get_exactly_their_count():
    cluster = Cluster.parse("t4:2x4")
    tables = _pair(cluster)
    free = allocate(tables, cluster)
    assert free["a"].num_gpus == 4  # the two elastic jobs split the cluster
    rigid = allocate(tables, cluster, jobs={"a": JobSpec(rigid_gpus=2)})
    assert rigid["a"].num_gpus == 2
    assert rigid["b"].num_gpus == 4  # only Sia's configurations: 1, 2, 4, 8


def test_rigid_jobs_take_any_allowed_type():
    cluster = Cluster.parse("t4:1x4,a100:1x8")
    tables = {"a": scaling_table("a", cluster, {"t4": 1.0, "a100": 3.0})}
    result = allocate(tables, cluster, jobs={"a": JobSpec(rigid_gpus=4)})
    assert result["a"].configuration == ("a100", 1, 4)


def test_granularity():
    cluster = Cluster.parse("t4:2x4")
    poor = table("a", {("t4", 1, 1): 100.0, ("t4", 1, 2): 190.0, ("t4", 1, 4): 200.0, ("t4", 2, 8): 200.0})
    tables = {"a": poor, "b": scaling_table("b", cluster, {"t4": 1.0}, exponent=1.0),
              "c": scaling_table("c", cluster, {"t4": 1.0}, exponent=1.0)}
    free = allocate(tables, cluster)
    assert free["a"].num_gpus == 2  # the instance discriminates: unconstrained, a takes 2
    result = allocate(tables, cluster, jobs={"a": JobSpec(granularity=4)})
    assert result["a"] is None or result["a"].num_gpus % 4 == 0
    assert result.info.objective >= free.info.objective  # a constraint never helps a minimisation
    with pytest.raises(UnknownGPUTypeError, match=r"jobs\[a\]\.granularity"):  # a typo: not silently 1 per replica
        allocate(tables, cluster, jobs={"a": JobSpec(granularity={"t-4": 4})})


@pytest.mark.parametrize("policy", ["sia", "unaware", "gavel", "fifo"])
def test_a_hybrid_job_gets_whole_pipelines_of_each_types_length(policy):
    """Granularity per GPU type (Sia's hybrid jobs: 8-stage pipelines on RTX, 2-stage on A100) and a minimum of
    pipelines: every policy gives only multiples of the type's stage count, at least min_replicas of them, even
    from a table that lists every configuration."""
    cluster = Cluster.parse("t4:2x4,a100:1x8,rtx2080ti:2x8")
    stages = {"a100": 2, "rtx2080ti": 8}
    tables = {"h": scaling_table("h", cluster, {"t4": 1.0, "a100": 4.0, "rtx2080ti": 2.0}, exponent=0.9)}
    tables.update({f"d{i}": scaling_table(f"d{i}", cluster, {"t4": 1.0, "a100": 2.0, "rtx2080ti": 1.5}) for i in range(3)})
    spec = JobSpec(granularity=stages, min_replicas=2, requested_gpus=3)
    assert spec.allows(4, "a100") and spec.allows(6, "a100") and not spec.allows(2, "a100") and not spec.allows(5, "a100")
    assert spec.allows(2, "t4") and not spec.allows(1, "t4")  # t4 left out: 1 GPU per replica, at least 2 replicas
    assert [g for g in (1, 2, 4, 8, 16) if spec.allows(g, "rtx2080ti")] == [16]
    with pytest.raises(ValidationError, match="gpu_type"):
        spec.allows(4)  # the granularity differs by type: name it
    result = allocate(tables, cluster, policy=policy, jobs={"h": spec})
    check_invariants(result, tables, cluster)
    if policy == "unaware":  # pooled counts may fit no type's pipelines (here 8 GPUs: RTX needs 16); alone it runs
        assert result["h"] is not None or "pooled" in result.unallocated["h"]
        result = allocate({"h": tables["h"]}, cluster, policy=policy, jobs={"h": spec})
    got = result["h"]
    assert got is not None  # the job is worth running and the cluster has room
    step = stages.get(got.gpu_type, 1)
    assert got.num_gpus % step == 0 and got.num_gpus >= 2 * step
    if policy == "sia":
        best, _ = brute_force(tables, cluster, jobs={"h": spec})
        assert sia_objective(tables, result, jobs={"h": spec}) == pytest.approx(best, rel=1e-9)
    assert JobSpec.from_dict(spec.to_dict()) == spec and spec.to_dict()["granularity"] == stages
    nowhere = allocate(tables, cluster, policy=policy, jobs={"h": JobSpec(granularity={"t4": 3, "a100": 16, "rtx2080ti": 32},
                                                                          gpu_types=("t4", "a100", "rtx2080ti"))})
    assert nowhere["h"] is None and "granularity" in nowhere.unallocated["h"]


def test_a_hybrid_jobs_pipelines_stay_within_nodes_when_they_fit_one():
    """Sia's shapes keep a pipeline of S GPUs (S dividing the node) on one node: a sub-node allocation lies on one
    node, a whole-node one holds S-divisible GPUs on every node."""
    cluster = Cluster.parse("a100:3x8")
    tables = {"h": scaling_table("h", cluster, {"a100": 1.0}, exponent=1.0),
              "d": scaling_table("d", cluster, {"a100": 1.0}, exponent=0.5)}
    for spec in (JobSpec(granularity={"a100": 4}, max_gpus=4), JobSpec(granularity={"a100": 4}, min_gpus=16)):
        result = allocate(tables, cluster, jobs={"h": spec})
        placement = result["h"].placement
        assert all(gpus % 4 == 0 for gpus in placement.values()), placement


def test_gpu_type_restriction():
    cluster = Cluster.parse("t4:1x4,a100:1x4")
    tables = {"a": scaling_table("a", cluster, {"t4": 1.0, "a100": 5.0})}
    assert allocate(tables, cluster)["a"].gpu_type == "a100"
    assert allocate(tables, cluster, jobs={"a": JobSpec(gpu_types=("t4",))})["a"].gpu_type == "t4"
    nowhere = allocate(tables, cluster, jobs={"a": JobSpec(gpu_types=("t4",), min_gpus=8)})
    assert nowhere["a"] is None and "no feasible configuration" in nowhere.unallocated["a"]


def test_min_and_max_gpus():
    cluster = Cluster.parse("t4:1x8")
    tables = {f"j{i}": scaling_table(f"j{i}", cluster, {"t4": 1.0}) for i in range(4)}
    free = allocate(tables, cluster)
    assert free["j0"].num_gpus == 2
    result = allocate(tables, cluster, jobs={"j0": JobSpec(min_gpus=4)})
    assert result["j0"].num_gpus >= 4
    solo = {"j0": tables["j0"]}
    assert allocate(solo, cluster)["j0"].num_gpus == 8
    assert allocate(solo, cluster, jobs={"j0": JobSpec(max_gpus=4)})["j0"].num_gpus == 4


def test_non_preemptible_jobs_stay_put():
    cluster = Cluster.parse("t4:1x4,a100:1x4")
    tables = {"a": scaling_table("a", cluster, {"t4": 1.0, "a100": 5.0}),
              "b": scaling_table("b", cluster, {"t4": 1.0, "a100": 5.0})}
    current = {"a": JobAllocation("t4", 1, 1, {"t4-0": 1})}
    moved = allocate(tables, cluster, current=current)
    assert moved["a"].configuration != ("t4", 1, 1)
    pinned = allocate(tables, cluster, current=current, jobs={"a": JobSpec(preemptible=False)})
    assert pinned["a"] == current["a"]
    assert pinned.details["a"]["pinned"] is True
    assert pinned.gpus_used()["t4"] >= 1


def test_non_preemptible_beyond_capacity_names_the_job():
    cluster = Cluster.parse("t4:1x4")
    tables = {j: scaling_table(j, cluster, {"t4": 1.0}) for j in ("a", "b")}
    current = {"a": JobAllocation("t4", 1, 4, {"t4-0": 4}), "b": JobAllocation("t4", 1, 2, {"t4-0": 2})}
    jobs = {"a": JobSpec(preemptible=False), "b": JobSpec(preemptible=False)}
    with pytest.raises(ValidationError, match=r"jobs\[b\]"):
        allocate(tables, cluster, current=current, jobs=jobs)


def test_strong_scaling_tables_and_fixed_batch():
    from tests.test_model import observations

    cluster = Cluster.parse("t4:1x4")
    obs = observations("s")
    fixed = JobModel("s", init_batch_size=64, max_batch_size=64).observe(obs).table(cluster)
    ok = allocate({"s": fixed}, cluster, jobs={"s": JobSpec(fixed_batch_size=64)})
    assert ok["s"] is not None and set(fixed.frame["batch_size"]) == {64}
    elastic = JobModel("s", init_batch_size=64, max_batch_size=1024).observe(obs)
    elastic.observe(dataclasses.replace(obs[0], grad_sqr=1.0, grad_var=8.0))
    grown = elastic.table(cluster)
    assert grown.frame["batch_size"].max() > 64
    with pytest.raises(ValidationError, match=r"s: batch_size.*fixed_batch_size=64"):
        allocate({"s": grown}, cluster, jobs={"s": JobSpec(fixed_batch_size=64)})
    # no more data-parallel replicas than samples in the batch
    tiny = table("t", {("t4", 1, 1): 10.0, ("t4", 1, 2): 19.0, ("t4", 1, 4): 36.0})
    assert allocate({"t": tiny}, cluster)["t"].num_gpus == 4
    assert allocate({"t": tiny}, cluster, jobs={"t": JobSpec(fixed_batch_size=2)})["t"].num_gpus == 2


def test_spec_validation_names_field_and_job():
    with pytest.raises(ValidationError, match="rigid_gpus"):
        JobSpec(rigid_gpus=3, granularity=2)
    with pytest.raises(ValidationError, match="attained"):
        JobSpec(age=10.0, attained=20.0)
    with pytest.raises(ValidationError, match="max_gpus"):
        JobSpec(min_gpus=4, max_gpus=2)
    cluster = Cluster.parse("t4:1x4")
    tables = {"a": scaling_table("a", cluster, {"t4": 1.0})}
    with pytest.raises(ValidationError, match=r"jobs\[a\]\.min_gpus"):
        allocate(tables, cluster, jobs={"a": {"min_gpus": 0}})
    with pytest.raises(ValidationError, match=r"jobs\[a\]\.colour"):
        allocate(tables, cluster, jobs={"a": {"colour": "red"}})
    with pytest.raises(ValidationError, match=r"jobs\[zz\]"):
        allocate(tables, cluster, jobs={"zz": JobSpec()})
    with pytest.raises(UnknownGPUTypeError, match=r"jobs\[a\]\.gpu_types"):
        allocate(tables, cluster, jobs={"a": JobSpec(gpu_types=("h100",))})
    assert JobSpec.from_dict(JobSpec(age=5.0, gpu_types=("t4",)).to_dict()) == JobSpec(age=5.0, gpu_types=("t4",))


# ---------------------------------------------------------------------------- bad input
def test_bad_goodput_names_the_job():
    with pytest.raises(ValidationError, match="bad: goodput"):
        GoodputTable("bad", [{"gpu_type": "t4", "num_nodes": 1, "num_gpus": 1, "goodput": math.nan}])
    with pytest.raises(ValidationError, match="bad: goodput"):
        GoodputTable("bad", [{"gpu_type": "t4", "num_nodes": 1, "num_gpus": 1, "goodput": -1.0}])
    cluster = Cluster.parse("t4:1x4")
    good = table("bad", {("t4", 1, 1): 1.0})
    good._arrays = {**good.column_arrays(), "goodput": np.array([math.nan])}  # defensive check inside the allocator
    # (tables validate on creation)
    with pytest.raises(ValidationError, match="bad: goodput"):
        allocate({"bad": good}, cluster)


def test_unknown_gpu_type_names_the_job():
    cluster = Cluster.parse("t4:1x4")
    tables = {"ok": table("ok", {("t4", 1, 1): 1.0}), "odd": table("odd", {("h100", 1, 1): 1.0})}
    with pytest.raises(UnknownGPUTypeError, match="odd: gpu_type.*h100"):
        allocate(tables, cluster)


def test_other_bad_inputs():
    cluster = Cluster.parse("t4:1x4")
    tab = table("a", {("t4", 1, 1): 1.0})
    with pytest.raises(ValidationError, match=r"tables\[a\]"):
        allocate({"a": {"rows": []}}, cluster)
    with pytest.raises(ValidationError, match=r"tables\[b\]"):
        allocate({"b": tab}, cluster)
    with pytest.raises(ValidationError, match="cluster"):
        allocate({"a": tab}, "t4:1x4")
    with pytest.raises(ValidationError, match="p=0"):
        allocate({"a": tab}, cluster, p=0)
    steep = table("s", {("t4", 1, 1): 1.0, ("t4", 1, 4): 1e4})
    with pytest.raises(ValidationError, match="p=80.*overflow"):  # (1e4)^80: every cost inf, pruning meaningless
        allocate({"s": steep}, cluster, p=80)
    with pytest.raises(ValidationError, match="colour"):
        allocate({"a": tab}, cluster, colour=1)
    with pytest.raises(ValidationError, match="policy"):
        allocate({"a": tab}, cluster, policy="random")
    with pytest.raises(ValidationError, match="solver"):
        allocate({"a": tab}, cluster, solver="cplex")
    with pytest.raises(UnknownGPUTypeError, match=r"current\[a\]\.gpu_type"):
        allocate({"a": tab}, cluster, current={"a": JobAllocation("v100", 1, 1)})
    with pytest.raises(ValidationError, match=r"current\[a\]\.placement"):
        allocate({"a": tab}, cluster, current={"a": JobAllocation("t4", 1, 1, {"t4-7": 1})})
    with pytest.raises(ValidationError, match=r"current\[a\]"):
        allocate({"a": tab}, cluster, current={"a": JobAllocation("t4", 2, 8)})


def test_infeasible_jobs_are_reported_not_dropped():
    cluster = Cluster.parse("t4:1x4")
    tables = {"big": table("big", {("t4", 2, 8): 100.0}), "zero": table("zero", {("t4", 1, 1): 0.0}),
              "empty": GoodputTable.from_dict({"job": "empty", "rows": []}), "ok": table("ok", {("t4", 1, 2): 5.0})}
    result = allocate(tables, cluster)
    assert set(result) == set(tables)
    assert result["ok"].num_gpus == 2
    assert "fits the cluster's nodes" in result.unallocated["big"]
    assert "positive goodput" in result.unallocated["zero"]
    assert "empty" in result.unallocated["empty"]


# ---------------------------------------------------------------------------- the result
def test_current_round_trip_and_unchanged_jobs_keep_gpus(tmp_path):
    cluster = Cluster.parse("t4:6x4,a100:2x8,rtx2080ti:3x8")
    tables = random_tables(cluster, 30, np.random.default_rng(3))
    first = allocate(tables, cluster)
    path = first.to_json(tmp_path / "round1.json")
    again = Allocation.from_json(path)
    assert dict(again) == dict(first) and again.info == first.info
    second = allocate(tables, cluster, current=again)
    for job, alloc in second.allocated.items():
        if not second.details[job]["changed"] and not second.details[job]["moved"]:
            assert alloc.placement == first[job].placement
    assert all(not d["changed"] for d in second.details.values())  # same tables: nothing to change
    frame = second.to_frame()
    assert list(frame["job"]) == list(tables) and (frame["num_gpus"] >= 0).all()
    assert "sia" in repr(second)
    check_invariants(second, tables, cluster)
    data = first.to_dict()
    for info, field in (({**data["info"], "colour": 1}, "info.colour"), ({"policy": "sia"}, "info.solver"), ([1], "info"),
                        ({**data["info"], "prices": [1.0]}, "info.prices"), ({**data["info"], "prices": {"t4": None}}, "info.prices[t4]"),
                        ({**data["info"], "notes": 5}, "info.notes")):
        with pytest.raises(ValidationError) as caught:
            Allocation.from_dict({**data, "info": info})
        assert caught.value.field == field
    with pytest.raises(ValidationError, match="unallocated"):
        Allocation.from_dict({**data, "unallocated": [1]})


def test_current_entries_of_finished_jobs_are_ignored():
    cluster = Cluster.parse("t4:1x4")
    tables = {"a": scaling_table("a", cluster, {"t4": 1.0})}
    current = {"gone": JobAllocation("t4", 1, 4, {"t4-0": 4})}
    assert allocate(tables, cluster, current=current)["a"].num_gpus == 4


def test_prices_carry_to_the_next_round_and_change_no_answer():
    """SolverInfo.prices (the fast path's GPU prices) survive a JSON round trip, and a round given the last
    Allocation as current starts from them: the same objective as a cold start, allocations built unchecked
    equal checked ones."""
    cluster = Cluster.parse("t4:24x4,a100:8x8,rtx2080ti:12x8")  # 256 GPUs
    tables = random_tables(cluster, 160, np.random.default_rng(21))
    first = allocate(tables, cluster)
    assert first.info.solver.startswith("lagrangian") and set(first.info.prices) == set(cluster.gpu_types)
    assert Allocation.from_dict(first.to_dict()).info.prices == first.info.prices
    for job, alloc in first.allocated.items():
        assert alloc == JobAllocation(alloc.gpu_type, alloc.num_nodes, alloc.num_gpus, dict(alloc.placement))
    changed = {**tables, **random_tables(cluster, 20, np.random.default_rng(22))}  # job0..job19 change
    warm = allocate(changed, cluster, current=first)
    cold = allocate(changed, cluster, current={k: v for k, v in first.items() if v is not None})
    assert warm.info.objective == pytest.approx(cold.info.objective, rel=1e-6)
    assert warm.info.gap <= 1e-6 and cold.info.gap <= 1e-6
    check_invariants(warm, changed, cluster)


def test_filled_prices_overfill_just_the_part_empty_types_and_near_options_keep_the_bound():
    """The primal's second rounding: a type the bound's prices leave part-empty gets a price at which its demand
    (others fixed) just exceeds its capacity; and the warm start's option subset changes the dual's value by
    nothing a cold start would not find."""
    from goodput.allocator.lagrangian import _Dense, _choose, _demand, _filled_prices, _near_options

    cluster = Cluster.parse("t4:24x4,a100:8x8,rtx2080ti:12x8")
    tables = random_tables(cluster, 300, np.random.default_rng(31))
    prob = sia_problem(prepare(tables, cluster), -0.5, 1.1)
    cold = solve_lagrangian(prob)
    dense = [_Dense(prob, t, len(prob.names)) for t in range(3)]
    _, types, columns = _choose(dense, cold.prices, len(prob.names))
    demand = _demand(dense, types, columns, 3)
    filled = _filled_prices(dense, cold.prices, prob.capacity)
    if demand.min() < prob.capacity.min():  # a part-empty type: lowered (types in turn, the others as they stand)
        assert filled is not None and np.all(filled <= cold.prices) and np.any(filled < cold.prices)
        last = int(np.flatnonzero(filled < cold.prices)[-1])
        _, ty, co = _choose(dense, filled, len(prob.names))
        assert _demand(dense, ty, co, 3)[last] > prob.capacity[last]  # overfilled just past its capacity
    solution = solve_lagrangian(prob)
    assert np.all(np.bincount(prob.opt_type[solution.choice[solution.choice >= 0]],
                              weights=prob.opt_gpus[solution.choice[solution.choice >= 0]], minlength=3)
                  <= prob.capacity + 1e-9)
    near = _near_options(prob, cold.prices)
    assert 0 < near.num_options < prob.num_options and set(near.opt_job.tolist()) <= set(prob.opt_job.tolist())
    warm = solve_lagrangian(prob, start_prices=cold.prices)
    assert warm.bound == pytest.approx(cold.bound, rel=1e-9) and warm.bound <= solve_milp(prob).total + 1e-9
