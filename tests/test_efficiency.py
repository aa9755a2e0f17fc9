"""Statistical efficiency and the gradient-noise estimators."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from goodput import ValidationError
from goodput.efficiency import (
    GRAD_SQR_FLOOR,
    GradientNoiseTracker,
    describe_noise_scale,
    efficiency,
    noise_scale,
    two_batch_estimates,
)


def test_efficiency_by_hand():
    # φ = 128 · 3 / 1 = 384; E(512) = (384 + 128) / (384 + 512)
    assert efficiency(1.0, 3.0, 128, 512) == pytest.approx(512 / 896)
    assert efficiency(1.0, 3.0, 128, 128) == pytest.approx(1.0)
    assert noise_scale(2.0, 1.0, 100) == pytest.approx(50.0)
    # no noise: every extra sample is wasted, E = M0/M
    assert efficiency(1.0, 0.0, 100, 400) == pytest.approx(0.25)
    out = efficiency(1.0, 3.0, 128, np.array([128, 256, 512]))
    assert out.shape == (3,) and np.all(np.diff(out) < 0)


@given(
    grad_sqr=st.floats(1e-8, 1e8),
    grad_var=st.floats(0, 1e8),
    m0=st.integers(1, 4096),
    scale=st.floats(1, 1000),
)
def test_property_efficiency_in_unit_interval_and_decreasing(grad_sqr, grad_var, m0, scale):
    m = m0 * scale
    e = efficiency(grad_sqr, grad_var, m0, m)
    assert 0 < e <= 1
    assert efficiency(grad_sqr, grad_var, m0, m * 2) <= e


@pytest.mark.parametrize(
    "args, field",
    [
        ((0.0, 1.0, 128, 256), "grad_sqr"),
        ((-1.0, 1.0, 128, 256), "grad_sqr"),
        ((1.0, -1.0, 128, 256), "grad_var"),
        ((1.0, float("nan"), 128, 256), "grad_var"),
        ((1.0, 1.0, 0, 256), "init_batch_size"),
        ((1.0, 1.0, 128, 64), "batch_size"),
        ((1.0, 1.0, 128, float("inf")), "batch_size"),
    ],
)
def test_efficiency_validates(args, field):
    with pytest.raises(ValidationError) as info:
        efficiency(*args)
    assert info.value.field == field


def simulate_micro_batches(rng, true_grad, cov_sqrt, micro_bsz, count):
    """Gradients of `count` micro-batches of `micro_bsz` samples: per-sample noise N(0, Σ)."""
    d = true_grad.size
    noise = rng.standard_normal((count, micro_bsz, d)) @ cov_sqrt.T
    return true_grad + noise.mean(axis=1)


def test_micro_batch_estimator_is_unbiased():
    rng = np.random.default_rng(0)
    d = 50
    true_grad = rng.normal(0, 0.2, d)
    cov_sqrt = np.diag(rng.uniform(0.5, 2.0, d))
    trace = float(np.sum(np.diag(cov_sqrt) ** 2))
    m0 = 32
    tracker = GradientNoiseTracker(init_batch_size=m0, smoothing=0.999)
    for _ in range(2000):
        grads = simulate_micro_batches(rng, true_grad, cov_sqrt, micro_bsz=16, count=4)
        tracker.update_micro_batches((grads**2).sum(axis=1), float((grads.mean(axis=0) ** 2).sum()), micro_bsz=16)
    assert tracker.grad_sqr == pytest.approx(float(true_grad @ true_grad), rel=0.08)
    assert tracker.grad_var == pytest.approx(trace / m0, rel=0.05)
    phi = m0 * (trace / m0) / float(true_grad @ true_grad)
    assert tracker.noise_scale == pytest.approx(phi, rel=0.1)
    assert tracker.efficiency(4 * m0) == pytest.approx((phi + m0) / (phi + 4 * m0), rel=0.05)


def test_two_batch_estimator_matches_mccandlish_by_hand():
    # |G_b|² = |g|² + tr(Σ)/b exactly: |g|² = 2, tr(Σ) = 64
    g2, tr = two_batch_estimates(2 + 64 / 8, 8, 2 + 64 / 64, 64)
    assert float(g2) == pytest.approx(2.0)
    assert float(tr) == pytest.approx(64.0)
    with pytest.raises(ValidationError) as info:
        two_batch_estimates(1.0, 64, 1.0, 8)
    assert info.value.field == "batch_large"
    with pytest.raises(ValidationError) as info:
        two_batch_estimates(1.0, 0, 1.0, 8)
    assert info.value.field == "batch_small"
    for args, field in (((1.0, float("nan"), 1.0, 4.0), "batch_small"), ((1.0, 2.0, 1.0, float("inf")), "batch_large")):
        with pytest.raises(ValidationError) as info:  # NaN had passed both comparisons: (nan, nan) returned
            two_batch_estimates(*args)
        assert info.value.field == field
    with pytest.raises(ValidationError, match="batch_large"):  # had blamed grad_sqr
        GradientNoiseTracker(8).update_two_batches(1.0, 2.0, 1.0, float("inf"))


def test_bias_correction_makes_a_single_update_exact():
    tracker = GradientNoiseTracker(init_batch_size=10, smoothing=0.999)
    tracker.update(grad_sqr=4.0, trace_cov=20.0, batch_size=10)
    assert tracker.grad_sqr == pytest.approx(4.0)
    assert tracker.grad_var == pytest.approx(2.0)


def test_tracker_floors_negative_estimates_and_requires_data():
    tracker = GradientNoiseTracker(init_batch_size=10)
    with pytest.raises(ValidationError):
        _ = tracker.grad_sqr
    tracker.update(grad_sqr=-1.0, trace_cov=-5.0, batch_size=10)
    assert tracker.grad_sqr > 0 and tracker.grad_var == 0.0
    with pytest.raises(ValidationError, match="smoothing"):
        GradientNoiseTracker(10, smoothing=1.0)
    with pytest.raises(ValidationError, match="micro_sqr_norms"):
        tracker.update_micro_batches([1.0], 1.0, 4)


def test_tracker_state_round_trip():
    tracker = GradientNoiseTracker(init_batch_size=10)
    tracker.update(3.0, 7.0, 20)
    clone = GradientNoiseTracker(init_batch_size=10)
    clone.load_state_dict(tracker.state_dict())
    assert (clone.grad_sqr, clone.grad_var, clone.updates) == (tracker.grad_sqr, tracker.grad_var, 1)


def test_an_unresolved_gradient_says_so_instead_of_printing_the_floor():
    # two micro-batch gradients whose average is smaller than pure noise allows: the |g|² estimate is below 0
    tracker = GradientNoiseTracker(init_batch_size=64)
    tracker.update_micro_batches([1.0, 1.0], total_sqr_norm=0.4, micro_bsz=32)
    assert tracker.grad_sqr == GRAD_SQR_FLOOR and tracker.noise_scale > 1e30
    assert describe_noise_scale(tracker.grad_sqr, tracker.grad_var, 64) == "unresolved (|g|² ≤ 0)"
    assert tracker.efficiency(4096) == pytest.approx(1.0)  # what the floor means for goodput
    tracker.update_micro_batches([1.0, 1.0], total_sqr_norm=0.9, micro_bsz=32)  # signal arrives
    assert tracker.grad_sqr > GRAD_SQR_FLOOR
    assert describe_noise_scale(tracker.grad_sqr, tracker.grad_var, 64) == f"{tracker.noise_scale:.3g}"
