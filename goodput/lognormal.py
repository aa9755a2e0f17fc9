"""The log-normal form of every prediction's uncertainty: median, std and quantiles.

:class:`goodput.JobModel` predicts log step time as a Gaussian (mean μ, std
s), so the step time is log-normal with median e^μ, and goodput (samples/s ×
efficiency, ∝ 1 / step time) is log-normal with the same s around its own
median. A :class:`goodput.GoodputTable` keeps the median (``goodput``) and the
standard deviation (``std``, same unit); these helpers go between that pair,
the log-std s and any quantile of it::

    std        = median · e^{s²/2} · √(e^{s²} − 1)
    e^{s²}     = (1 + √(1 + 4·(std / median)²)) / 2          (the inverse)
    quantile q = median · e^{z_q · s},  z_q = Φ⁻¹(q)

Example::

    >>> round(float(lognormal_std(100.0, 0.1)), 3)
    10.075
    >>> round(float(lognormal_log_std(100.0, lognormal_std(100.0, 0.1))), 6)
    0.1
    >>> round(float(lognormal_quantile(100.0, 0.1, 0.05)), 2)
    84.83
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.special import ndtri

from .validation import check_quantile

__all__ = ["lognormal_std", "lognormal_log_std", "lognormal_quantile"]


def lognormal_std(median: Any, log_std: Any) -> Any:
    """Standard deviation of a log-normal with this median and std of its log (same unit as the median)."""
    s2 = np.square(np.asarray(log_std, dtype=float))
    return np.asarray(median, dtype=float) * np.exp(s2 / 2) * np.sqrt(np.expm1(s2))


def lognormal_log_std(median: Any, std: Any) -> Any:
    """Std of the log of a log-normal with this median and standard deviation; 0 where either is 0.

    Inverts :func:`lognormal_std`: ``e^{s²} = (1 + √(1 + 4 r²)) / 2`` with r = std / median.
    """
    median = np.asarray(median, dtype=float)
    std = np.asarray(std, dtype=float)
    ratio = np.divide(std, median, out=np.zeros(np.broadcast(median, std).shape), where=median > 0)
    # e^{s²} − 1 = (√(1 + 4r²) − 1) / 2, written as 2r² / (√(1 + 4r²) + 1): the difference cancelled to 0 below
    # r ≈ 1e-8 (hypothesis found s = 6.3e-9 inverted to 0)
    u_minus_1 = 2.0 * ratio**2 / (np.sqrt(1.0 + 4.0 * ratio**2) + 1.0)
    return np.sqrt(np.log1p(u_minus_1))


def lognormal_quantile(median: Any, log_std: Any, q: float) -> Any:
    """The q-quantile of a log-normal with this median and std of its log: ``median · e^{Φ⁻¹(q) · s}``."""
    q = check_quantile("q", q)
    return np.asarray(median, dtype=float) * np.exp(ndtri(q) * np.asarray(log_std, dtype=float))
