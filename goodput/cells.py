"""One (job, GPU type)'s evidence, summarised for the cluster's prior, and the weak prior it is read under.

A cell's step times are fitted by their maximum a posteriori coordinates ``u``
(:mod:`goodput.parametric`) under a weak prior, and summarised with the
information of its data about them (:class:`CellSummary`: a Laplace
approximation of the cell's likelihood, so a job that never ran multi-GPU on a
type says nothing about its sync there). :mod:`goodput.hierarchy` learns the
cluster's prior from these summaries. The same weak prior
(:func:`default_prior`: :data:`DEFAULT_SHARED_STD`, :data:`DEFAULT_TYPE_STD`
around means read off the job's own compute, :func:`default_means`) is a job's
prior where there is no cluster. :func:`one_gpu_log_proxy` reads a job's size
off its 1-GPU compute, for a job that does not report one.

Example::

    from goodput.parametric import reference_bsz
    cell = summarize_cell("bert", "t4", observations, reference_bsz(observations))
    cell.u, cell.info          # MAP coordinates (8,), the data's information about them (8, 8)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ValidationError
from .observations import Observation
from .parametric import K, MapFit, Rows, fit_map, log_step_time, power_from_log
from .sync_shape import SyncShape
from .validation import check_float, check_int, check_str, normalize_gpu_type

__all__ = ["CellSummary", "summarize_cell", "summarize_with_residuals", "step_rows", "compute_rows", "default_means",
           "default_means_by_type", "default_prior", "default_shared_cov", "shared_plus_own", "one_gpu_log_proxy",
           "log_size_proxy", "DEFAULT_SHARED_STD", "DEFAULT_TYPE_STD", "SYNC_CORRELATION", "SIZE_PROXY_FLOOR"]

# Weak defaults, std of each coordinate of COORDS: the part a job shares across its types, and the part
# particular to one type. Compute's level is always observed (1-GPU steps); its split between per-sample
# work and per-step overhead is the job's (its FLOPs against its overheads), anywhere in (0, 1) for a new
# job (logit-std 1.5) and shared across its types (logit-std 0.3 apart). Sync constants: a factor ~5 either way of half the compute
# (Pollux's traces: 0.02-2x), intra- and inter-node moving together (the same gradient bytes: correlation
# SYNC_CORRELATION); growth per extra replica ~5% of the constant; γ - 1 ~ 0.5. The intra-node growth ratio
# has no shared part (goodput.hierarchy.NO_JOB_EFFECT): all of its default spread (1.1 = √(1² + ½²)) is the type's. Compute's
# power p around Pollux's sum (log p = 0): 0.25 in log for the job, 0.2 for one type, about what the EM
# learned on the shared data from twice that. A cell fitted under twice that (summarize_cell) bends its curve
# only as far as its sizes show: with 0.5 and 0.4, Gavel's non-monotone K80 steps (resnet-18: 0.21 s at 16
# samples, 0.14 s at 32 and 64) took p to 7.8.
DEFAULT_SHARED_STD = np.array([1.0, 1.5, 1.0, 1.0, 0.01, 1.0, 0.7, 0.25])
DEFAULT_TYPE_STD = np.array([1.0, 0.3, 0.5, 0.6, 1.1, 0.5, 0.5, 0.2])
SYNC_CORRELATION = 0.95
SIZE_PROXY_FLOOR = 0.05  # α_c at least this share of c in the size proxy (goodput.hierarchy, SIZE_PROXY_STD's comment)
CELL_NOISE_PRIOR = 0.05  # a cell fit's residual std (log) before its data say otherwise
NOISE_RANGE = (0.01, 0.5)


def default_shared_cov() -> np.ndarray:
    """A's weak default: :data:`DEFAULT_SHARED_STD` with the sync constants correlated (:data:`SYNC_CORRELATION`)."""
    cov = np.diag(DEFAULT_SHARED_STD**2)
    cov[2, 3] = cov[3, 2] = SYNC_CORRELATION * DEFAULT_SHARED_STD[2] * DEFAULT_SHARED_STD[3]
    return cov


def default_means(observations: Sequence[Observation]) -> np.ndarray:
    """Weak prior means of ``u`` on one type, read off the job's compute there (8,).

    ``c̄``: geometric mean of the compute of one micro-batch (1-replica steps, else every step, per
    micro-batch): compute c̄ at the reference batch, split in halves (Pollux's default at one batch
    size), α_r = 0.5·c̄, α_n = c̄, growth 5%, γ = 1.5, Pollux's sum (p = 1).
    """
    single = [o for o in observations if o.num_replicas == 1] or list(observations)
    c_bar = math.exp(float(np.mean([math.log(o.step_time / (o.accum_steps + 1)) for o in single])))
    return np.array([math.log(c_bar), 0.0, math.log(0.5 * c_bar), math.log(c_bar), math.log(0.05), math.log(0.05), math.log(0.5), 0.0])


def default_means_by_type(observations: Mapping[str, Sequence[Observation]]) -> list[np.ndarray]:
    """:func:`default_means` of each type, in the mapping's order; a type without 1-replica steps takes the
    mean over the types that have them: its only steps include synchronisation, so its compute is better
    read off the job's compute on its other types (the default prior then centres the type ratio at 1)."""
    single = [t for t, obs in observations.items() if any(o.num_replicas == 1 for o in obs)]
    pooled = np.mean([default_means(observations[t]) for t in single], axis=0) if single else None
    return [default_means(obs) if pooled is None or t in single else pooled for t, obs in observations.items()]


def shared_plus_own(num: int, shared: np.ndarray, own_var: np.ndarray) -> np.ndarray:
    """Covariance (Kn, Kn), type-major, of n blocks that share one part (``shared``, K×K, in every block pair)
    and each have their own independent part (variances ``own_var``, K): ``A + δ(t, t')·diag(E)``."""
    return np.kron(np.ones((num, num)), shared) + np.kron(np.eye(num), np.diag(own_var))


def default_prior(means: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Mean (T, 8) and covariance (8T, 8T) of the weak default prior of a job on T types."""
    mean = np.asarray(means, dtype=float).reshape(-1, K)
    return mean, shared_plus_own(mean.shape[0], default_shared_cov(), DEFAULT_TYPE_STD**2)


def step_rows(observations: Sequence[Observation], ref_bsz: float, shape: SyncShape | None) -> tuple[Rows, np.ndarray]:
    """Configurations and log step times of observations (one type)."""
    return Rows.of(observations, ref_bsz, shape), np.log([o.step_time for o in observations])


def compute_rows(observations: Sequence[Observation], ref_bsz: float) -> tuple[Rows, np.ndarray]:
    """Configurations and log compute times (s per micro-batch, ``Observation.compute_time``) of the steps on
    several replicas whose sync was measured (one type); on one replica the step time is the compute."""
    chosen = [o for o in observations if o.num_replicas > 1 and o.compute_time is not None and o.compute_time > 0]
    return Rows.of(chosen, ref_bsz), np.log([o.compute_time for o in chosen]) if chosen else np.zeros(0)


@dataclass(frozen=True)
class CellSummary:
    """What one job's data say about its coordinates on one GPU type (an entry of a :class:`ClusterPrior`).

    Attributes:
        job, gpu_type: the cell.
        u: (8,) maximum a posteriori coordinates under the weak default prior.
        info: (8, 8) information of the data about ``u`` (Gauss–Newton, at ``u``): the cell's
            likelihood is ∝ exp(−½ (u' − u)ᵀ info (u' − u)); directions the data do not see have 0.
        n: observations.
        noise: RMS log residual of its step times under ``u``.
        size: the job's trainable parameters, when known.
        log_proxy: :func:`one_gpu_log_proxy` of its observations (``None``: fewer than two batch sizes on
            one GPU), what places a job that reports no size.
    """

    job: str
    gpu_type: str
    u: np.ndarray
    info: np.ndarray
    n: int
    noise: float
    size: float | None = None
    log_proxy: float | None = None

    def __eq__(self, other: object) -> bool:  # the arrays by value (the generated one raised on them)
        if not isinstance(other, CellSummary):
            return NotImplemented
        return (self.job, self.gpu_type, self.n, self.noise, self.size, self.log_proxy) \
            == (other.job, other.gpu_type, other.n, other.noise, other.size, other.log_proxy) \
            and np.array_equal(self.u, other.u) and np.array_equal(self.info, other.info)

    __hash__ = None  # type: ignore[assignment]  # mutable arrays inside

    def to_dict(self) -> dict[str, Any]:
        out = {"job": self.job, "gpu_type": self.gpu_type, "u": [float(v) for v in self.u],
               "info": [[float(v) for v in row] for row in self.info], "n": self.n, "noise": self.noise}
        if self.size is not None:
            out["size"] = self.size
        if self.log_proxy is not None:
            out["log_proxy"] = self.log_proxy
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CellSummary:
        u = np.asarray(data["u"], dtype=float)
        info = np.asarray(data["info"], dtype=float)
        if u.shape == (K - 1,) and info.shape == (K - 1, K - 1):  # saved before compute's power: Pollux's sum, unseen
            u, info = np.append(u, 0.0), np.pad(info, (0, 1))
        if u.shape != (K,) or info.shape != (K, K) or not (np.all(np.isfinite(u)) and np.all(np.isfinite(info))):
            raise ValidationError("u", data.get("u"), f"expected {K} finite coordinates and a {K}x{K} finite information matrix")
        return cls(check_str("job", data["job"]), normalize_gpu_type(data["gpu_type"]), u, 0.5 * (info + info.T),
                   check_int("n", data["n"], minimum=1),
                   check_float("noise", data["noise"], nonnegative=True),
                   None if data.get("size") is None else check_float("size", data["size"], positive=True),
                   None if data.get("log_proxy") is None else check_float("log_proxy", data["log_proxy"]))


def summarize_cell(job: str, gpu_type: str, observations: Sequence[Observation], ref_bsz: float,
                   shape: SyncShape | None = None, size: float | None = None) -> CellSummary:
    """:class:`CellSummary` of one job's observations on one type: a MAP fit under a weak prior, then its data's information.

    The likelihood's scale is the fit's own residual std over the degrees of freedom its coordinates leave
    (shrunk toward :data:`CELL_NOISE_PRIOR` by 2 pseudo-observations: :func:`_weak_map`), so a job that
    Pollux's form fits badly informs its neighbours less, and a cell of a few steps no more than they carry. Step
    times alone: with the measured compute times (:func:`compute_rows`) fitted here as the job's own
    posterior fits them, P1-P3 got worse on the derived sets (``experiments/results/accuracy.md``'s probes).
    """
    return summarize_with_residuals(job, gpu_type, observations, ref_bsz, shape, size)[0]


def summarize_with_residuals(job: str, gpu_type: str, observations: Sequence[Observation], ref_bsz: float,
                             shape: SyncShape | None, size: float | None) -> tuple[CellSummary, Rows, np.ndarray]:
    """:func:`summarize_cell`, with the cell's configurations and its log residuals of step time around ``u``."""
    fit, rows, y, sigma = _weak_map(observations, ref_bsz, shape)
    log_t, jac = log_step_time(fit.u[0], rows)
    info = jac.T @ jac / sigma**2
    return (CellSummary(job, gpu_type, fit.u[0], info, len(observations), fit.rms, size, one_gpu_log_proxy(observations)),
            rows, y - log_t)


def _weak_map(observations: Sequence[Observation], ref_bsz: float, shape: SyncShape | None) -> tuple[MapFit, Rows, np.ndarray, float]:
    """The MAP fit of one cell's step times under twice the weak default's std, and its noise: the fit's own, over
    the degrees of freedom its coordinates leave (``n − tr(H (H + P)⁻¹)``, H the data's information and P the
    prior's precision at the MAP; restricted maximum likelihood's count, Patterson & Thompson, *Biometrika* 58, 1971),
    shrunk toward :data:`CELL_NOISE_PRIOR` by 2 pseudo-observations."""
    mean, cov = default_prior([default_means(observations)])
    chol = np.linalg.cholesky(cov * 4.0)  # twice the default std: weak
    rows, y = step_rows(observations, ref_bsz, shape)
    precision = np.linalg.inv(cov * 4.0)
    fit = fit_map([(0, rows, y)], mean, chol, CELL_NOISE_PRIOR)
    sigma = _shrunk_noise(fit.rms, fit.n, _fitted_dof(fit.u[0], rows, CELL_NOISE_PRIOR, precision))
    return fit_map([(0, rows, y)], mean, chol, sigma, initial=fit.u), rows, y, sigma


def _fitted_dof(u: np.ndarray, rows: Rows, sigma: float, precision: np.ndarray) -> float:
    """The effective number of coordinates a fit at ``u`` spends on its data: ``tr(H (H + P)⁻¹)``."""
    jac = log_step_time(u, rows)[1]
    info = jac.T @ jac / sigma**2
    return float(np.trace(np.linalg.solve(info + precision, info)))


def one_gpu_log_proxy(observations: Sequence[Observation]) -> float | None:
    """:func:`log_size_proxy` of a weak-prior fit to the 1-GPU observations among ``observations`` (one job on one
    type), ``c`` at their smallest batch (as the rule-based model's proxy), ``None`` with fewer than two batch
    sizes there (one leaves the per-step share to the prior). 1-GPU steps alone, so that a job's proxy does not
    depend on which multi-GPU configurations it has run."""
    one = [o for o in observations if o.num_replicas == 1]
    if len({o.local_bsz for o in one}) < 2:
        return None
    return float(log_size_proxy(_weak_map(one, min(o.local_bsz for o in one), None)[0].u[0]))


def _shrunk_noise(rms: float, n: int, spent: float = 0.0) -> float:
    value = math.sqrt((n * rms**2 + 2.0 * CELL_NOISE_PRIOR**2) / (max(n - spent, 0.0) + 2.0))
    return min(max(value, NOISE_RANGE[0]), NOISE_RANGE[1])


def log_size_proxy(u: np.ndarray) -> np.ndarray:
    """log √(α_c·c) of coordinates ``u`` (..., K), log seconds: α_c = c·(1 − f)^{1/p} the per-step compute, at
    least :data:`SIZE_PROXY_FLOOR` of the compute ``c`` at ``u``'s reference batch (the rule-based model's size
    proxy). What orders jobs by size when they do not report it."""
    u = np.asarray(u, dtype=float)
    per_step = -np.logaddexp(0.0, u[..., 1]) / power_from_log(u[..., K - 1])  # log(α_c / c) = log(1 − f) / p
    return u[..., 0] + 0.5 * np.maximum(per_step, math.log(SIZE_PROXY_FLOOR))
