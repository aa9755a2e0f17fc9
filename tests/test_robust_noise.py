"""Step times' Student-t noise in the fit (goodput.posterior): one step far off weighs as the tails say.

The cluster's residuals give the noise's degrees of freedom (:attr:`goodput.gp.HyperPrior.noise_dof`); the MAP,
the GP's hyperparameters and its posterior weigh each step by its E-step weight (Lange, Little & Taylor 1989), so
a checkpoint's or a stalled loader's step does not pull a configuration's prediction toward it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from goodput import JobModel, ValidationError
from goodput.hierarchy import ClusterPrior
from goodput.posterior import (DEFAULT_HYPER_PRIOR, _gp_weights, _online_weights, _step_noise, _t_weights,
                               _weighted_posterior, build_posterior)
from goodput.tails import DEFAULT_NOISE_DOF
from tests.hierarchy_jobs import SINGLE, SINGLE_NODE, cluster, draw_job, observe


@pytest.fixture(scope="module")
def cluster_prior() -> ClusterPrior:
    return ClusterPrior.from_observations(cluster(6, seed=3))


def _with_dof(prior: ClusterPrior, dof: float) -> ClusterPrior:
    assert prior.gp_prior is not None
    return dataclasses.replace(prior, gp_prior=dataclasses.replace(prior.gp_prior, noise_dof=dof))


def test_the_weights_are_one_for_gaussian_noise_and_fall_with_the_residual():
    sq = np.array([0.0, 1.0, 100.0]) * 0.05**2
    assert np.array_equal(_t_weights(sq, 0.05, math.inf), np.ones(3))
    w = _t_weights(sq, 0.05, 4.0)
    np.testing.assert_allclose(w, [5.0 / 4.0, 1.0, 5.0 / 104.0])


def test_the_step_noise_scale_is_the_rms_when_gaussian_and_ignores_an_outlier_when_heavy_tailed():
    rng = np.random.default_rng(0)
    clean = 0.05 * rng.standard_normal(60)
    dirty = np.append(clean, math.log(10.0))
    gaussian, stds = _step_noise(dirty, 0.05, math.inf)
    assert np.all(stds == gaussian) and gaussian > 0.25  # one step 10x too slow: the RMS is five times the noise
    heavy, stds = _step_noise(dirty, 0.05, 5.0)
    assert heavy == pytest.approx(_step_noise(clean, 0.05, 5.0)[0], rel=0.15)
    assert heavy < 0.07
    assert stds[-1] > 20 * np.median(stds[:-1])  # the outlier's std in the normal it mixes


def test_the_gp_weights_read_the_residual_the_gp_leaves_and_its_latent_variance():
    """_gp_weights against a dense computation of E[(y − f)²] under the GP posterior."""
    from goodput.gp import GPHyperparameters, covariance
    from goodput.posterior import Design

    rng = np.random.default_rng(1)
    n = 12
    x = rng.uniform(0, 3, (n, 6))
    t = rng.integers(0, 2, n)
    s = 0.1 * rng.standard_normal((n, 3))
    y = 0.05 * rng.standard_normal(n)
    y[4] += 1.5
    hyper = GPHyperparameters(task_names=("a", "b"), lengthscale=(1.0,) * 6, task_factor=(0.03, 0.02), task_var=(1e-3, 1e-3),
                              noise=2e-3)
    weights = rng.uniform(0.2, 1.1, n)
    post = _weighted_posterior(hyper, Design(x, t, s, np.zeros(n), np.zeros(n)), y, weights)
    k = covariance(hyper, x, t, s, x, t, s)
    d = np.diag(hyper.noise / weights)
    mean_f = k @ np.linalg.solve(k + d, y)
    var_f = np.diag(k - k @ np.linalg.solve(k + d, k))
    expected = _t_weights((y - mean_f) ** 2 + var_f, math.sqrt(hyper.noise), 4.0)
    np.testing.assert_allclose(_gp_weights(post, 4.0), expected, rtol=1e-7)


def _job(rng: np.random.Generator) -> tuple[list, dict]:
    """A new job's steps on t4 and a100, on 1, 2 and 4 GPUs of one node at three batches each, and its true coordinates."""
    truth = draw_job(rng, ("t4", "a100"))
    return [o for t, u in truth.items() for o in observe("new", t, u, SINGLE + SINGLE_NODE, rng)], truth


@pytest.mark.parametrize("where", ["seen", "new"])
def test_one_step_ten_times_too_slow_barely_moves_a_heavy_tailed_models_prediction(cluster_prior, where):
    """With the cluster's tails heavy (ν = 5), one step 10x too slow moves its configuration's predicted step time by
    under 10% and its spread by under 30%; with Gaussian noise the same step moves the prediction by more than 15%
    and widens its spread more than five-fold (the check can fail). (A step in a regime the job has not run,
    its first on several nodes, is no outlier: nothing else says what its sync costs.)"""
    rng = np.random.default_rng(5)
    observations, _ = _job(rng)
    base = observations[4]  # t4 on 2 GPUs, 32 samples each
    if where == "new":  # a batch between two measured ones on that placement (a regime the job's steps pin)
        base = dataclasses.replace(base, local_bsz=64)
    bad = dataclasses.replace(base, step_time=base.step_time * 10.0)
    query = (bad.gpu_type, bad.num_nodes, bad.num_replicas, bad.local_bsz)
    moved = {}
    for dof in (5.0, math.inf):
        prior = _with_dof(cluster_prior, dof)
        clean = JobModel("new", 32, cluster_prior=prior).observe(observations)
        dirty = JobModel("new", 32, cluster_prior=prior).observe(observations + [bad])
        before, after = clean.predict(*query), dirty.predict(*query)
        moved[dof] = (float(after.step_time / before.step_time), float(after.log_std / before.log_std))
    assert abs(math.log(moved[5.0][0])) < math.log(1.1), moved
    assert moved[5.0][1] < 1.3, moved
    assert moved[math.inf][0] > 1.15 and moved[math.inf][1] > 5.0, moved


def test_a_heavy_tailed_model_without_outliers_predicts_as_the_gaussian_one(cluster_prior):
    """On clean steps the weights stay near 1: predictions within 5% of the Gaussian model's."""
    rng = np.random.default_rng(8)
    observations, _ = _job(rng)
    heavy = JobModel("new", 32, cluster_prior=_with_dof(cluster_prior, 6.0)).observe(observations)
    gaussian = JobModel("new", 32, cluster_prior=_with_dof(cluster_prior, math.inf)).observe(observations)
    for gpu in ("t4", "a100"):
        nodes, replicas = np.array([1, 1, 2, 4]), np.array([1, 4, 4, 16])
        a = heavy.predict(gpu, nodes, replicas, 32).step_time
        b = gaussian.predict(gpu, nodes, replicas, 32).step_time
        np.testing.assert_allclose(a, b, rtol=0.05)


def test_an_online_outlier_is_weighed_as_a_refit_weighs_it(cluster_prior):
    """Conditioned online (no refit), a step far off gets the E-step's small weight: the prediction at its
    configuration moves by under 10% (under Gaussian noise it moves most of the way toward the step)."""
    rng = np.random.default_rng(9)
    observations, _ = _job(rng)
    moved = {}
    for dof in (5.0, math.inf):
        model = JobModel("new", 32, cluster_prior=_with_dof(cluster_prior, dof), surprise=1e9, refit_every=1000)
        model.observe(observations).refit()
        before = model.predict("t4", 1, 2, 32).step_time
        model.observe(dataclasses.replace(observations[0], num_nodes=1, num_replicas=2, local_bsz=32,
                                          step_time=float(before) * 10.0))
        assert model.unrefitted == 1
        moved[dof] = float(model.predict("t4", 1, 2, 32).step_time / before)
    assert moved[5.0] < 1.1 and moved[math.inf] > 2.0, moved


def test_build_posterior_with_gaussian_noise_is_unchanged_by_the_weights(cluster_prior):
    """ν = ∞: every weight is 1, so the posterior holds no extra noise (the Gaussian model as before)."""
    rng = np.random.default_rng(2)
    observations, _ = _job(rng)
    model = JobModel("new", 32, cluster_prior=_with_dof(cluster_prior, math.inf)).observe(observations).refit()
    assert np.all(model._current().posterior.extra_noise == 0.0)
    by_type = {"t4": [o for o in observations if o.gpu_type == "t4"]}
    mean, cov = JobModel("new", 32).observe(by_type["t4"]).prior()
    gaussian = dataclasses.replace(DEFAULT_HYPER_PRIOR, noise_dof=math.inf)
    state = build_posterior(by_type, mean, cov, {"t4": None}, hyper_prior=gaussian)
    assert np.all(state.posterior.extra_noise == 0.0)
    heavy = build_posterior(by_type, mean, cov, {"t4": None})  # the default's tails: the weights differ
    assert heavy.noise_dof == DEFAULT_NOISE_DOF and np.any(heavy.posterior.extra_noise != 0.0)


def test_an_online_weight_is_its_points_fixed_point_and_spares_a_regime_the_data_do_not_pin():
    """A step 2.3 off (10x) where the data pin the prediction (latent variance ≪ σ²) gets a tiny weight; the same
    step where they pin nothing (latent variance ≫ σ²: a regime the job had not run) keeps about 1. Each weight
    is the fixed point of its E-step at the posterior given the point itself."""
    sigma_sq, dof = 0.03**2, 6.0
    residual = np.array([2.3, 2.3, 0.03, np.nan])
    latent = np.array([1e-4, 4.0, 1e-4, 1e-4])
    w = _online_weights(residual, latent, sigma_sq, dof)
    assert w[0] < 3e-3 and w[1] > 0.9 and 0.8 < w[2] < 1.2
    assert w[3] == _online_weights(np.zeros(1), latent[3:], sigma_sq, dof)[0]  # not finite: read as no residual
    share = (sigma_sq / w) / (latent + sigma_sq / w)
    again = _t_weights((share * np.nan_to_num(residual)) ** 2 + share * latent, math.sqrt(sigma_sq), dof)
    np.testing.assert_allclose(w, again, rtol=1e-6)
    assert np.array_equal(_online_weights(residual, latent, sigma_sq, math.inf), np.ones(4))


def test_a_job_can_set_its_noise_tails_and_a_bad_value_is_refused_by_name(cluster_prior):
    rng = np.random.default_rng(3)
    observations, _ = _job(rng)
    heavy_cluster = _with_dof(cluster_prior, 5.0)
    assert JobModel("new", 32, cluster_prior=heavy_cluster).observe(observations).predict("t4", 1, 2, 32).noise_dof == 5.0
    gaussian = JobModel("new", 32, cluster_prior=heavy_cluster, noise_dof=math.inf).observe(observations)
    assert math.isinf(gaussian.predict("t4", 1, 2, 32).noise_dof) and gaussian.noise_dof == math.inf
    assert np.all(gaussian._current().posterior.extra_noise == 0.0)
    alone = JobModel("new", 32, noise_dof=3).observe(observations)
    assert alone.predict("t4", 1, 2, 32).noise_dof == 3.0 and isinstance(alone.noise_dof, float)
    assert JobModel("new", 32).observe(observations).predict("t4", 1, 2, 32).noise_dof == DEFAULT_NOISE_DOF
    for bad in (2.0, 1, float("nan"), "4", True):
        with pytest.raises(ValidationError, match="noise_dof"):
            JobModel("new", 32, noise_dof=bad)


def test_the_diagnostics_say_which_tails_and_how_many_steps_were_weighed_down(cluster_prior):
    rng = np.random.default_rng(5)
    observations, _ = _job(rng)
    stalled = observations + [dataclasses.replace(observations[4], step_time=observations[4].step_time * 10.0)]
    heavy = JobModel("new", 32, cluster_prior=_with_dof(cluster_prior, 5.0)).observe(stalled).diagnostics
    assert heavy["noise_dof"] == 5.0 and heavy["downweighted"] == 1
    assert JobModel("new", 32, cluster_prior=_with_dof(cluster_prior, 5.0)).observe(observations).diagnostics["downweighted"] == 0
    gaussian = JobModel("new", 32, noise_dof=math.inf).observe(stalled).diagnostics
    assert gaussian["noise_dof"] is None and gaussian["downweighted"] == 0
