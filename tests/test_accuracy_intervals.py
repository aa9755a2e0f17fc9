"""Cluster-bootstrap intervals of the accuracy figures (experiments/accuracy_intervals.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.accuracy import markdown, summarize
from experiments.accuracy_intervals import cluster_bootstrap


def test_identical_units_give_a_point_interval():
    # every unit holds the same rows: any resample has the same median and coverage
    ape = np.tile([1.0, 5.0, 9.0], 4)
    covered = np.tile([True, True, False], 4)
    units = np.repeat(np.arange(4), 3)
    ci = cluster_bootstrap(ape, covered, units, resamples=300)
    assert ci.median_ape_low == ci.median_ape_high == 5.0
    assert ci.coverage_low == pytest.approx(200 / 3) and ci.coverage_high == pytest.approx(200 / 3)
    assert ci.units == 4


def test_resampled_median_is_numpys_median_of_the_repeated_rows():
    # two rows per unit, identical units: every resample's median is np.median of the rows (the mean of the middle two)
    ci = cluster_bootstrap(np.tile([1.0, 2.0], 5), None, np.repeat(np.arange(5), 2), resamples=50)
    assert ci.median_ape_low == ci.median_ape_high == 1.5


def test_too_few_units_give_no_interval():
    # one (model, type) cell resamples to itself: a zero-width interval would claim a certainty the data lack
    for units in ([0] * 6, [0, 0, 0, 1, 1, 1]):
        ci = cluster_bootstrap(np.arange(6.0), np.ones(6, bool), units)
        assert np.isnan([ci.median_ape_low, ci.median_ape_high, ci.coverage_low, ci.coverage_high]).all()
        assert ci.units == len(set(units))


def test_interval_brackets_the_estimate_and_is_reproducible():
    rng = np.random.default_rng(1)
    units = np.repeat(np.arange(20), 30)
    ape = np.abs(rng.normal(0, 1, 20)[units] + rng.normal(0, 0.5, units.size)) * 10
    covered = rng.random(units.size) < 0.9
    a = cluster_bootstrap(ape, covered, units, seed=3)
    b = cluster_bootstrap(ape, covered, units, seed=3)
    assert a == b
    assert a.median_ape_low < np.median(ape) < a.median_ape_high
    assert a.coverage_low < 100 * covered.mean() < a.coverage_high


def test_clustered_errors_widen_the_interval():
    """The same rows read as 600 independent units give a far narrower interval than as 6 clusters."""
    rng = np.random.default_rng(0)
    clusters = np.repeat(np.arange(6), 100)
    shift = np.array([0.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # whole cells covered or missed together
    covered = (rng.random(600) < 0.5 + 0.45 * shift[clusters])
    ape = rng.exponential(5.0, 600) * (1 + shift[clusters])
    clustered = cluster_bootstrap(ape, covered, clusters, resamples=500)
    independent = cluster_bootstrap(ape, covered, np.arange(600), resamples=500)
    width = lambda ci: ci.coverage_high - ci.coverage_low  # noqa: E731
    assert width(clustered) > 3 * width(independent)
    assert clustered.median_ape_high - clustered.median_ape_low > 2 * (independent.median_ape_high - independent.median_ape_low)


def test_binomial_coverage_interval_is_about_right_for_independent_rows():
    # 400 independent rows covered with p = 0.9: the percentile interval is close to ±1.96·√(p(1-p)/n) ≈ ±2.9 points
    rng = np.random.default_rng(5)
    covered = rng.random(400) < 0.9
    ci = cluster_bootstrap(np.ones(400), covered, np.arange(400), resamples=2000)
    assert ci.coverage_high - ci.coverage_low == pytest.approx(2 * 1.96 * np.sqrt(0.09 / 400) * 100, rel=0.15)


def test_no_intervals_give_nan_coverage():
    ci = cluster_bootstrap([1.0, 2.0, 3.0, 4.0], None, ["a", "b", "c", "d"], resamples=50)
    assert np.isnan(ci.coverage_low) and np.isnan(ci.coverage_high) and ci.median_ape_low <= ci.median_ape_high


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(ape=[], covered=None, units=[]), "ape"),
        (dict(ape=[1.0, 2.0], covered=None, units=[0]), "units"),
        (dict(ape=[1.0, 2.0], covered=[True], units=[0, 1]), "covered"),
        (dict(ape=[1.0], covered=None, units=[0], resamples=0), "resamples"),
        (dict(ape=[1.0], covered=None, units=[0], confidence=1.0), "confidence"),
    ],
)
def test_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        cluster_bootstrap(**kwargs)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.booleans(), st.integers(0, 5)), min_size=1, max_size=40))
def test_interval_stays_within_the_data(rows):
    ape, covered, units = (np.array(c) for c in zip(*rows))
    ci = cluster_bootstrap(ape, covered, units, resamples=100)
    if ci.units < 3:
        assert np.isnan(ci.median_ape_low)
        return
    assert ape.min() <= ci.median_ape_low <= ci.median_ape_high <= ape.max()
    assert 0.0 <= ci.coverage_low <= ci.coverage_high <= 100.0


def test_summary_and_markdown_carry_the_intervals():
    rng = np.random.default_rng(2)
    n = 240
    actual = rng.uniform(0.1, 1.0, n)
    predicted = actual * np.exp(rng.normal(0, 0.1, n))
    rows = pd.DataFrame({
        "model": np.repeat(["a", "b", "c", "d"], n // 4), "protocol": "P1", "split": "all", "stage": "all", "method": "bayes",
        "gpu_type": np.tile(["t4", "v100"], n // 2), "num_nodes": 1, "num_replicas": 2, "local_bsz": 32, "accum_steps": 0,
        "actual": actual, "predicted": predicted, "low": predicted * 0.85, "high": predicted * 1.15,
    })
    summary = summarize(rows).iloc[0]
    assert summary["units"] == 8  # 4 models × 2 types
    assert summary["median_ape_low"] <= summary["median_ape"] <= summary["median_ape_high"]
    assert summary["coverage90_low"] <= summary["coverage90"] <= summary["coverage90_high"]
    text = markdown(summarize(rows), "t")
    assert f"{summary['median_ape_low']:.1f}–{summary['median_ape_high']:.1f}" in text and "| units |" in text
    assert np.isnan(summarize(rows, resamples=0).iloc[0]["median_ape_low"])


def test_the_evidence_check_compares_p2_with_p1_on_the_same_rows():
    """``evidence_check``: each P2 row is matched to P1's row of the same model, type, configuration and measurement
    (P1's rows that P2 does not test, e.g. the warm type's, do not count); the markdown says for how many models it holds."""
    from experiments.accuracy_report import evidence_check

    def row(model, protocol, split, gpu, bsz, actual, predicted):
        return {"model": model, "protocol": protocol, "split": split, "stage": split, "method": "bayes", "gpu_type": gpu,
                "num_nodes": 2, "num_replicas": 8, "local_bsz": bsz, "accum_steps": 0, "actual": actual,
                "predicted": predicted, "low": predicted * 0.8, "high": predicted * 1.2}

    rows = pd.DataFrame([
        row("a", "P1", "all", "t4", 32, 1.0, 1.2), row("a", "P1", "all", "t4", 64, 2.0, 2.2),   # 20%, 10%
        row("a", "P1", "all", "v100", 32, 0.5, 0.9),                                            # 80%: only P1 tests it
        row("a", "P2", "warm=v100", "t4", 32, 1.0, 1.05), row("a", "P2", "warm=v100", "t4", 64, 2.0, 2.1),  # 5%, 5%
        row("b", "P1", "all", "t4", 32, 1.0, 1.1),                                              # 10%
        row("b", "P2", "warm=v100", "t4", 32, 1.0, 1.3),                                        # 30%
    ])
    check = evidence_check(rows).set_index("model")
    assert check.loc["a", "rows"] == 2 and check.loc["a", "P1"] == pytest.approx(15.0) and check.loc["a", "P2"] == pytest.approx(5.0)
    assert bool(check.loc["a", "holds"]) and not bool(check.loc["b", "holds"])
    assert check.loc["b", "P2"] == pytest.approx(30.0)
    text = markdown(summarize(rows, resamples=0), "t", evidence=evidence_check(rows))
    assert "Holds for 1 of 2 model(s) of bayes" in text and "| b | bayes | 1 | 10.0 | 30.0 | n/a | no |" in text
    # without bayes, one count per method: 2 models × 2 methods had read "4 of 4 model(s) of linear"
    others = pd.concat([rows.assign(method="linear"), rows.assign(method="pollux")], ignore_index=True)
    text = markdown(summarize(others, resamples=0), "t", evidence=evidence_check(others))
    assert ("Holds for 1 of 2 model(s) of linear, worse beyond the interval for 0; "
            "1 of 2 model(s) of pollux, worse beyond the interval for 0") in text
    assert evidence_check(rows[rows["protocol"] == "P1"]).empty
    assert np.isnan(check.loc["a", "low"]) and not bool(check.loc["a", "worse"])  # one test type: no interval


def test_the_evidence_check_bounds_p2_minus_p1_by_resampling_the_test_types():
    """With 3+ test types, ``low``/``high`` bound P2 − P1 by resampling the types (paired: both medians on each
    resample); a model whose P2 is worse on every type is worse beyond the interval, one worse on one type of four is not."""
    from experiments.accuracy_intervals import paired_median_difference
    from experiments.accuracy_report import evidence_check

    def rows_of(model, p1_errors, p2_errors):
        out = []
        for gpu, (e1, e2) in zip(["k80", "p100", "t4", "a100"], zip(p1_errors, p2_errors)):
            for bsz in (32, 64):
                base = {"model": model, "method": "bayes", "gpu_type": gpu, "num_nodes": 1, "num_replicas": 4,
                        "local_bsz": bsz, "accum_steps": 0, "actual": 1.0, "low": 0.5, "high": 2.0}
                out.append({**base, "protocol": "P1", "split": "all", "stage": "all", "predicted": 1.0 + e1})
                out.append({**base, "protocol": "P2", "split": "warm=v100", "stage": "warm=v100", "predicted": 1.0 + e2})
        return out

    rows = pd.DataFrame(rows_of("worse", [0.10, 0.12, 0.08, 0.11], [0.20, 0.25, 0.18, 0.22])
                        + rows_of("mixed", [0.10, 0.12, 0.08, 0.11], [0.09, 0.11, 0.07, 0.40]))
    check = evidence_check(rows, resamples=400).set_index("model")
    assert bool(check.loc["worse", "worse"]) and 0.0 < check.loc["worse", "low"] <= check.loc["worse", "high"] <= 15.0
    assert not bool(check.loc["mixed", "worse"]) and check.loc["mixed", "low"] < 0.0 < check.loc["mixed", "high"]
    text = markdown(summarize(rows, resamples=0), "t", evidence=check.reset_index())
    assert "| worse | bayes | 8 | 10.5 | 21.0 |" in text and "| no, beyond the interval |" in text
    assert "Holds for 1 of 2 model(s) of bayes, worse beyond the interval for 1 (the 95% interval" in text
    same = np.arange(12.0)
    assert paired_median_difference(same, same, np.repeat(np.arange(4), 3)) == (0.0, 0.0)  # paired: shared rows cancel
    with pytest.raises(ValueError, match="second, units"):
        paired_median_difference(same, same[:5], np.repeat(np.arange(4), 3))
