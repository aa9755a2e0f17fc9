"""Calibration of the Bayesian layer with few observations, and what a sparsely observed GPU type borrows from the others."""

from __future__ import annotations

import numpy as np
import pytest

from goodput import JobModel, Observation
from goodput.throughput import ThroughputParams
from tests.test_throughput import synthetic

BSZ = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _hinge(gpu: str, speed: float, bszs, seed: int, noise: float = 0.02) -> list[Observation]:
    """1-GPU steps that are flat at small batches, then linear (a GPU not yet saturated): not Pollux's α + β·b."""
    rng = np.random.default_rng(seed)
    return [
        Observation(job="j", gpu_type=gpu, num_nodes=1, num_replicas=1, local_bsz=b,
                    step_time=speed * (0.03**4 + (0.0002 * b) ** 4) ** 0.25 * float(np.exp(rng.normal(0.0, noise))))
        for b in bszs
    ]


def test_a_type_seen_at_one_batch_size_borrows_the_residual_shape_of_the_others():
    # Three types swept over batch sizes, a fourth measured at one: its own fit passes through that
    # point (a zero residual by construction), which must not cut it off from the others' residual shape.
    train = _hinge("a", 1.0, BSZ, 0) + _hinge("b", 1.7, BSZ, 1) + _hinge("c", 0.6, BSZ, 2) + _hinge("d", 2.5, [256], 3)
    model = JobModel("j", init_batch_size=8).observe(train)
    test = _hinge("d", 2.5, [b for b in BSZ if b != 256], 4, noise=0.0)
    bsz = np.array([o.local_bsz for o in test], float)
    actual = np.array([o.step_time for o in test])
    pred = model.predict("d", 1, 1, bsz)
    state = model._current()
    k = state.index["d"]
    corr = state.hyper.task_correlation()[k]
    assert np.all(np.delete(corr, k) > 0.5), corr
    # it takes the task parameters of a typical type (not its stale initial ones)
    w = np.array(state.hyper.task_factor)
    others = np.delete(w, k)
    assert abs(w[k] - others.mean()) < 0.25 * abs(others.mean()), w
    design = state.design("d", np.ones_like(bsz), np.ones_like(bsz), bsz, np.zeros_like(bsz))
    mean_only = np.exp(design.log_mean)
    ape = np.median(np.abs(pred.step_time / actual - 1))
    assert ape < 0.85 * np.median(np.abs(mean_only / actual - 1))
    low, high = pred.interval(0.9)
    assert np.mean((low <= actual) & (actual <= high)) >= 0.8


def test_a_fit_through_few_observations_is_not_taken_as_exact():
    # 5 observations of a 7-parameter model: the fit interpolates them, and its residuals say
    # nothing about the error elsewhere; the intervals must still cover the held-out configurations.
    truth = ThroughputParams(0.040, 0.0020, 0.12, 0.006, 0.03, 0.003, 1.5)
    configs = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 4), (2, 8), (3, 12), (4, 16)]
    obs = synthetic(truth, configs, bszs=(8, 16, 32, 64, 128), accums=(0,), noise=0.05, seed=3, gpu="slow")
    coverage = []
    for seed in range(4):
        order = np.random.default_rng(seed).permutation(len(obs))
        train, test = [obs[i] for i in order[:5]], [obs[i] for i in order[5:]]
        model = JobModel("j", init_batch_size=8).observe(train)
        cols = {k: np.array([getattr(o, k) for o in test], float) for k in ("num_nodes", "num_replicas", "local_bsz", "accum_steps")}
        pred = model.predict("slow", cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"])
        low, high = pred.interval(0.9)
        actual = np.array([o.step_time for o in test])
        coverage.append(np.mean((low <= actual) & (actual <= high)))
    assert np.mean(coverage) >= 0.85, coverage


def test_borrowed_task_parameters_are_the_others_typical_ones():
    from goodput.gp import GPHyperparameters

    hyper = GPHyperparameters((1.0,) * 6, (0.1, 0.2, 0.0), (1e-3, 4e-3, 0.0), 1e-3)
    out = hyper.borrowed([2])
    assert np.allclose(out.task_factor, (0.1, 0.2, 0.15))
    assert np.allclose(out.task_var, (1e-3, 4e-3, 2e-3))  # geometric mean of the others'
    assert out.lengthscale == hyper.lengthscale and out.noise == hyper.noise
    assert hyper.borrowed([]) == hyper and hyper.borrowed([0, 1, 2]) == hyper


def test_intervals_are_student_t_while_a_type_has_few_residual_degrees_of_freedom(monkeypatch):
    import goodput.bayes as bayes

    truth = ThroughputParams(0.040, 0.0020, 0.12, 0.006, 0.03, 0.003, 1.5)
    few = synthetic(truth, [(1, 1)], bszs=(8, 32, 128), accums=(0,), noise=0.03, seed=1, gpu="few")
    many = synthetic(truth, [(1, 1), (1, 2), (1, 4)], bszs=(8, 16, 32, 64, 128), accums=(0, 1), noise=0.03, seed=2, gpu="many")
    model = JobModel("j", init_batch_size=8, refit_every=1000).observe(few + many)
    state = model._current()
    # 3 observations of 2 identified groups: 1 residual degree of freedom (+ the prior's 2)
    assert state.t_factor("few") > 1.3 and state.t_factor("many") < 1.05
    wide = model.predict("few", 1, 1, 64).log_std
    monkeypatch.setattr(bayes, "T_PREDICTIVE", False)
    narrow = model.predict("few", 1, 1, 64).log_std
    assert wide > 1.2 * narrow
    monkeypatch.setattr(bayes, "T_PREDICTIVE", True)
    before = state.t_factor("few")
    model.observe(synthetic(truth, [(1, 1)], bszs=(16, 64), accums=(0,), noise=0.03, seed=3, gpu="few"))
    assert model.refits == 1 and state.t_factor("few") < before  # online observations add degrees of freedom


def test_online_observations_narrow_the_own_fits_parameter_uncertainty_as_a_batch_would():
    # Between refits the Laplace covariance of the type's identified groups takes each new
    # observation's information (a rank update), as the GP posterior does: equal to building it
    # from all the observations at the refit's residual variance, and narrower than before.
    from goodput.transfer import GROUPS

    truth = ThroughputParams(0.040, 0.0020, 0.12, 0.006, 0.03, 0.003, 1.5)
    first = synthetic(truth, [(1, 1), (1, 2)], bszs=(8, 32, 128), accums=(0,), noise=0.03, seed=1, gpu="t")
    later = synthetic(truth, [(1, 1), (1, 2)], bszs=(16, 64, 256), accums=(0,), noise=0.03, seed=2, gpu="t")
    model = JobModel("j", init_batch_size=8, refit_every=1000, surprise=1e6).observe(first)
    state = model._current()
    before = state.cov_id["t"].copy()
    wide = model.predict("t", 1, 2, 512).log_std
    model.observe(later)
    narrow = model.predict("t", 1, 2, 512).log_std
    assert model.refits == 1 and model._current() is state  # conditioned online, not refitted
    design, _ = state.design_observations(first + later)
    batch = np.linalg.inv(np.eye(len(GROUPS)) + design.s_id.T @ design.s_id / state.r2_id["t"])
    np.testing.assert_allclose(state.cov_id["t"], batch, rtol=1e-8, atol=1e-12)
    assert np.trace(state.cov_id["t"]) < np.trace(before) and narrow < wide


def test_inter_node_terms_from_own_intra_node_sync_and_other_jobs_ratios():
    from goodput.transfer import GAMMA_GRID, ClusterPrior

    single = [(1, 1), (1, 2), (1, 3), (1, 4)]
    multi = [(2, 4), (2, 8), (3, 12), (4, 16), (8, 32)]

    def job(ac, bc, ar, slope_r, gamma):  # a cluster whose inter-node sync costs 5x the intra-node one
        return ThroughputParams(ac, bc, 5 * ar, 0.25 * ar, ar, slope_r * ar, gamma)

    others = {"a": job(0.02, 0.001, 0.01, 0.1, 1.2), "b": job(0.2, 0.01, 0.2, 0.02, 2.5), "c": job(0.05, 0.004, 0.02, 0.3, 1.0)}
    prior = ClusterPrior.from_observations(
        {k: synthetic(p, single + multi, job=k, gpu="t4", seed=i, accums=(0,), noise=0.02) for i, (k, p) in enumerate(others.items())})
    truth = job(0.1, 0.003, 0.08, 0.15, 1.0)
    model = JobModel("new", init_batch_size=8, cluster_prior=prior).observe(
        synthetic(truth, single, job="new", gpu="t4", seed=9, accums=(0,), noise=0.02))
    own = model.own_fit("t4")
    transfer = model._current().transfers["t4"]
    ratio_members = [m for m in transfer.members[3] if "inter/intra ratio" in m.source]
    jobs = [m.source.split(",")[0].removeprefix("job ") for m in ratio_members]
    assert set(jobs) == {"a", "b", "c"} and transfer.inherited[3] > 0.5
    for name in "abc":  # one vote per other job, spread over the overlaps γ its members hold
        assert sum(m.weight for m, j in zip(ratio_members, jobs) if j == name) == pytest.approx(transfer.inherited[3] / 3)
    for member, name in zip(ratio_members, jobs):
        src = prior.find(name, "t4").params_g  # its fit at the shared overlap γ = TRANSFER_GAMMA
        assert member.theta[6] in (*GAMMA_GRID, own.gamma) and member.theta[0] == own.alpha_c  # a single-node fit at a γ of the grid
        assert member.theta[2] / member.theta[4] == pytest.approx(src.alpha_n / src.alpha_r)  # the other job's ratio
    # the posterior over γ sits where the single-node data put it (the truth: γ = 1)
    weights = np.array([m.weight for m in ratio_members])
    assert weights @ np.array([m.theta[6] for m in ratio_members]) / weights.sum() < 1.3
    test = synthetic(truth, multi, job="new", gpu="t4", seed=10, accums=(0,), noise=0.0)
    cols = {k: np.array([getattr(o, k) for o in test], float) for k in ("num_nodes", "num_replicas", "local_bsz")}
    pred = model.predict("t4", cols["num_nodes"], cols["num_replicas"], cols["local_bsz"])
    actual = np.array([o.step_time for o in test])
    assert np.median(np.abs(pred.step_time / actual - 1)) < 0.1
    # the uncertainty of the own intra-node fit carries over to the inter-node predictions
    state = model._current()
    design = state.design("t4", cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], np.zeros_like(actual))
    assert np.all(state._id_var("t4", design) > 0)
    # a job whose intra-node sync hides behind its compute has no intra-node cost to scale: no ratio members
    hidden = ThroughputParams(0.5, 0.01, 0.0004, 0.00002, 1e-9, 1e-9, 1.0)
    quiet = JobModel("quiet", init_batch_size=8, cluster_prior=prior).observe(
        synthetic(hidden, single, job="quiet", gpu="t4", seed=11, accums=(0,), noise=0.01))
    assert quiet.own_fit("t4").alpha_r < 0.01 * 0.5
    assert not any("inter/intra ratio" in m.source for m in quiet._current().transfers["t4"].members[3])


def test_a_type_without_multi_gpu_data_carries_the_jobs_own_sync_from_another_type():
    # P2's layout: the new job ran multi-GPU on one node of type "w" only, and 1 GPU on "x". Other
    # jobs ran everything on both; on "x" compute is 2x faster and every sync cost 3x dearer.
    from goodput.transfer import GAMMA_GRID, ClusterPrior

    single = [(1, 1), (1, 2), (1, 3), (1, 4)]
    multi = [(2, 4), (2, 8), (3, 12), (4, 16), (8, 32)]

    def job(ac, bc, ar, slope_r, gamma, compute=1.0, sync=1.0):  # inter-node sync costs 5x the intra-node one
        return ThroughputParams(compute * ac, compute * bc, sync * 5 * ar, sync * 1.25 * ar, sync * ar, sync * slope_r * ar, gamma)

    shapes = {"a": (0.02, 0.001, 0.01, 0.1, 1.2), "b": (0.2, 0.01, 0.2, 0.02, 2.5), "c": (0.05, 0.004, 0.02, 0.3, 1.0)}
    others = {}
    for i, (name, shape) in enumerate(shapes.items()):
        others[name] = (synthetic(job(*shape), single + multi, job=name, gpu="w", seed=i, accums=(0,), noise=0.02)
                        + synthetic(job(*shape, compute=0.5, sync=3.0), single + multi, job=name, gpu="x", seed=10 + i, accums=(0,), noise=0.02))
    prior = ClusterPrior.from_observations(others)
    shape = (0.1, 0.003, 0.08, 0.15, 1.0)
    train = (synthetic(job(*shape), single, job="new", gpu="w", seed=20, accums=(0,), noise=0.02)
             + synthetic(job(*shape, compute=0.5, sync=3.0), [(1, 1)], job="new", gpu="x", seed=21, accums=(0,), noise=0.02))
    model = JobModel("new", init_batch_size=8, cluster_prior=prior).observe(train)
    state = model._current()
    transfer = state.transfers["x"]
    carried = [m for m in transfer.members[3] if "own fit on w" in m.source]
    jobs = [m.source.split(",")[0].removeprefix("job ") for m in carried]
    assert set(jobs) == {"a", "b", "c"} and transfer.borrowed[3]["w"] > 0.5
    for name in "abc":  # one vote per other job, spread over the overlaps γ of the fits on w
        assert sum(m.weight for m, j in zip(carried, jobs) if j == name) == pytest.approx(transfer.borrowed[3]["w"] / 3)
    for member, name in zip(carried, jobs):
        here, there = prior.find(name, "x").params_g, prior.find(name, "w").params_g
        src = prior.find(name, "w").params_g
        assert member.theta[6] in (*GAMMA_GRID, model.own_fit("w").gamma)  # a fit on w at a γ of the grid, or the free one
        assert member.theta[0] == pytest.approx(model.own_fit("x").alpha_c)
        # own intra-node constant on w (at that γ) × the other job's inter/intra ratio on w × its x/w inter-node ratio
        assert member.theta[2] / member.theta[4] == pytest.approx(src.alpha_n / src.alpha_r * here.alpha_n / there.alpha_n)
    test = synthetic(job(*shape, compute=0.5, sync=3.0), multi, job="new", gpu="x", seed=22, accums=(0,), noise=0.0)
    cols = {k: np.array([getattr(o, k) for o in test], float) for k in ("num_nodes", "num_replicas", "local_bsz")}
    pred = model.predict("x", cols["num_nodes"], cols["num_replicas"], cols["local_bsz"])
    actual = np.array([o.step_time for o in test])
    # 95% off without the other jobs. Within 15% when their ratios were read at each job's own γ,
    # exact here, where Pollux's form holds and the jobs' γ differ (1.0-2.5); 18.6% when read at the
    # shared γ of their held fits, which measured better on real data (accuracy.md round 11)
    assert np.median(np.abs(pred.step_time / actual - 1)) < 0.2
    # the uncertainty of the own fit on w carries over to these predictions (and only to multi-node ones)
    var = state._borrowed_var("x", cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], np.zeros_like(actual))
    assert np.all(var > 0) and np.all(np.isfinite(var))
    assert np.all(state._borrowed_var("x", np.ones(3), np.array([1, 2, 4]), np.full(3, 64.0), np.zeros(3)) == 0)


def test_a_type_observed_only_on_several_nodes_keeps_its_own_fit_there():
    # Online, a job may run on several nodes before it runs on one: its own fit's inter-node terms
    # were fitted with its own overlap γ, so the mean of the regime it was observed in keeps that γ
    # (the single-node regimes take the ensembles' sync terms); mixing the own α_n with another γ
    # mispredicted the very placements it was fitted to (Pollux's ncf: 8.8% → 20% APE).
    from goodput.throughput import predict_step_time
    from goodput.transfer import ClusterPrior

    single = [(1, 1), (1, 2), (1, 3), (1, 4)]
    multi = [(2, 4), (2, 8), (3, 12), (4, 16), (8, 32)]

    def job(ac, bc, ar, slope_r, gamma):
        return ThroughputParams(ac, bc, 5 * ar, 0.25 * ar, ar, slope_r * ar, gamma)

    others = {"a": job(0.02, 0.001, 0.01, 0.1, 1.2), "b": job(0.2, 0.01, 0.2, 0.02, 2.5), "c": job(0.05, 0.004, 0.02, 0.3, 1.0)}
    prior = ClusterPrior.from_observations(
        {k: synthetic(p, single + multi, job=k, gpu="t4", seed=i, accums=(0,), noise=0.02) for i, (k, p) in enumerate(others.items())})
    truth = job(0.1, 0.003, 0.08, 0.15, 1.0)
    train = synthetic(truth, multi, job="new", gpu="t4", seed=9, accums=(0,), noise=0.02)
    model = JobModel("new", init_batch_size=8, cluster_prior=prior).observe(train)
    state = model._current()
    own, transfer = model.own_fit("t4"), state.transfers["t4"]
    assert 1 in transfer.members and 2 in transfer.members  # the single-node regimes come from the ensembles
    assert transfer.params.gamma == own.gamma
    cols = {k: np.array([getattr(o, k) for o in train], float) for k in ("num_nodes", "num_replicas", "local_bsz", "accum_steps")}
    args = (cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"])
    design = state.design("t4", *args)
    np.testing.assert_allclose(design.log_mean, np.log(predict_step_time(own, *args, sync_shape=model.sync_shape("t4"))), rtol=1e-10)


def test_the_residual_scale_is_not_the_in_sample_one():
    # The GP's hyperparameters are fitted to the residuals of each type's own fit, which spent p
    # identified groups on n observations: their scatter underestimates a new observation's by
    # (n - p) / n. The predictive variance of the GP takes the unbiased n / (n - p).
    truth = ThroughputParams(0.040, 0.0020, 0.12, 0.006, 0.03, 0.003, 1.5)
    obs = synthetic(truth, [(1, 1), (1, 2), (1, 4), (2, 8)], bszs=(8, 32, 128), accums=(0,), noise=0.05, seed=4, gpu="t")
    model = JobModel("j", init_batch_size=8, refit_every=1000).observe(obs)
    state = model._current()
    n, dof = len(obs), state.dof["t"]
    assert 0 < dof < n and state.unbias["t"] == pytest.approx(n / dof)
    design = state.design("t", 2, 8, 64, 0)
    _, var = state.posterior.predict(design.x, design.t, design.s, noise=True)
    expected = var * state.t_factor("t") ** 2 * n / dof + state._id_var("t", design) + design.d
    assert model.predict("t", 2, 8, 64).log_std == pytest.approx(float(np.sqrt(expected[0])), rel=1e-9)
    # a type whose own fit interpolates its observations gave the hyperparameters nothing: no factor
    few = JobModel("j", init_batch_size=8).observe(obs + synthetic(truth, [(1, 1)], bszs=(8,), accums=(0,), seed=5, gpu="u"))
    assert "u" not in few._current().unbias


@pytest.mark.data
def test_multi_node_from_single_node_on_pollux_traces(pollux_traces, tmp_path):
    from experiments import accuracy

    summary = accuracy.run(pollux_traces, tmp_path / "out", protocols=["P3"], methods=["bayes"], default_gpu_type="t4",
                           progress=False, mlflow=False).set_index("method")
    # measured: 7.8%, coverage 94% with the bundled parameter counts (--model-sizes auto; accuracy.md round 20); 9.5%,
    # coverage 87% without (round 11; 24% when other jobs' λ-scaled sync profiles set the inter-node terms)
    assert summary.loc["bayes", "median_ape"] < 16 and 85 <= summary.loc["bayes", "coverage90"] <= 97


@pytest.mark.data
def test_batch_sweeps_across_types_on_zeus_are_calibrated(data_dir, tmp_path):
    from experiments import accuracy

    summary = accuracy.run(data_dir / "zeus", tmp_path / "out", protocols=["P5"], methods=["bayes"], progress=False,
                           mlflow=False).set_index("method")
    # measured: 6.6% and 93% (7.7% and 68% before a type seen at one batch size borrowed a typical type's task parameters)
    assert summary.loc["bayes", "median_ape"] < 7.5 and 85 <= summary.loc["bayes", "coverage90"] <= 97
