"""The residual GP: online conditioning equals batch conditioning, jitter, fallback, shrinking uncertainty, shared hyperparameters."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from goodput import JobModel, Observation, ValidationError
from goodput import posterior as posterior_module
from goodput.gp import (
    CORRELATION_LOGIT_STD,
    DEFAULT_TASK_CORRELATION,
    GPHyperparameters,
    GPNumericalError,
    HyperPrior,
    OnlinePosterior,
    cholesky_with_jitter,
    config_features,
    covariance,
)
from goodput.gp_fit import fit_hyperparameters, fit_shared_hyperparameters, gpytorch_posterior
from goodput.throughput import ThroughputParams, predict_step_time
from tests.test_throughput import synthetic


def _data(n: int, tasks: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    nodes = rng.integers(1, 4, n)
    replicas = nodes * rng.integers(1, 5, n)
    bsz = 2 ** rng.uniform(3, 9, n)
    accum = rng.integers(0, 2, n)
    x = config_features(nodes, replicas, bsz, accum)
    t = rng.integers(0, tasks, n)
    s = rng.normal(0, 0.1, (n, 4))
    y = 0.1 * np.sin(x[:, 0]) + 0.05 * x[:, 1] + 0.1 * s[:, 0] + rng.normal(0, 0.03, n)
    return x, t, s, y


def test_online_update_equals_batch_conditioning():
    x, t, s, y = _data(50)
    hyper = GPHyperparameters(lengthscale=(1.7, 3.0, 4.0, 2.5, 2.0, 3.0), task_factor=(0.1, 0.12, 0.08),
                              task_var=(1e-3, 2e-3, 5e-4), noise=7e-4)
    online = OnlinePosterior(hyper, x[:20], t[:20], s[:20], y[:20])
    for start in range(20, 50, 7):  # uneven chunks, one at a time at the end
        online.condition(x[start:start + 7], t[start:start + 7], s[start:start + 7], y[start:start + 7])
    batch = OnlinePosterior(hyper, x, t, s, y)
    xq, tq, sq, _ = _data(15, seed=1)
    m_online, v_online = online.predict(xq, tq, sq, noise=False)
    m_batch, v_batch = batch.predict(xq, tq, sq, noise=False)
    np.testing.assert_allclose(m_online, m_batch, atol=1e-10)
    np.testing.assert_allclose(v_online, v_batch, atol=1e-10)
    np.testing.assert_allclose(online.predict_mean(xq, tq, sq), m_batch, atol=1e-10)
    one_type = np.full(tq.size, 2)  # a goodput table's query: every point on one type (predict_mean's fast path)
    without_linear = batch.predict(xq, one_type, np.zeros_like(sq), noise=False)[0]
    np.testing.assert_allclose(online.predict_mean(xq, one_type), without_linear, atol=1e-10)
    # and gpytorch's own batch ExactGP prediction (Hadamard multitask) with the same hyperparameters
    m_ref, v_ref = gpytorch_posterior(hyper, x, t, s, y, xq, tq, sq)
    np.testing.assert_allclose(m_online, m_ref, atol=1e-8)
    np.testing.assert_allclose(v_online, v_ref, atol=1e-8)


def test_a_kept_query_kernel_is_extended_by_the_new_points_only_and_gives_the_batch_mean():
    """``predict_mean(..., cache_key=)``: a goodput table's candidates are asked for after every observation; the
    kept kernel grows by the conditioned points' rows and the mean equals the batch posterior's, and the
    cache holds at most ``QUERY_CACHE_ENTRIES`` query sets."""
    from goodput.gp import QUERY_CACHE_BYTES, QUERY_CACHE_ENTRIES

    x, t, s, y = _data(40)
    hyper = GPHyperparameters(lengthscale=(1.7, 3.0, 4.0, 2.5, 2.0, 3.0), task_factor=(0.1, 0.12, 0.08),
                              task_var=(1e-3, 2e-3, 5e-4), noise=7e-4)
    xq, _, _, _ = _data(25, seed=2)
    tq = np.full(25, 1)
    online = OnlinePosterior(hyper, x[:10], t[:10], s[:10], y[:10])
    for end in (10, 11, 17, 40):
        if end > len(online):
            online.condition(x[len(online):end], t[len(online):end], s[len(online):end], y[len(online):end])
        kept = online.predict_mean(xq, tq, cache_key="candidates")
        assert online._query_kernels["candidates"].shape == (end, 25)
        batch = OnlinePosterior(hyper, x[:end], t[:end], s[:end], y[:end])
        np.testing.assert_allclose(kept, batch.predict_mean(xq, tq), atol=1e-10)
    for i in range(QUERY_CACHE_ENTRIES + 3):  # the least recently used sets leave first
        online.predict_mean(xq[i:], tq[i:], cache_key=i)
    assert len(online._query_kernels) == QUERY_CACHE_ENTRIES and "candidates" not in online._query_kernels
    # and at most QUERY_CACHE_BYTES in all: a set larger than that is not kept, and takes no other's place
    big, _, _, _ = _data(QUERY_CACHE_BYTES // (8 * 40) + 1, seed=3)
    expected = OnlinePosterior(hyper, x, t, s, y).predict_mean(big, np.ones(len(big), int))
    np.testing.assert_allclose(online.predict_mean(big, np.ones(len(big), int), cache_key="big"), expected, atol=1e-10)
    assert "big" not in online._query_kernels and len(online._query_kernels) == QUERY_CACHE_ENTRIES


def test_the_linear_weights_posterior_covariance_is_extended_online_and_equals_the_batch_one():
    """``OnlinePosterior.weights_cov()``: ``I − Sᵀ K⁻¹ S`` (K with the noise), its square root's rows appended by
    :meth:`condition` rather than recomputed; the unscented transform of the parametric part reads it."""
    x, t, s, y = _data(40)
    hyper = GPHyperparameters(lengthscale=(1.7, 3.0, 4.0, 2.5, 2.0, 3.0), task_factor=(0.1, 0.12, 0.08),
                              task_var=(1e-3, 2e-3, 5e-4), noise=7e-4)
    online = OnlinePosterior(hyper, x[:15], t[:15], s[:15], y[:15])
    before = online.weights_cov().copy()
    for start in range(15, 40, 9):
        online.condition(x[start:start + 9], t[start:start + 9], s[start:start + 9], y[start:start + 9])
    k = covariance(hyper, x, t, s, x, t, s) + hyper.noise * np.eye(40)
    brute = np.eye(s.shape[1]) - s.T @ np.linalg.solve(k, s)
    np.testing.assert_allclose(online.weights_cov(), brute, atol=1e-9)
    np.testing.assert_allclose(OnlinePosterior(hyper, x, t, s, y).weights_cov(), brute, atol=1e-9)
    assert np.trace(online.weights_cov()) < np.trace(before)  # more data: the weights are better known


def test_hyperparameter_fit_improves_the_marginal_likelihood():
    from goodput.gp import log_marginal_likelihood

    x, t, s, y = _data(80, seed=2)
    init = GPHyperparameters.default(num_tasks=3)
    fitted = fit_hyperparameters(x, t, s, y, init)
    assert fitted != init
    assert log_marginal_likelihood(OnlinePosterior(fitted, x, t, s, y)) > log_marginal_likelihood(OnlinePosterior(init, x, t, s, y))
    assert 1e-4 < fitted.noise < 4e-3  # generated with noise std 0.03 (variance 9e-4)


def test_jitter_rescues_a_rank_deficient_covariance():
    x, t, s, y = _data(5, tasks=1)
    x, t, s = np.repeat(x[:1], 12, 0), np.repeat(t[:1], 12), np.zeros((12, 0))
    hyper = GPHyperparameters((2.0,) * 6, (0.1,), (0.0,), noise=0.0)  # duplicates and no noise: singular
    post = OnlinePosterior(hyper, x, t, s, np.full(12, 0.05))
    assert post.jitter > 0
    mean, var = post.predict(x[:1], t[:1], s[:1])
    assert np.isfinite(mean).all() and np.isfinite(var).all() and mean[0] == pytest.approx(0.05, abs=1e-3)
    with pytest.raises(GPNumericalError):
        cholesky_with_jitter(np.full((3, 3), np.nan))


def _duplicates(n: int = 12) -> list[Observation]:
    return [Observation(job="j", gpu_type="t4", num_nodes=1, num_replicas=2, local_bsz=32, step_time=0.1) for _ in range(n)] + [
        Observation(job="j", gpu_type="t4", num_nodes=1, num_replicas=1, local_bsz=b, step_time=0.01 + 0.001 * b) for b in (8, 16, 64)
    ]


def test_fallback_to_the_parametric_prediction_never_raises(monkeypatch):
    # A deliberately ill-conditioned input: identical observations, zero noise, and no jitter allowed.
    monkeypatch.setattr("goodput.gp.JITTERS", (0.0,))
    singular = GPHyperparameters((2.0,) * 6, (0.1,), (0.0,), noise=0.0)
    monkeypatch.setattr(posterior_module, "fit_hyperparameters_over_modes", lambda *args, **kwargs: (singular, 0))
    model = JobModel("j", init_batch_size=32).observe(_duplicates())
    pred = model.predict("t4", 1, 2, 32)
    assert model.diagnostics["fallback"] and "positive definite" in model.diagnostics["reason"]
    assert pred.step_time == pytest.approx(0.1, rel=0.05)  # the Pollux mean
    assert pred.log_std >= posterior_module.FALLBACK_LOG_STD  # with an inflated std
    table = model.table(__import__("goodput").Cluster.parse("t4:2x4"))
    assert np.isfinite(table.frame["std"]).all() and (table.frame["goodput"] > 0).all()
    # an online update that cannot be factorised schedules a refit instead of raising
    monkeypatch.setattr("goodput.gp.JITTERS", (0.0, 1e-6))
    model.refit()
    assert not model.diagnostics["fallback"]
    model.observe(_duplicates(1)[0])
    assert np.isfinite(model.predict("t4", 1, 2, 32).step_time)


def test_a_posterior_that_fails_at_prediction_falls_back_to_the_parametric_mean(monkeypatch):
    truth = ThroughputParams(0.02, 0.001, 0.25, 0.02, 0.08, 0.01, 1.6)
    model = JobModel("j", init_batch_size=64).observe(synthetic(truth, [(1, 1), (1, 2)], job="j", gpu="t4"))
    healthy = model.predict("t4", 4, 16, 64)

    def broken(*args, **kwargs):
        raise FloatingPointError("overflow")

    monkeypatch.setattr(OnlinePosterior, "predict", broken)
    seen, unseen = model.predict("t4", 1, 2, 64), model.predict("t4", 4, 16, 64)  # several nodes: never observed
    assert seen.log_std == pytest.approx(model._state.fallback_log_std) == unseen.log_std
    assert unseen.log_std >= posterior_module.FALLBACK_LOG_STD
    assert unseen.step_time == pytest.approx(healthy.step_time, rel=0.2)  # the prior mean, near the posterior's


def test_uncertainty_shrinks_where_data_arrive():
    truth = ThroughputParams(0.02, 0.001, 0.25, 0.02, 0.08, 0.01, 1.6)
    model = JobModel("j", init_batch_size=64).observe(synthetic(truth, [(1, 1), (1, 2)], job="j", gpu="t4"))
    before = model.predict("t4", 1, 4, 64)
    near_before = model.predict("t4", 1, 4, 128)
    single_before = model.predict("t4", 1, 1, 64)
    for bsz in (32, 64, 128):  # the job now runs on 4 GPUs and reports step times
        t = float(predict_step_time(truth, 1, 4, bsz))
        model.observe(Observation(job="j", gpu_type="t4", num_nodes=1, num_replicas=4, local_bsz=bsz, step_time=t))
    after = model.predict("t4", 1, 4, 64)
    assert after.log_std < 0.6 * before.log_std
    assert model.predict("t4", 1, 4, 128).log_std < near_before.log_std
    assert abs(after.step_time / float(predict_step_time(truth, 1, 4, 64)) - 1) < 0.05
    assert model.predict("t4", 1, 1, 64).log_std <= single_before.log_std * 1.5  # elsewhere: about unchanged


def test_online_observe_conditions_without_refitting(monkeypatch):
    truth = ThroughputParams(0.02, 0.001, 0.25, 0.02, 0.08, 0.01, 1.6)
    obs = synthetic(truth, [(1, 1), (1, 2), (1, 4), (2, 8)], job="j", gpu="t4")
    model = JobModel("j", init_batch_size=64, refit_every=1000).observe(obs[:-5])
    model.predict("t4", 1, 1, 64)
    refits = model.refits
    points = model.diagnostics["gp_points"]
    for o in obs[-5:-1]:
        model.observe(o)
    assert model.refits == refits and model.diagnostics["gp_points"] == points + 4  # conditioned, not refitted
    model.observe(Observation(**{**obs[-1].__dict__, "step_time": obs[-1].step_time * 3}))  # a surprise: |z| > 3
    assert model.last_z > 3
    model.predict("t4", 1, 1, 64)
    assert model.refits == refits + 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_reference_posterior_at_training_points(device):
    """gpytorch's reference at queries that repeat training points, where the kernel's joint covariance is
    singular: its sync term must be added as a plain sum (linear_operator's low-rank update inverts the singular
    part and raised NotPSDError; first seen on an H200)."""
    torch = pytest.importorskip("torch")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x, t, s, y = _data(60, seed=4)
    on_cpu = fit_hyperparameters(x, t, s, y, GPHyperparameters.default(num_tasks=3))
    mean_ref, var_ref = gpytorch_posterior(on_cpu, x, t, s, y, x[:5], t[:5], s[:5], device=device)
    mean_online, var_online = OnlinePosterior(on_cpu, x, t, s, y).predict(x[:5], t[:5], s[:5], noise=False)
    np.testing.assert_allclose(mean_ref, mean_online, atol=1e-8)
    np.testing.assert_allclose(var_ref, var_online, atol=1e-8)


def test_another_jobs_hyperparameters_are_matched_to_gpu_types_by_name():
    """A new job may meet its GPU types in another order than the job whose hyperparameters it starts from."""
    from goodput import JobModel, Observation
    from goodput.errors import ValidationError

    hyper = GPHyperparameters((2.0,) * 6, (0.1, 0.3), (0.05, 1e-6), 1e-3, task_names=("t4", "a100"))
    moved = hyper.for_types(["a100", "v100", "t4"])
    assert moved.task_names == ("a100", "v100", "t4")
    assert moved.task_factor == pytest.approx((0.3, 0.2, 0.1)) and moved.task_var == pytest.approx((1e-6, 0.025, 0.05), rel=1e-3)
    assert GPHyperparameters((2.0,) * 6, (0.1, 0.3), (0.05, 1e-6), 1e-3).for_types(["a100", "t4"]).task_var == (0.05, 1e-6)

    model = JobModel("new", 32, gp_hyperparameters=hyper)
    model.observe([Observation("new", gpu, 1, r, 32, step_time=0.05 * r**0.1) for gpu in ("a100", "t4") for r in (1, 2, 4)])
    model.refit(hyperparameters=False)
    used = model.gp_hyperparameters
    assert dict(zip(used.task_names, used.task_var)) == {"a100": 1e-6, "t4": 0.05}
    with pytest.raises(ValidationError, match="task_names"):
        GPHyperparameters((2.0,) * 6, (0.1, 0.3), (0.05, 1e-6), 1e-3, task_names=("t4",))


def test_shared_hyperparameters_recover_the_process_several_jobs_share():
    """Independent draws of one Matérn process (one per job): the fit finds its variance, noise and length scale."""
    rng = np.random.default_rng(3)
    true_ls, true_var, true_noise = 1.5, 0.01, 0.001
    hyper = GPHyperparameters((true_ls,) + (50.0,) * 5, (0.0,), (true_var,), true_noise)
    groups = []
    for _ in range(6):
        bsz = 2.0 ** np.sort(rng.uniform(3, 10, 40))
        x = config_features(np.ones(40), np.ones(40), bsz, np.zeros(40))
        from goodput.gp import covariance

        k = covariance(hyper, x, np.zeros(40, int), np.zeros((40, 0)), x, np.zeros(40, int), np.zeros((40, 0)))
        y = rng.multivariate_normal(np.zeros(40), k + true_noise * np.eye(40))
        groups.append((x, y))
    fitted = fit_shared_hyperparameters(groups)
    assert isinstance(fitted, HyperPrior)
    assert fitted.signal_var == pytest.approx(true_var, rel=0.6)
    assert fitted.noise == pytest.approx(true_noise, rel=0.6)
    assert fitted.lengthscale[0] == pytest.approx(true_ls, rel=0.5)
    assert fit_shared_hyperparameters([(np.zeros((2, 6)), np.zeros(2))]) is None  # too few points


def test_a_hyper_prior_keeps_a_few_points_from_collapsing_the_noise():
    x, t, s, y = _data(6, tasks=1, seed=5)
    prior = HyperPrior((2.0,) * 6, 0.004, 0.002, log_std=0.5)
    free = fit_hyperparameters(x, t, np.zeros((6, 0)), y, GPHyperparameters.default(num_tasks=1))
    held = fit_hyperparameters(x, t, np.zeros((6, 0)), y, prior.initial(1), hyper_prior=prior)
    assert held.noise > free.noise and held.noise == pytest.approx(0.002, rel=1.5)
    with pytest.raises(ValidationError, match="signal_var"):
        HyperPrior((2.0,) * 6, -1.0, 0.001)
    assert HyperPrior.from_dict(prior.to_dict()) == prior


@pytest.mark.parametrize("with_prior, linear, fixed_noise", [(False, False, False), (True, False, False), (True, True, True),
                                                             (False, True, False)])
def test_the_dense_objective_is_gpytorchs_marginal_likelihood(with_prior, linear, fixed_noise):
    """The hyperparameter fit's objective and its analytic gradient equal gpytorch's ExactMarginalLogLikelihood of the
    Hadamard model (plus the signal prior) and its autograd gradient, in the same raw coordinates."""
    import gpytorch
    import torch

    from goodput.gp_fit import _FitData, _negative_log_posterior, _raw_from_hyper, _torch_model

    x, t, s, y = _data(30, tasks=3, seed=7)
    s = s if linear else np.zeros((30, 0))
    d = np.random.default_rng(1).uniform(1e-4, 1e-3, 30) if fixed_noise else None
    hyper = GPHyperparameters(lengthscale=(1.7, 3.0, 0.4, 2.5, 9.0, 3.0), task_factor=(0.1, -0.12, 0.08),
                              task_var=(1e-3, 2e-3, 5e-4), noise=7e-4)
    prior = HyperPrior((2.0, 1.0, 3.0, 2.0, 2.0, 4.0), 0.004, 0.002, log_std=0.7, correlation=0.4) if with_prior else None
    model, likelihood, inputs, target = _torch_model(hyper, x, t, s, y, d, None, prior)
    model.train()
    likelihood.train()
    with gpytorch.settings.max_cholesky_size(100_000), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # linear_operator's notice on torch's sparse invariant checks
        loss = -gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)(model(*inputs), target)
        if prior is not None:
            task = model.task_kernel.covar_matrix.to_dense().diagonal()
            loss = loss + 0.5 * (((torch.log(task) - np.log(prior.signal_var)) / prior.log_std) ** 2).sum() / len(y)
            # each type's shared fraction w²/(w² + v), logit-normal around the prior's correlation
            w2, v = model.task_kernel.covar_factor.ravel() ** 2, model.task_kernel.var
            z = (torch.log(w2 / v) - np.log(prior.correlation / (1 - prior.correlation))) / CORRELATION_LOGIT_STD
            loss = loss + 0.5 * (z**2).sum() / len(y)
    loss.backward()
    noise_module = likelihood.second_noise_covar if fixed_noise else likelihood.noise_covar
    expected_grad = np.concatenate([p.grad.numpy().ravel() for p in (noise_module.raw_noise, model.data_kernel.raw_lengthscale,
                                                                     model.task_kernel.covar_factor, model.task_kernel.raw_var)])
    data = _FitData((x[:, None, :] - x[None, :, :]) ** 2, np.eye(3)[t], s @ s.T, np.zeros(30) if d is None else d, np.ones(30), y,
                    np.unique(t))
    value, grad = _negative_log_posterior(_raw_from_hyper(hyper), data, prior)
    # gpytorch keeps its constraints' bounds (0.05, 50, the noise floor) as float32 numbers: 1e-9 relative apart
    assert value == pytest.approx(float(loss.detach()), rel=1e-7)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-9)


def test_a_noise_scale_per_point_is_the_fixed_noise_it_stands_for_and_its_gradient_matches_finite_differences():
    """The objective with each point's noise σ²·c_i (a Student-t noise's E-step, ``noise_scale``) equals the one with
    σ² plus the fixed variance σ²·(c_i − 1) at the same σ², and its gradient in the raw noise matches central
    differences (the other coordinates' gradient is the fixed-noise one's)."""
    from scipy.optimize import approx_fprime

    from goodput.gp_fit import _FitData, _negative_log_posterior, _raw_from_hyper

    x, t, s, y = _data(30, tasks=3, seed=21)
    scale = np.random.default_rng(4).uniform(0.8, 40.0, 30)
    hyper = GPHyperparameters(task_names=("a", "b", "c"), lengthscale=(1.2, 0.8, 2.0, 1.5, 3.0, 0.9),
                              task_factor=(0.02, -0.01, 0.03), task_var=(1e-3, 2e-3, 5e-4), noise=7e-4)
    prior = HyperPrior((2.0, 1.0, 3.0, 2.0, 2.0, 4.0), 0.004, 0.002, log_std=0.7, correlation=0.4)
    geometry = ((x[:, None, :] - x[None, :, :]) ** 2, np.eye(3)[t], s @ s.T)
    scaled = _FitData(*geometry, np.zeros(30), scale, y, np.unique(t))
    fixed = _FitData(*geometry, hyper.noise * (scale - 1.0), np.ones(30), y, np.unique(t))
    raw = _raw_from_hyper(hyper)
    value, grad = _negative_log_posterior(raw, scaled, prior)
    value_fixed, grad_fixed = _negative_log_posterior(raw, fixed, prior)
    assert value == pytest.approx(value_fixed, rel=1e-12)
    np.testing.assert_allclose(grad[1:], grad_fixed[1:], rtol=1e-9, atol=1e-12)
    numeric = approx_fprime(raw, lambda r: _negative_log_posterior(r, scaled, prior)[0], 1e-7)
    assert grad[0] == pytest.approx(numeric[0], rel=1e-4)
    assert grad[0] != pytest.approx(grad_fixed[0], rel=1e-3)  # the scale multiplies σ²'s own slope


def test_the_shared_fits_gradient_matches_finite_differences():
    """fit_shared_hyperparameters' analytic gradient (log length scales, log signal variance, log noise, logit of
    the types' correlation) against central differences, one job on one type and two on several, with one length
    scale clamped at its upper bound (no gradient there)."""
    from scipy.optimize import approx_fprime

    from goodput.gp_fit import _shared_negative_log_likelihood

    groups = []
    for seed, tasks in ((10, 1), (11, 3), (12, 2)):
        x, t, _, y = _data(25, tasks=tasks, seed=seed)
        groups.append(((x[:, None, :] - x[None, :, :]) ** 2, t[:, None] == t[None, :], y - y.mean()))
    params = np.concatenate([np.log([1.5, 2.0, 3.0, 0.7, 60.0, 2.5, 0.003, 0.001]), [0.4]])
    value, grad = _shared_negative_log_likelihood(params, groups, 75)
    numeric = approx_fprime(params, lambda p: _shared_negative_log_likelihood(p, groups, 75)[0], 1e-7)
    np.testing.assert_allclose(grad, numeric, rtol=1e-4, atol=1e-6)
    assert grad[4] == 0.0 and grad[-1] != 0.0 and np.isfinite(value)


def test_the_shared_fit_scores_residuals_whose_type_means_were_taken_out_by_their_restricted_likelihood():
    """_restricted_nll is the likelihood of the contrasts free of each type's mean (REML, Patterson & Thompson 1971):
    differences between covariances match a dense computation on an orthonormal basis of them, and shifting a
    type's residuals changes nothing (the plain likelihood would)."""
    from goodput.gp_fit import _restricted_nll

    rng = np.random.default_rng(3)
    t = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
    same = t[:, None] == t[None, :]
    y = rng.standard_normal(t.size)
    basis = np.linalg.svd(np.eye(3)[t], full_matrices=True)[0][:, 3:]  # orthonormal, orthogonal to the type indicators

    def covariance(scale: float) -> np.ndarray:
        root = np.random.default_rng(4).standard_normal((t.size, t.size))
        return scale * root @ root.T / t.size + np.eye(t.size)

    def contrasts_nll(k: np.ndarray) -> float:
        ck = basis.T @ k @ basis
        z = basis.T @ y
        return float(0.5 * z @ np.linalg.solve(ck, z) + 0.5 * np.linalg.slogdet(ck)[1])

    k1, k2 = covariance(1.0), covariance(3.0)
    assert _restricted_nll(k1, y, same)[0] - _restricted_nll(k2, y, same)[0] == pytest.approx(
        contrasts_nll(k1) - contrasts_nll(k2), rel=1e-10)
    shifted = y + np.array([4.0, -2.0, 7.0])[t]
    assert _restricted_nll(k1, shifted, same)[0] == pytest.approx(_restricted_nll(k1, y, same)[0], rel=1e-10)
    np.testing.assert_allclose(_restricted_nll(k1, shifted, same)[1], _restricted_nll(k1, y, same)[1], atol=1e-10)


@pytest.mark.parametrize("rho", [0.2, 0.85])
def test_the_shared_fit_learns_how_correlated_a_jobs_types_are(rho):
    """Jobs on three types whose residuals are one Hadamard process with correlation ρ between types: the cluster's
    fit recovers ρ, and a new job's prior starts there. One-type jobs alone leave it at the default."""
    rng = np.random.default_rng(int(rho * 100))
    true_var, true_noise = 0.01, 5e-4
    w = math.sqrt(rho * true_var)
    hyper = GPHyperparameters((1.5,) + (50.0,) * 5, (w, w, w), ((1 - rho) * true_var,) * 3, true_noise)
    groups = []
    for _ in range(8):
        bsz = 2.0 ** np.sort(rng.uniform(3, 10, 15))
        x = np.tile(config_features(np.ones(15), np.ones(15), bsz, np.zeros(15)), (3, 1))
        t = np.repeat(np.arange(3), 15)
        k = covariance(hyper, x, t, np.zeros((45, 0)), x, t, np.zeros((45, 0)))
        groups.append((x, rng.multivariate_normal(np.zeros(45), k + true_noise * np.eye(45)), t))
    residuals = [y.copy() for _, y, _ in groups]
    fitted = fit_shared_hyperparameters(groups)
    assert fitted.correlation == pytest.approx(rho, abs=0.15)
    assert all(np.array_equal(y, kept) for (_, y, _), kept in zip(groups, residuals))  # centred on a copy
    start = fitted.initial(3).task_correlation()
    assert start[0, 1] == pytest.approx(fitted.correlation)
    assert fit_shared_hyperparameters([(x, y) for x, y, _ in groups]).correlation == DEFAULT_TASK_CORRELATION


def test_a_hyper_priors_correlation_is_validated_and_saved():
    prior = HyperPrior((2.0,) * 6, 0.004, 0.002, correlation=0.3)
    assert HyperPrior.from_dict(prior.to_dict()) == prior
    older = {k: v for k, v in prior.to_dict().items() if k != "correlation"}  # saved before the field existed
    assert HyperPrior.from_dict(older).correlation == DEFAULT_TASK_CORRELATION
    for bad in (0.0, 1.0, 1.5, float("nan")):
        with pytest.raises(ValidationError, match="correlation"):
            HyperPrior((2.0,) * 6, 0.004, 0.002, correlation=bad)


def test_the_correlation_prior_holds_a_few_points_near_the_clusters_figure():
    """Three types, a handful of points each: the fitted types' correlation follows the prior's (0.2 or 0.9)."""
    x, t, s, y = _data(12, tasks=3, seed=9)
    fitted = {rho: fit_hyperparameters(x, t, np.zeros((12, 0)), y, HyperPrior((2.0,) * 6, 0.004, 0.002, correlation=rho).initial(3),
                                       hyper_prior=HyperPrior((2.0,) * 6, 0.004, 0.002, correlation=rho))
              for rho in (0.2, 0.9)}
    low, high = (abs(fitted[rho].task_correlation()[0, 1]) for rho in (0.2, 0.9))
    assert low < 0.5 < high


def test_keep_recent_drops_the_least_recently_used_by_count_and_by_bytes():
    from collections import OrderedDict

    from goodput.gp import keep_recent

    cache: OrderedDict = OrderedDict()
    for key in "abcd":
        keep_recent(cache, key, key, entries=3)
    assert list(cache) == ["b", "c", "d"]
    keep_recent(cache, "b", "b2", entries=3)  # a kept key becomes the most recent
    assert list(cache) == ["c", "d", "b"] and cache["b"] == "b2"
    sized: OrderedDict = OrderedDict()
    for key in range(3):
        keep_recent(sized, key, np.zeros(10), entries=8, max_bytes=200)  # 80 bytes each
    assert list(sized) == [1, 2]
    keep_recent(sized, 1, np.zeros(100), entries=8, max_bytes=200)  # alone above the budget: dropped, nothing else
    assert list(sized) == [2]
