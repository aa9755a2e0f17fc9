"""Simulator engine invariants: conservation, exact single-job completion, restart costs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from experiments.simulator.engine import SimConfig, Simulator
from experiments.simulator.truth import ParametricFamily, load_catalog
from experiments.simulator.workload import WorkloadJob
from goodput import Cluster
from goodput.errors import ValidationError
from goodput.throughput import ThroughputParams
from tests.sim_doubles import FixedPolicy

PARAMS = ThroughputParams(0.05, 0.001, 0.3, 0.01, 0.1, 0.005, 1.5)


def constant_noise_family(work=20_000.0, restart=30.0):
    return ParametricFamily(name="toy", init_batch_size=64, max_batch_size=64, min_local_bsz=8,
                            max_local_bsz={"t4": 64, "a100": 64}, work=work, noise=((0.0, 500.0),),
                            restart_cost_s=restart, params={"t4": PARAMS, "a100": PARAMS})


def test_single_job_finishes_when_its_true_goodput_implies():
    family = constant_noise_family()
    cluster = Cluster.parse("t4:1x4")
    job = WorkloadJob("solo", 100.0, "toy", 4, 64)
    result = Simulator([job], {"toy": family}, SimConfig(cluster=cluster), FixedPolicy("t4", 4)).run()
    # batch fixed at M0 = 64 on 4 GPUs: local 16; E = 1; rate = 64/64/T_iter iterations per second
    rate = family.rate("t4", 1, 4, 16, 0, 0.0)
    first_round = 120.0  # the first 60 s round at or after the arrival at 100 s
    expected = first_round + family.restart_cost_s + family.work / rate
    assert result.jobs["finish_s"].iloc[0] == pytest.approx(expected, rel=1e-9)
    assert result.jobs["restarts"].iloc[0] == 0
    assert result.jobs["gpu_hours"].iloc[0] == pytest.approx(4 * (expected - first_round) / 3600)


def test_restart_costs_are_charged():
    family = constant_noise_family(work=200_000.0)
    cluster = Cluster.parse("t4:1x4,a100:1x4")
    job = WorkloadJob("hopper", 0.0, "toy", 4, 64)
    steady = Simulator([job], {"toy": family}, SimConfig(cluster=cluster), FixedPolicy("t4", 4)).run()
    moving = Simulator([job], {"toy": family}, SimConfig(cluster=cluster), FixedPolicy("t4", 4, alternate="a100")).run()
    restarts = int(moving.jobs["restarts"].iloc[0])
    assert restarts > 10
    # identical speed on both types: the only difference is the restart delay of every move
    delta = moving.jobs["finish_s"].iloc[0] - steady.jobs["finish_s"].iloc[0]
    assert delta == pytest.approx(restarts * family.restart_cost_s, rel=1e-9)


def test_conservation_gpu_seconds_never_exceed_capacity():
    families = load_catalog()
    cluster = Cluster.parse("t4:2x4,a100:1x8")
    jobs = [WorkloadJob(f"j{i}", 30.0 * i, app, 2, 256) for i, app in enumerate(["cifar10", "ncf", "bert", "yolov3"] * 5)]
    result = Simulator(jobs, families, SimConfig(cluster=cluster), FixedPolicy("t4", 2)).run()
    rounds = result.rounds
    assert (rounds["gpus_t4"] <= cluster.capacity("t4")).all()
    assert (rounds["gpus_used"] <= cluster.total_gpus).all()
    assert rounds["queued"].max() > 0  # contention happened: 8 T4s for up to 20 jobs of 2
    elapsed = rounds["time_s"].max() + 60 - rounds["time_s"].min()
    assert result.jobs["gpu_hours"].sum() * 3600 <= cluster.capacity("t4") * elapsed + 1e-6
    assert result.summary["finished"] == len(jobs)


def test_overcommitting_policy_is_refused():
    family = constant_noise_family()
    cluster = Cluster.parse("t4:1x4")
    jobs = [WorkloadJob("a", 0.0, "toy", 4, 64), WorkloadJob("b", 0.0, "toy", 4, 64)]

    class Greedy(FixedPolicy):
        def decide(self, now, cluster, jobs):
            from experiments.simulator.engine import Assignment

            return {j.name: Assignment("t4", 1, 4, (("t4-0", 4),)) for j in jobs}

    with pytest.raises(ValidationError, match="t4-0"):
        Simulator(jobs, {"toy": family}, SimConfig(cluster=cluster), Greedy("t4", 4)).run()


def test_allocating_to_a_job_that_is_not_active_is_refused():
    family = constant_noise_family()
    cluster = Cluster.parse("t4:1x4")

    class Phantom(FixedPolicy):
        def decide(self, now, cluster, jobs):
            from experiments.simulator.engine import Assignment

            return {"ghost": Assignment("t4", 1, 4, (("t4-0", 4),))}

    with pytest.raises(ValidationError, match="ghost"):
        Simulator([WorkloadJob("a", 0.0, "toy", 4, 64)], {"toy": family}, SimConfig(cluster=cluster), Phantom("t4", 4)).run()


@pytest.mark.parametrize("field, value", [("max_hours", -1.0), ("max_hours", float("nan")), ("table_refresh", -0.1),
                                          ("observation_bias", {"t4": 0.0})])
def test_sim_config_is_validated(field, value):
    with pytest.raises(ValidationError, match=field):
        SimConfig(cluster=Cluster.parse("t4:1x4"), **{field: value})


@pytest.mark.parametrize("round_s", [0.0, -60.0, float("inf")])
def test_round_length_is_validated(round_s):
    from experiments.simulator.policies import make_policy

    with pytest.raises(ValidationError, match="round_s"):
        make_policy("sia", round_s=round_s)


def test_unknown_application_is_named():
    with pytest.raises(ValidationError, match="nosuch"):
        Simulator([WorkloadJob("x", 0, "nosuch", 1, 8)], load_catalog(), SimConfig(cluster=Cluster.parse("t4:1x4")),
                  FixedPolicy("t4", 1))


def test_model_bootstrap_profiles_every_type():
    families = load_catalog()
    cluster = Cluster.parse("t4:1x4,a100:1x8")
    sim = Simulator([WorkloadJob("c", 0.0, "cifar10", 1, 128)], families, SimConfig(cluster=cluster),
                    FixedPolicy("a100", 1, oracle=False))
    result = sim.run()
    model = sim.jobs[0].model
    assert set(model.gpu_types) == {"t4", "a100"}
    single = [o for o in model.observations if o.num_replicas == 1 and o.source == "simulated"]
    assert len(single) >= 2 * 3  # several batch sizes on each type
    assert result.summary["finished"] == 1


def test_cluster_knowledge_reaches_new_jobs():
    """Finished jobs that ran on several GPUs become the prior of later jobs' models; GP hyperparameters carry over."""
    from experiments.simulator.policies import make_policy

    families = load_catalog()
    cluster = Cluster.parse("t4:1x4,a100:1x4")
    jobs = [WorkloadJob(f"c{i}", 1500.0 * i, "cifar10", 4, 512) for i in range(4)]
    sim = Simulator(jobs, families, SimConfig(cluster=cluster), make_policy("sia"))
    sim.run()
    assert sim.knowledge.summaries and sim.knowledge.gp_hyperparameters is not None
    first, last = sim.jobs[0].model, sim.jobs[-1].model
    assert first.cluster_prior is None  # nothing was known when the first job arrived
    assert last.cluster_prior is not None and "c0" in last.cluster_prior.jobs


def test_unfinished_jobs_count_in_jct_with_their_time_so_far():
    """A policy that leaves jobs behind at the time limit must not look better for it."""
    family = constant_noise_family(work=2_000_000.0)
    cluster = Cluster.parse("t4:1x4")
    jobs = [WorkloadJob("a", 0.0, "toy", 4, 64), WorkloadJob("b", 0.0, "toy", 4, 64)]
    result = Simulator(jobs, {"toy": family}, SimConfig(cluster=cluster, max_hours=0.5), FixedPolicy("t4", 4)).run()
    summary = result.summary
    assert summary["unfinished"] == 2 and summary["jct_censored"] is True
    end = result.rounds["time_s"].max() + 60.0
    assert summary["avg_jct_s"] == pytest.approx(end)  # both arrived at 0 and were still running at the end
    assert summary["makespan_s"] == pytest.approx(end)


def test_jobs_arriving_after_the_time_limit_count_in_no_per_job_figure():
    """Three jobs arriving at 50 h of a 0.5 h simulation had counted with a JCT of 0, which lowered the mean."""
    family = constant_noise_family(work=2_000_000.0)
    cluster = Cluster.parse("t4:1x4")
    jobs = [WorkloadJob("a", 0.0, "toy", 4, 64)] + [WorkloadJob(f"late{i}", 50 * 3600.0, "toy", 4, 64) for i in range(3)]
    summary = Simulator(jobs, {"toy": family}, SimConfig(cluster=cluster, max_hours=0.5), FixedPolicy("t4", 4)).run().summary
    alone = Simulator(jobs[:1], {"toy": family}, SimConfig(cluster=cluster, max_hours=0.5), FixedPolicy("t4", 4)).run().summary
    assert summary["not_arrived"] == 3 and summary["unfinished"] == 1 and summary["jobs"] == 4
    for key in ("avg_jct_s", "median_jct_s", "makespan_s", "gpu_hours_per_job", "restarts_per_job"):
        assert summary[key] == pytest.approx(alone[key]), key
    # a limit that ends before the first job arrives: nothing to average
    none = Simulator([WorkloadJob("c", 30.0, "toy", 4, 64)], {"toy": family}, SimConfig(cluster=cluster, max_hours=0.005),
                     FixedPolicy("t4", 4)).run().summary
    assert none["not_arrived"] == 1 and "avg_jct_s" not in none and "makespan_s" not in none


def test_a_flat_restart_cost_overrides_the_applications():
    family = constant_noise_family(work=200_000.0, restart=80.0)
    cluster = Cluster.parse("t4:1x4,a100:1x4")
    job = WorkloadJob("hopper", 0.0, "toy", 4, 64)
    flat = SimConfig(cluster=cluster, restart_cost_s=5.0)
    steady = Simulator([job], {"toy": family}, flat, FixedPolicy("t4", 4)).run()
    moving = Simulator([job], {"toy": family}, flat, FixedPolicy("t4", 4, alternate="a100")).run()
    restarts = int(moving.jobs["restarts"].iloc[0])
    assert restarts > 10
    assert moving.jobs["finish_s"].iloc[0] - steady.jobs["finish_s"].iloc[0] == pytest.approx(restarts * 5.0, rel=1e-9)
    assert moving.settings["restart_cost_s"] == 5.0
    with pytest.raises(ValidationError, match="restart_cost_s"):
        SimConfig(cluster=cluster, restart_cost_s=-1.0)


def test_each_applications_restart_cost_reaches_the_allocators_restart_penalty(monkeypatch):
    """Sia's restart factor uses the job's own cost (bert 120 s, ncf 15 s), not one figure for all."""
    import experiments.simulator.policies as policies

    seen: dict[str, float] = {}
    real = policies.allocate

    def spy(tables, cluster, current=None, p=-0.5, **options):
        seen.update({name: spec.restart_cost for name, spec in options["jobs"].items()})
        return real(tables, cluster, current, p, **options)

    monkeypatch.setattr(policies, "allocate", spy)
    jobs = [WorkloadJob("b", 0.0, "bert", 1, 12), WorkloadJob("n", 0.0, "ncf", 1, 256)]
    sim = Simulator(jobs, load_catalog(), SimConfig(cluster=Cluster.parse("t4:1x4"), max_hours=0.1),
                    policies.make_policy("sia-oracle"))
    sim.run()
    assert seen == {"b": 120.0, "n": 15.0}
    assert [j.restart_cost_s for j in sim.jobs] == [120.0, 15.0]


def _oracle_sim(cluster_spec="t4:40x4,a100:8x8", jobs=24, seed=5):
    from experiments.simulator.policies import make_policy
    from experiments.simulator.truth import catalog_workload_stats
    from experiments.simulator.workload import synthetic_workload

    cluster = Cluster.parse(cluster_spec)
    families = load_catalog(gpu_types=cluster.gpu_types)
    work = synthetic_workload(catalog_workload_stats(), families, num_jobs=jobs, hours=1.0, seed=seed)
    sim = Simulator(work, families, SimConfig(cluster=cluster), make_policy("sia-oracle"))
    rng = np.random.default_rng(seed)
    for job in sim.jobs:
        job.progress = float(rng.uniform(0.0, 0.8)) * job.family.work
    return sim


def test_truth_tables_leave_out_only_configurations_where_no_batch_fits():
    """The oracle's tables hold the configurations up to max_batch_size // min_local_bsz GPUs; every one left
    out has goodput 0 in the full computation (never allocated), and the kept rows are the same."""
    sim = _oracle_sim()
    for job in sim.jobs[:8]:
        table = sim._truth_table(job).frame
        for pool in sim.cluster:
            configs = pool.configurations()
            full = job.family.best_config(pool.gpu_type, np.array([c[1] for c in configs], float),
                                          np.array([c[2] for c in configs], float), job.progress)
            kept = table[table["gpu_type"] == pool.gpu_type]
            useful = job.family.max_batch_size // job.family.min_local_bsz
            assert kept["num_gpus"].max() <= max(useful, 1)
            for i, (_, nodes, gpus) in enumerate(configs):
                row = kept[(kept["num_nodes"] == nodes) & (kept["num_gpus"] == gpus)]
                if row.empty:
                    assert full.goodput[i] == 0.0
                else:
                    assert row["goodput"].iloc[0] == full.goodput[i]
                    assert row["local_bsz"].iloc[0] == full.local_bsz[i]


def test_batched_oracle_tables_and_batches_equal_the_job_by_job_ones():
    sim = _oracle_sim(jobs=40)
    one_by_one = {job.name: sim._truth_table(job).frame for job in sim.jobs}
    sim._refresh_truth_tables(sim.jobs)
    for job in sim.jobs:
        pd.testing.assert_frame_equal(job.table.frame, one_by_one[job.name], check_exact=True)
        assert job.table_phi == job.family.noise_scale(job.progress)
    from experiments.simulator.engine import Assignment

    for i, job in enumerate(sim.jobs):  # a configuration each, then the batch choices both ways
        gpus = [1, 2, 4, 8][i % 4]
        job.assignment = Assignment("t4" if gpus <= 4 else "a100", 1, gpus, ((f"x-{i}", gpus),))
    expected = {job.name: sim._batch_config(job) for job in sim.jobs}
    sim._oracle_batches(sim.jobs)
    assert {job.name: (job.local_bsz, job.accum_steps) for job in sim.jobs} == expected


def test_policy_specs_and_allocations_kept_between_rounds_equal_fresh_ones():
    from experiments.simulator.engine import Assignment, JobView
    from experiments.simulator.policies import make_policy
    from goodput.allocator import JobAllocation, JobSpec

    policy = make_policy("sia")
    here = Assignment("t4", 1, 2, (("t4-0", 2),))
    view = JobView(name="a", application="cifar10", arrival=10.0, age_s=50.0, attained_s=20.0, restarts=1,
                   restart_cost_s=30.0, requested_gpus=64, requested_batch=128, current=here, table=None,
                   throughput=None, gpu_types=("t4",))
    first = policy._spec(view, Cluster.parse("t4:2x8"))  # its largest type: 16 GPUs
    later = JobView(**{**view.__dict__, "age_s": 110.0, "attained_s": 80.0, "restarts": 2})
    spec = policy._spec(later, Cluster.parse("t4:2x8"))
    assert first == JobSpec(age=50.0, restarts=1, restart_cost=30.0, attained=20.0, requested_gpus=16, arrival=10.0,
                            gpu_types=("t4",))
    assert spec == JobSpec(age=110.0, restarts=2, restart_cost=30.0, attained=80.0, requested_gpus=16, arrival=10.0,
                           gpu_types=("t4",))
    assert spec.restart_factor == JobSpec(age=110.0, restarts=2, restart_cost=30.0).restart_factor
    alloc = policy._allocation(view)
    assert alloc == JobAllocation("t4", 1, 2, {"t4-0": 2}) and policy._allocation(later) is alloc
    moved = JobView(**{**later.__dict__, "current": Assignment("t4", 1, 4, (("t4-1", 4),))})
    assert policy._allocation(moved) == JobAllocation("t4", 1, 4, {"t4-1": 4})


def test_isolated_time_from_running_maxima_equals_the_direct_maximum():
    from experiments.simulator import metrics

    cluster = Cluster.parse("t4:12x4,a100:4x8")
    families = load_catalog(gpu_types=cluster.gpu_types)
    mids, widths = metrics._segments()
    for family in list(families.values())[:3]:
        for contention in (1.0, 2.5, 7.0, 40.0):
            direct = np.inf
            for pool in cluster:
                allowed = [c for c in pool.configurations() if c[2] <= max(1.0, pool.gpus / max(contention, 1.0))]
                rates = np.array([max(metrics._best_rate(family, pool.gpu_type, n, g, k) for _, n, g in allowed)
                                  for k in range(len(mids))])
                if np.all(rates > 0):
                    direct = min(direct, float(np.sum(widths * family.work / rates)))
            assert metrics.isolated_time(family, cluster, contention) == direct + family.restart_cost_s


def test_cluster_knowledge_refits_its_prior_every_few_finished_jobs_from_the_same_summaries():
    """learn() keeps each finished job's cell summaries (without fitting a shared GP prior it would drop), and
    prior() hands out one ClusterPrior until refresh_every more jobs are learned."""
    from experiments.simulator.engine import ClusterKnowledge
    from goodput import JobModel
    from goodput.hierarchy import ClusterPrior
    from tests.hierarchy_jobs import cluster

    jobs = cluster(6, seed=3)
    models = [JobModel(name, init_batch_size=32).observe(obs) for name, obs in jobs.items()]
    knowledge = ClusterKnowledge(refresh_every=3)
    assert knowledge.prior() is None
    knowledge.learn(models[0])
    first = knowledge.prior()
    assert first is not None and first.jobs == [models[0].job]
    for model in models[1:3]:
        knowledge.learn(model)
        assert knowledge.prior() is first  # two learned since: not yet refreshed
    knowledge.learn(models[3])
    fresh = knowledge.prior()
    assert fresh is not first and sorted(fresh.jobs) == sorted(m.job for m in models[:4])
    each = [c for m in models[:4] for c in ClusterPrior.from_models([m]).summaries]  # each job summarised alone
    assert [(c.job, c.gpu_type) for c in fresh.summaries] == [(c.job, c.gpu_type) for c in each]
    assert all(np.allclose(a.u, b.u) and np.allclose(a.info, b.info) for a, b in zip(fresh.summaries, each))
    assert ClusterPrior.from_models(models[:1]).gp_prior is not None
    assert ClusterPrior.from_observations(jobs, gp_prior=False).gp_prior is None
