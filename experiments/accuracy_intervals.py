"""How sure a measured accuracy figure is: cluster-bootstrap intervals for median APE and coverage.

The rows of one protocol are not independent draws. A protocol measures a
few jobs on a few GPU types; every row of one (job, type) cell shares that
job's data on that type, and the rows of one split come from one fitted
model, so their errors move together: one bad fit on one type misses every
configuration of that type. P4's random orders and P2's warm types are
repeated looks at the same cells, not new cells. The independent *units*
are therefore the (model, GPU type of the test row) cells. Gavel's P5 has 57
rows from 15 such cells, and a binomial interval on its coverage, which
treats the 57 as independent, would be too narrow.

:func:`cluster_bootstrap` resamples the units with replacement (the rows of a
unit travel together) and returns percentile intervals of the pooled median
APE and of the pooled coverage (Davison & Hinkley, *Bootstrap Methods and
their Application*, 1997, §3.8, "multi-stage sampling": resample the first
stage only). A target is met with confidence only when its whole interval
lies on the right side; an interval that straddles the target says the data
cannot tell.

Example::

    >>> import numpy as np
    >>> ape = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]); covered = np.array([1, 1, 0, 1, 1, 1], bool)
    >>> units = np.array([0, 0, 1, 1, 2, 2])
    >>> ci = cluster_bootstrap(ape, covered, units, resamples=200)
    >>> ci.units, bool(ci.median_ape_low <= 3.5 <= ci.median_ape_high), bool(ci.coverage_low < 83.4 < ci.coverage_high)
    (3, True, True)
    >>> math.isnan(cluster_bootstrap(ape[:4], covered[:4], units[:4]).median_ape_low)  # 2 units: no interval
    True

:func:`paired_median_difference` does the same for two predictors' errors on
the same rows (P2 against P1): each resample draws the units once and takes
both medians on it, so what the two share cancels out of the difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["BootstrapInterval", "cluster_bootstrap", "paired_median_difference", "RESAMPLES", "CONFIDENCE", "MIN_UNITS"]

RESAMPLES = 1000
CONFIDENCE = 0.95
MIN_UNITS = 3  # fewer independent units cannot support an interval (NaN): one unit resamples to itself
_CHUNK_CELLS = 4_000_000  # resamples × rows per chunk of the weighted-median computation (32 MB of float64)


@dataclass(frozen=True)
class BootstrapInterval:
    """Percentile intervals (at ``confidence``) over resampled units; NaN where undefined.

    Attributes:
        median_ape_low, median_ape_high: interval of the pooled median APE (same unit as the input, %);
            NaN with fewer than :data:`MIN_UNITS` units.
        coverage_low, coverage_high: interval of the pooled coverage, percent (NaN without intervals).
        units: independent units resampled.
    """

    median_ape_low: float
    median_ape_high: float
    coverage_low: float
    coverage_high: float
    units: int


def _weighted_medians(sorted_values: np.ndarray, row_weights: np.ndarray) -> np.ndarray:
    """Median of the multiset that repeats ``sorted_values[i]`` ``row_weights[b, i]`` times, per row b: (B, N) -> (B,).

    Integer weights; the same value as ``np.median`` of the repeated values (the mean of the two middle ones for an even count).
    """
    cumulative = np.cumsum(row_weights, axis=1)
    total = cumulative[:, -1:]
    low = (cumulative <= (total - 1) // 2).sum(axis=1)
    high = (cumulative <= total // 2).sum(axis=1)
    return (sorted_values[low] + sorted_values[high]) / 2.0


def _unit_counts(units: np.ndarray, resamples: int, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Each row's unit index, and each resample's multiplicity of each unit, (B, U); None below :data:`MIN_UNITS`."""
    _, unit_of_row = np.unique(units, return_inverse=True)
    num_units = int(unit_of_row.max()) + 1
    if num_units < MIN_UNITS:
        return unit_of_row, None
    rng = np.random.default_rng(seed)
    return unit_of_row, np.stack([np.bincount(rng.integers(0, num_units, num_units), minlength=num_units)
                                  for _ in range(int(resamples))])


def _resampled_medians(values: np.ndarray, unit_of_row: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The median of ``values`` in each resample (the rows of a unit repeated as often as it was drawn): (B,)."""
    order = np.argsort(values, kind="stable")
    sorted_values, sorted_unit = values[order], unit_of_row[order]
    chunk = max(1, _CHUNK_CELLS // values.size)
    return np.concatenate([_weighted_medians(sorted_values, counts[i:i + chunk][:, sorted_unit])
                           for i in range(0, counts.shape[0], chunk)])


def _check_resampling(resamples: int, confidence: float) -> float:
    """The lower tail, percent, of a two-sided interval at ``confidence``; ValueError on bad arguments."""
    if int(resamples) < 1:
        raise ValueError(f"resamples: {resamples!r} must be >= 1")
    if not 0.0 < float(confidence) < 1.0:
        raise ValueError(f"confidence: {confidence!r} must lie in (0, 1)")
    return (1.0 - float(confidence)) / 2.0 * 100.0


def paired_median_difference(first: np.ndarray, second: np.ndarray, units: np.ndarray, *, resamples: int = RESAMPLES,
                             confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of ``median(second) - median(first)`` over the same rows, resampling whole units.

    Args:
        first, second: two predictors' absolute percentage errors on the same rows, shape (N,) each.
        units: a label per row naming its independent unit.
        resamples, confidence, seed: as in :func:`cluster_bootstrap`.

    Returns:
        (low, high) in the inputs' unit (percentage points); NaN with fewer than :data:`MIN_UNITS` units.
        ``low > 0``: ``second`` is worse beyond the interval; ``high < 0``: better beyond it.

    Example::

        >>> units = np.repeat(np.arange(4), 2)
        >>> low, high = paired_median_difference(np.full(8, 10.0), np.linspace(11.0, 14.0, 8), units, resamples=200)
        >>> bool(0.0 < low <= 2.5 <= high)
        True
    """
    first, second = np.asarray(first, dtype=float).ravel(), np.asarray(second, dtype=float).ravel()
    units = np.asarray(units).ravel()
    if first.size == 0:
        raise ValueError("first: no rows to bootstrap")
    if second.size != first.size or units.size != first.size:
        raise ValueError(f"second, units: {second.size} and {units.size} rows for {first.size}")
    tail = _check_resampling(resamples, confidence)
    unit_of_row, counts = _unit_counts(units, resamples, seed)
    if counts is None:
        return math.nan, math.nan
    difference = _resampled_medians(second, unit_of_row, counts) - _resampled_medians(first, unit_of_row, counts)
    low, high = np.percentile(difference, [tail, 100.0 - tail])
    return float(low), float(high)


def cluster_bootstrap(ape: np.ndarray, covered: np.ndarray | None, units: np.ndarray, *, resamples: int = RESAMPLES,
                      confidence: float = CONFIDENCE, seed: int = 0) -> BootstrapInterval:
    """Percentile intervals of the median APE and the coverage, resampling whole units.

    Args:
        ape: absolute percentage errors of the rows, shape (N,).
        covered: whether each row's interval covered the measurement, shape (N,); ``None`` when the
            method gives no intervals (the coverage interval is then NaN).
        units: a label per row naming its independent unit (any hashable dtype numpy can sort).
        resamples: bootstrap resamples (B).
        confidence: two-sided level of the intervals, in (0, 1).
        seed: random seed; the same inputs and seed give the same interval.

    Raises:
        ValueError: on mismatched lengths, no rows, ``resamples < 1`` or a level outside (0, 1).
    """
    ape = np.asarray(ape, dtype=float).ravel()
    units = np.asarray(units).ravel()
    if ape.size == 0:
        raise ValueError("ape: no rows to bootstrap")
    if units.size != ape.size:
        raise ValueError(f"units: {units.size} labels for {ape.size} rows")
    if covered is not None:
        covered = np.asarray(covered, dtype=bool).ravel()
        if covered.size != ape.size:
            raise ValueError(f"covered: {covered.size} flags for {ape.size} rows")
    tail = _check_resampling(resamples, confidence)
    unit_of_row, counts = _unit_counts(units, resamples, seed)
    if counts is None:
        return BootstrapInterval(math.nan, math.nan, math.nan, math.nan, int(unit_of_row.max()) + 1)
    num_units = counts.shape[1]
    med_low, med_high = np.percentile(_resampled_medians(ape, unit_of_row, counts), [tail, 100.0 - tail])

    cov_low = cov_high = math.nan
    if covered is not None:
        rows_per_unit = np.bincount(unit_of_row, minlength=num_units).astype(float)
        hits_per_unit = np.bincount(unit_of_row, weights=covered.astype(float), minlength=num_units)
        coverage = 100.0 * (counts @ hits_per_unit) / (counts @ rows_per_unit)
        cov_low, cov_high = np.percentile(coverage, [tail, 100.0 - tail])
    return BootstrapInterval(float(med_low), float(med_high), float(cov_low), float(cov_high), num_units)
