"""Heavy-tailed measurement noise (goodput.tails): its degrees of freedom, the intervals it gives, and where they enter."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats

from goodput import JobModel
from goodput.errors import ValidationError
from goodput.gp import HyperPrior
from goodput.hierarchy import ClusterPrior
from goodput.model import Prediction
from goodput.tails import DEFAULT_NOISE_DOF, fit_noise_dof, gaussian_t_cdf, gaussian_t_quantile
from tests import hierarchy_jobs as hj


@pytest.mark.parametrize("dof", [2.5, 3.3, 6.0, 30.0])
@pytest.mark.parametrize("q", [0.05, 0.75, 0.95, 0.995])
def test_the_quantile_is_the_students_without_a_gaussian_part(dof, q):
    assert gaussian_t_quantile(0.0, 0.2, dof, q) == pytest.approx(0.2 * stats.t.ppf(q, dof), rel=2e-4)


def test_the_quantile_is_the_normals_without_tails():
    assert gaussian_t_quantile(0.3, 0.0, 4.0, 0.95) == pytest.approx(0.3 * stats.norm.ppf(0.95), rel=1e-6)
    both = gaussian_t_quantile(np.array([0.3, 0.1]), np.array([0.4, 0.0]), math.inf, 0.95)
    np.testing.assert_allclose(both, stats.norm.ppf(0.95) * np.array([0.5, 0.1]))


def test_the_quantile_of_the_sum_matches_sampling():
    rng = np.random.default_rng(3)
    draws = 0.1 * rng.standard_normal(1_000_000) + 0.05 * rng.standard_t(3.0, 1_000_000)
    for q in (0.05, 0.5, 0.9, 0.99):
        assert gaussian_t_quantile(0.1, 0.05, 3.0, q) == pytest.approx(np.quantile(draws, q), abs=2e-3)
    x = np.array([-0.4, -0.1, 0.0, 0.2, 0.5])
    np.testing.assert_allclose(gaussian_t_cdf(x, 0.1, 0.05, 3.0), (draws[:, None] <= x).mean(axis=0), atol=2e-3)
    for g, s in ((0.1, 0.05), (0.05, 0.1), (0.0, 0.1)):  # the distribution function inverts the quantile
        assert gaussian_t_cdf(gaussian_t_quantile(g, s, 4.0, 0.97), g, s, 4.0) == pytest.approx(0.97, abs=1e-5)
    assert gaussian_t_cdf(0.1, 0.1, 0.05, math.inf) == pytest.approx(stats.norm.cdf(0.1 / math.hypot(0.1, 0.05)))
    for dof in (3.0, math.inf):  # a point mass at 0, without warnings
        np.testing.assert_array_equal(gaussian_t_cdf(np.array([-1.0, 0.0, 1.0]), 0.0, 0.0, dof), [0.0, 1.0, 1.0])


def test_far_quantiles_of_heavy_tails_are_found():
    """A bracket of [0, 100] for the standardised quantile had failed with scipy's 'f(a) and f(b) must have
    different signs' at the fitted dof's lower bound (2.5) and levels near 1, and at dof 1."""
    for dof, q in ((2.5, 0.99999), (1.0, 0.999)):
        x = gaussian_t_quantile(0.01, 1.0, dof, q)
        assert x > 50 and gaussian_t_cdf(x, 0.01, 1.0, dof) == pytest.approx(q, abs=1e-6)
    low, high = Prediction(step_time=1.0, std=1.0, throughput=1.0, log_std=0.2, noise_log_std=0.2,
                           noise_dof=2.5).interval(0.99999)
    assert 0 < low < 1 < high and low * high == pytest.approx(1.0)



@pytest.mark.parametrize("dof, ratio", [(2.5, 1.5), (6.0, 3.0)])
def test_far_tails_where_the_normal_part_dominates_stay_within_a_factor_of_two(dof, ratio):
    """Where the normal part weighs more, the distribution function integrates over the t's quantiles, whose nodes
    end about 1e-5 into either tail: a true tail of 1e-5 had read 6e-126 (a surprise's z 23.8 for 4.27; found in
    review). The bound P(X ≤ −a) ≥ ½·max(P(s·t ≤ −a), P(g ≤ −a)) now stands in there, within a factor 5 and 0.3 of
    z. Against direct integration."""
    from scipy import integrate, optimize

    def exact(x):
        return integrate.quad(lambda z: stats.norm.pdf(z) * stats.t.cdf((x - ratio * z), dof), -40, 40,
                              epsabs=1e-15, epsrel=1e-12, limit=400, points=[0.0, x / ratio])[0]

    for tail in (1e-4, 1e-5, 1e-6):
        x = optimize.brentq(lambda v: exact(v) - tail, -1e4, 0.0, xtol=1e-10)
        code = gaussian_t_cdf(x, ratio, 1.0, dof)
        assert 0.2 * tail < code < 1.3 * tail
        assert stats.norm.isf(code) - stats.norm.isf(tail) < 0.3  # a surprise's z
        assert 1.0 - gaussian_t_cdf(-x, ratio, 1.0, dof) == pytest.approx(gaussian_t_cdf(x, ratio, 1.0, dof), rel=1e-9)

def test_the_quantile_rejects_bad_input():
    with pytest.raises(ValueError, match="gaussian_std"):
        gaussian_t_quantile(-0.1, 0.1, 3.0, 0.9)
    with pytest.raises(ValueError):
        gaussian_t_quantile(0.1, 0.1, 3.0, 1.5)
    with pytest.raises(ValueError):
        gaussian_t_quantile(0.1, 0.1, -3.0, 0.9)


@pytest.mark.parametrize("dof", [3.0, 6.0])
def test_the_degrees_of_freedom_are_recovered_from_groups_of_different_scales(dof):
    rng = np.random.default_rng(int(dof))
    groups = [scale * rng.standard_t(dof, 1500) for scale in (0.01, 0.05, 0.2)]
    assert fit_noise_dof(groups) == pytest.approx(dof, rel=0.3)


def test_gaussian_residuals_read_as_gaussian_and_too_few_as_the_default():
    rng = np.random.default_rng(0)
    assert math.isinf(fit_noise_dof([0.05 * rng.standard_normal(3000), 0.2 * rng.standard_normal(3000)]))
    assert math.isinf(fit_noise_dof([0.05 * rng.standard_t(2.5, 40)]))  # fewer than MIN_RESIDUALS: the default
    assert fit_noise_dof([0.05 * rng.standard_t(2.5, 40)], default=DEFAULT_NOISE_DOF) == DEFAULT_NOISE_DOF
    # groups too small for their own scale are left out, whatever they hold
    heavy = [0.05 * rng.standard_t(3.0, 3000)]
    assert fit_noise_dof(heavy + [np.array([0.0, 5.0, -5.0])]) == fit_noise_dof(heavy)
    with pytest.raises(ValueError, match=r"residuals\[1\]"):
        fit_noise_dof([np.zeros(10), np.array([0.1, np.nan] * 5)])


def test_the_hyper_prior_carries_the_degrees_of_freedom():
    assert math.isinf(HyperPrior((2.0,) * 6, 0.004, 0.002).noise_dof)
    heavy = HyperPrior((2.0,) * 6, 0.004, 0.002, noise_dof=3.3)
    assert HyperPrior.from_dict(heavy.to_dict()) == heavy
    gaussian = HyperPrior((2.0,) * 6, 0.004, 0.002)
    assert gaussian.to_dict()["noise_dof"] is None  # JSON has no infinity
    assert HyperPrior.from_dict(gaussian.to_dict()) == gaussian
    assert HyperPrior((2.0,) * 6, 0.004, 0.002, noise_dof=np.float64(4.0)).noise_dof == 4.0  # numpy numbers, ints
    assert HyperPrior((2.0,) * 6, 0.004, 0.002, noise_dof=np.int64(5)).noise_dof == 5.0
    older = {k: v for k, v in heavy.to_dict().items() if k != "noise_dof"}
    assert math.isinf(HyperPrior.from_dict(older).noise_dof)
    for bad in (2.0, 0.5, -1.0, math.nan, "3", True):
        with pytest.raises(ValidationError, match="noise_dof"):
            HyperPrior((2.0,) * 6, 0.004, 0.002, noise_dof=bad)


def test_student_t_noise_widens_the_tails_of_an_interval_not_its_middle():
    gaussian = Prediction(1.0, 0.1, 1.0, 0.1)
    heavy = Prediction(1.0, 0.1, 1.0, 0.1, noise_log_std=0.08, noise_dof=3.0)
    assert gaussian.interval(0.9) == pytest.approx((math.exp(-0.1 * stats.norm.ppf(0.95)), math.exp(0.1 * stats.norm.ppf(0.95))))
    widening = [math.log(heavy.interval(level)[1]) / math.log(gaussian.interval(level)[1]) for level in (0.5, 0.9, 0.99)]
    assert 1.0 < widening[0] < widening[1] < widening[2]  # the noise's scale is the core's: the tails widen most
    # Gaussian noise, or none: the normal interval
    assert Prediction(1.0, 0.1, 1.0, 0.1, 0.08, math.inf).interval(0.9) == pytest.approx(gaussian.interval(0.9))
    low, high = Prediction(np.ones(3), 0.1, 1.0, np.array([0.1, 0.05, 0.0]), 0.08, 3.0).interval(0.9)
    assert low.shape == (3,) and high[2] == pytest.approx(1.0) and high[0] > high[1] > 1.0


@pytest.fixture(scope="module")
def heavy_cluster():
    rng = np.random.default_rng(11)
    out = {}
    for j in range(3):
        truth = hj.draw_job(rng)
        out[f"job{j}"] = [o for t in hj.TYPES[:2] for o in hj.observe(f"job{j}", t, truth[t], hj.SINGLE + hj.SINGLE_NODE + hj.MULTI_NODE,
                                                                     rng, bszs=tuple(range(8, 136, 4)), noise_dof=3.0)]
    return out


def test_a_cluster_learns_its_noise_tails_and_a_jobs_intervals_take_them(heavy_cluster):
    prior = ClusterPrior.from_observations({k: v for k, v in heavy_cluster.items() if k != "job0"})
    assert 2.5 <= prior.gp_prior.noise_dof < 6.0
    assert ClusterPrior.from_dict(prior.to_dict()).gp_prior.noise_dof == pytest.approx(prior.gp_prior.noise_dof)
    model = JobModel("job0", init_batch_size=32, cluster_prior=prior)
    model.observe(heavy_cluster["job0"][:40])
    p = model.predict("t4", 2, 8, 32)
    assert p.noise_dof == prior.gp_prior.noise_dof and 0 < p.noise_log_std <= p.log_std
    gaussian = Prediction(p.step_time, p.std, p.throughput, p.log_std)
    assert p.interval(0.9)[1] > gaussian.interval(0.9)[1]
    # without a cluster: the default's tails (goodput.tails.DEFAULT_NOISE_DOF); with Gaussian noise on it: normal intervals
    alone = JobModel("job0", init_batch_size=32)
    alone.observe(heavy_cluster["job0"][:40])
    assert alone.predict("t4", 2, 8, 32).noise_dof == DEFAULT_NOISE_DOF
    smooth = JobModel("job0", init_batch_size=32, cluster_prior=_smooth_cluster())
    smooth.observe(heavy_cluster["job0"][:40])
    assert math.isinf(smooth.cluster_prior.gp_prior.noise_dof) and math.isinf(smooth.predict("t4", 2, 8, 32).noise_dof)


def _smooth_cluster() -> ClusterPrior:
    """Two jobs with Gaussian noise: the cluster's tails are normal."""
    rng = np.random.default_rng(5)
    smooth = {f"g{j}": hj.observe(f"g{j}", "t4", hj.draw_job(rng)["t4"], hj.SINGLE + hj.SINGLE_NODE + hj.MULTI_NODE, rng,
                                  bszs=tuple(range(8, 136, 4))) for j in range(2)}
    return ClusterPrior.from_observations(smooth)


def test_an_outlier_the_noises_tails_expect_is_less_of_a_surprise(heavy_cluster):
    prior = ClusterPrior.from_observations({k: v for k, v in heavy_cluster.items() if k != "job0"})
    model = JobModel("job0", init_batch_size=32, cluster_prior=prior)
    model.observe(heavy_cluster["job0"][:40])
    state = model._current()
    noise, dof = state.noise_tails()
    var = np.full(3, 2.0 * noise**2)  # half the variance is the noise's
    residual = np.array([0.5, 4.0, 8.0]) * math.sqrt(2.0) * noise  # 0.5, 4 and 8 standard deviations out
    z = state.normal_z(residual, var)
    gaussian = np.abs(residual) / np.sqrt(var)
    assert z[0] == pytest.approx(gaussian[0], rel=0.3)  # the core: about the normal's
    assert z[1] < gaussian[1] and z[2] < gaussian[2] and z[1] < z[2]  # the tails: expected, still ordered
    # the same under the normal z the interval gives: 90% inside ±z = Φ⁻¹(0.95)
    p = model.predict("t4", 2, 8, 32)
    high = math.log(p.interval(0.9)[1] / p.step_time)
    assert state.normal_z(np.array([high]), np.array([p.log_std**2]))[0] == pytest.approx(stats.norm.ppf(0.95), rel=1e-3)
    smooth = JobModel("job0", init_batch_size=32, cluster_prior=_smooth_cluster())  # Gaussian noise: the normal's z
    smooth.observe(heavy_cluster["job0"][:40])
    np.testing.assert_allclose(smooth._current().normal_z(residual, var), gaussian)


def test_a_cluster_too_small_for_a_gp_prior_has_none_and_the_default_tails():
    rng = np.random.default_rng(4)
    tiny = {"job0": hj.observe("job0", "t4", hj.draw_job(rng)["t4"], hj.SINGLE + hj.SINGLE_NODE[:1], rng, bszs=(8, 32))}
    assert len(tiny["job0"]) < 8  # fewer than the shared fit needs
    prior = ClusterPrior.from_observations(tiny)
    assert prior.gp_prior is None and len(prior) == 1
    model = JobModel("new", init_batch_size=32, cluster_prior=prior)
    model.observe([replace(o, job="new") for o in tiny["job0"]])
    assert model.predict("t4", 1, 2, 32).noise_dof == DEFAULT_NOISE_DOF


def test_a_cluster_with_too_few_residuals_to_tell_its_tails_keeps_the_default_ones():
    """Enough steps for the GP's shared hyperparameters, too few (< MIN_RESIDUALS) for the tails: the default's,
    as a job without a cluster has, not Gaussian noise."""
    rng = np.random.default_rng(6)
    small = {f"s{j}": hj.observe(f"s{j}", "t4", hj.draw_job(rng)["t4"], hj.SINGLE + hj.SINGLE_NODE, rng, bszs=(8, 16, 32, 64))
             for j in range(3)}
    assert sum(len(v) for v in small.values()) < 50
    prior = ClusterPrior.from_observations(small)
    assert prior.gp_prior is not None and prior.gp_prior.noise_dof == DEFAULT_NOISE_DOF


def test_small_groups_do_not_read_as_lighter_tailed_than_they_are():
    """Groups of 12 residuals, each with its own scale, drawn with ν = 5: the scales fitted to a dozen residuals
    each had made the plain profile likelihood read them as nearly Gaussian (median 26 over these seeds);
    the modified profile (Cox & Reid 1987) reads them near 5."""
    estimates = []
    for seed in range(8):
        rng = np.random.default_rng(100 + seed)
        groups = [rng.uniform(0.02, 0.2) * rng.standard_t(5.0, 12) for _ in range(50)]
        estimates.append(fit_noise_dof(groups))
    assert 3.5 < np.median(estimates) < 8.0, estimates
    assert all(e < 30 for e in estimates), estimates
