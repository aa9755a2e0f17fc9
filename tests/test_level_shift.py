"""Changes of a job's speed in time (goodput.shifts): the steps before a change are read at the current speed.

A job whose every step became slower from some moment on is predicted at its new speed once a few steps
show it; without a change, or without timestamps, the model is the exchangeable one.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from goodput import JobModel, Observation, ValidationError
from goodput.hierarchy import ClusterPrior
from goodput.shifts import MIN_REGIME_POINTS, SHIFT_PRIOR_ODDS, SHIFT_STD, LevelShift, at_current_speed, find_level_shift
from tests.hierarchy_jobs import MULTI_NODE, SINGLE, SINGLE_NODE, TYPES, cluster, draw_job, observe, true_log_step

CONFIGS = SINGLE + SINGLE_NODE + MULTI_NODE


@pytest.fixture(scope="module")
def cluster_prior() -> ClusterPrior:
    return ClusterPrior.from_observations(cluster(6, seed=3))


def _stamped(observations: list[Observation], start: float = 0.0) -> list[Observation]:
    return [dataclasses.replace(o, timestamp=start + k) for k, o in enumerate(observations)]


def _slowed(observations: list[Observation], factor: float, start: float) -> list[Observation]:
    return [dataclasses.replace(o, step_time=o.step_time * factor, timestamp=start + k) for k, o in enumerate(observations)]


def _job(seed: int) -> tuple[np.ndarray, list[Observation], np.random.Generator]:
    """A job's true coordinates on T4 and its steps there (every configuration, in random order, timestamped)."""
    rng = np.random.default_rng(seed)
    truth = draw_job(rng)["t4"]
    steps = observe("new", "t4", truth, CONFIGS, rng)
    steps = [steps[i] for i in rng.permutation(len(steps))]
    return truth, _stamped(steps), rng


def _ratio(model: JobModel, truth: np.ndarray, factor: float) -> np.ndarray:
    """Predicted over true step time at the job's current speed, every configuration."""
    nodes, replicas, bsz = zip(*[(n, r, b) for n, r in CONFIGS for b in (8, 32, 128)])
    predicted = model.predict("t4", np.array(nodes), np.array(replicas), np.array(bsz)).step_time
    return np.asarray(predicted) / (factor * np.exp(true_log_step(truth, CONFIGS)))


def _dense_log_bayes(cov: np.ndarray, y: np.ndarray, old: np.ndarray) -> tuple[float, float]:
    """log p(y | shift of the old points) − log p(y | none), and δ's posterior mean, by dense algebra."""
    b = old.astype(float)
    alt = cov + SHIFT_STD**2 * np.outer(b, b)

    def log_density(c: np.ndarray) -> float:
        return float(-0.5 * y @ np.linalg.solve(c, y) - 0.5 * np.linalg.slogdet(c)[1])
    delta = SHIFT_STD**2 * b @ np.linalg.solve(alt, y)  # E[δ | y] = s² bᵀ (C + s² b bᵀ)⁻¹ y
    return log_density(alt) - log_density(cov), float(delta)


def test_the_scan_is_the_dense_bayes_factor_averaged_over_the_moments_a_change_can_come():
    rng = np.random.default_rng(0)
    n = 14
    root = rng.standard_normal((n, n))
    cov = 0.01 * (root @ root.T / n + np.eye(n))
    stamps = rng.permutation(n).astype(float)
    y = rng.multivariate_normal(np.zeros(n), cov) + np.where(stamps < 8, 0.3, 0.0)  # the first 8 steps 0.3 slower
    configs = ["a", "b"] * (n // 2)  # both configurations on both sides of every boundary
    shift = find_level_shift(np.linalg.cholesky(cov), np.linalg.solve(cov, y), stamps, configs)
    assert isinstance(shift, LevelShift)
    bounds = np.arange(MIN_REGIME_POINTS, n - MIN_REGIME_POINTS + 1)  # old: the first k points in time
    dense = [_dense_log_bayes(cov, y, stamps < k) for k in bounds]
    log_bayes = np.array([d[0] for d in dense])
    expected = math.log(SHIFT_PRIOR_ODDS) + np.log(np.mean(np.exp(log_bayes)))
    assert shift.log_odds == pytest.approx(expected, rel=1e-9)
    best = int(np.argmax(log_bayes))
    assert shift.at == bounds[best]
    posterior = np.exp(log_bayes - log_bayes.max())
    posterior /= posterior.sum()
    deltas = np.array([d[1] for d in dense])
    assert math.log(shift.factor) == pytest.approx(posterior @ deltas, rel=1e-9)  # δ averaged over the moments
    for when in (0.0, 4.0, 7.5, 13.0):  # a step's offset: over the moments after it
        assert shift.log_offset(when) == pytest.approx(posterior[bounds > when] @ deltas[bounds > when], rel=1e-9, abs=1e-12)
    forced = find_level_shift(np.linalg.cholesky(cov), np.linalg.solve(cov, y), stamps, configs, at=5.0)
    assert forced is not None and forced.at == 5.0
    assert math.log(forced.factor) == pytest.approx(_dense_log_bayes(cov, y, stamps < 5)[1], rel=1e-9)


def test_no_change_is_read_without_timestamps_too_few_steps_or_a_configuration_on_both_sides():
    n = 10
    cov = 0.01 * np.eye(n)
    stamps = np.arange(n, dtype=float)
    y = np.where(stamps < 5, 0.5, 0.0)  # a plain change: 0.5 in log
    chol, alpha = np.linalg.cholesky(cov), np.linalg.solve(cov, y)
    assert find_level_shift(chol, alpha, stamps, ["a"] * n) is not None
    assert find_level_shift(chol, alpha, np.where(stamps == 3, np.nan, stamps), ["a"] * n) is None  # a step without a time
    assert find_level_shift(chol[:5, :5], alpha[:5], stamps[:5], ["a"] * 5) is None  # fewer than two regimes' worth
    # the configurations before and after differ: a change cannot be told from what they differ by
    assert find_level_shift(chol, alpha, stamps, [f"c{k}" for k in range(n)]) is None
    # one step far off at the end is the noise's to explain, not a change
    assert find_level_shift(chol, np.linalg.solve(cov, np.where(stamps == 9, 0.5, 0.0)), stamps, ["a"] * n) is None


def test_a_job_that_became_slower_is_predicted_at_its_new_speed(cluster_prior):
    truth, steps, rng = _job(1)
    late = _slowed([steps[i] for i in rng.choice(len(steps), 10)], 1.5, start=len(steps))
    with_shifts = JobModel("new", 32, cluster_prior=cluster_prior).observe(steps + late)
    plain = JobModel("new", 32, cluster_prior=cluster_prior, level_shifts=False).observe(steps + late)
    assert abs(np.median(_ratio(with_shifts, truth, 1.5)) - 1.0) < 0.05
    assert np.median(_ratio(plain, truth, 1.5)) < 0.8  # the steps before the change hold it near the old speed
    (shift,) = with_shifts.level_shifts_found
    assert shift.at == len(steps) and shift.factor == pytest.approx(1 / 1.5, rel=0.05) and shift.log_odds > 0
    assert plain.level_shifts_found == ()
    assert with_shifts.diagnostics["level_shifts"] == [shift.to_dict()]
    assert with_shifts.observations[0].step_time == steps[0].step_time  # the stored steps stay as measured


@pytest.mark.parametrize("seed", range(6))
def test_a_job_whose_speed_did_not_change_reads_no_change(cluster_prior, seed):
    _, steps, rng = _job(10 + seed)
    again = _stamped([steps[i] for i in rng.choice(len(steps), 10)], start=len(steps))
    fresh = [dataclasses.replace(o, step_time=o.step_time * math.exp(0.03 * rng.standard_normal())) for o in again]
    model = JobModel("new", 32, cluster_prior=cluster_prior).observe(steps + fresh)
    assert model.level_shifts_found == ()
    plain = JobModel("new", 32, cluster_prior=cluster_prior, level_shifts=False).observe(steps + fresh)
    np.testing.assert_array_equal(model.predict("t4", 2, 8, 32).step_time, plain.predict("t4", 2, 8, 32).step_time)


def test_online_the_model_follows_a_change_within_a_few_steps(cluster_prior):
    truth, steps, rng = _job(2)
    model = JobModel("new", 32, cluster_prior=cluster_prior).observe(steps)
    late = _slowed([steps[i] for i in rng.choice(len(steps), 10)], 1.4, start=len(steps))
    ratios = []
    for step in late:
        model.observe(step)
        ratios.append(float(np.median(_ratio(model, truth, 1.4))))
    assert ratios[0] < 0.8  # one slow step is an outlier of the old speed
    assert abs(ratios[-1] - 1.0) < 0.05
    assert model.level_shifts_found and model.level_shifts_found[-1].at == len(steps)


def test_three_stalled_steps_in_a_row_are_outliers_not_a_change(cluster_prior):
    """The synthetic cluster's noise is near-Gaussian (ν ≈ 36): read with it, two stalls among the last three steps
    had been a change to 3x the speed; the change test reads the steps with at least Pollux's tails."""
    truth, steps, rng = _job(4)
    model = JobModel("new", 32, cluster_prior=cluster_prior).observe(steps)
    plain = JobModel("new", 32, cluster_prior=cluster_prior, level_shifts=False).observe(steps)
    stalled = _slowed([steps[i] for i in rng.choice(len(steps), 3)], 5.0, start=len(steps))  # a checkpoint's
    for step in stalled:
        model.observe(step)
        plain.observe(step)
        np.testing.assert_array_equal(_ratio(model, truth, 1.0), _ratio(plain, truth, 1.0))
        assert model.level_shifts_found == ()


def test_steps_without_timestamps_are_exchangeable(cluster_prior):
    truth, steps, rng = _job(3)
    late = _slowed([steps[i] for i in rng.choice(len(steps), 10)], 1.5, start=len(steps))
    untimed = [dataclasses.replace(o, timestamp=None) for o in steps + late]
    model = JobModel("new", 32, cluster_prior=cluster_prior).observe(untimed)
    assert model.level_shifts_found == ()


def test_the_steps_before_a_change_are_rescaled_and_the_rest_kept():
    before = Observation("j", "t4", 1, 2, 32, step_time=0.3, sync_time=0.06, step_time_std=0.03, timestamp=1.0)
    after = dataclasses.replace(before, timestamp=5.0)
    untimed = dataclasses.replace(before, timestamp=None)
    tiny = dataclasses.replace(before, step_time=1.2e-9, sync_time=None, step_time_std=None)  # rescaled: shorter than a step can be
    out = at_current_speed({"t4": [before, after, untimed, tiny]}, LevelShift(at=5.0, factor=1.5, log_odds=3.0))["t4"]
    assert out[0].step_time == pytest.approx(0.2) and out[0].sync_time == pytest.approx(0.04)
    assert out[0].step_time_std == pytest.approx(0.02)
    assert out[1:] == [after, untimed, tiny]


def test_level_shifts_is_a_flag(cluster_prior):
    with pytest.raises(ValidationError, match="level_shifts"):
        JobModel("new", 32, level_shifts="no")
    assert TYPES  # the synthetic cluster's types exist (the fixture's jobs run on them)


@pytest.mark.parametrize("signs, due", [((1, 1, 1, 1), True), ((1, -1, 1, -1), False)])
def test_steps_surprising_together_call_for_a_refit_though_none_alone(cluster_prior, signs, due):
    """Each step 2.2 predictive stds off, none beyond ``surprise`` alone: four on one side are a z-test's
    surprise (a change whose steps each weigh as outliers of the old speed), four alternating are not."""
    _, steps, _ = _job(5)
    model = JobModel("new", 32, cluster_prior=cluster_prior).observe(steps)
    flags = []
    for k, sign in enumerate(signs):
        nodes, replicas = CONFIGS[k + 1]
        p = model.predict("t4", nodes, replicas, 32)
        model.observe(Observation("new", "t4", nodes, replicas, 32, step_time=float(p.step_time) * math.exp(sign * 2.2 * float(p.log_std)),
                                  timestamp=100.0 + k))
        assert model.last_z < model.surprise
        flags.append(model._refit_due)
    assert not flags[0] and any(flags) == due
