"""Gaussian-process residual of log step time, shared across GPU types (Hadamard multitask).

The Bayesian layer of :class:`goodput.model.JobModel` models the residual of
the log step time of a configuration with respect to the Pollux prediction
(Qiao et al., OSDI'21, eq. 10–12), ``r = log(step_time) − log(T_pollux)``, as

    r(x, t) = f(x, t) + s(x, t)ᵀ δ + ε

* ``f`` is a Gaussian process with the Hadamard multitask kernel
  ``k((x, t), (x', t')) = B[t, t'] · k_M(x, x')`` (Bonilla et al., "Multi-task
  Gaussian process prediction", NIPS'07; gpytorch's ``IndexKernel`` ×
  ``MaternKernel``): ``k_M`` is the Matérn-5/2 kernel with one length scale
  per feature (Rasmussen & Williams, *Gaussian Processes for Machine
  Learning*, 2006, eq. 4.17; BoTorch's default), which lets the residual be
  rougher than the squared exponential would (on the shared data it cut the
  online error after 20 observations from 6.2% to 5.9% on Pollux's T4 traces
  and from 4.6% to 4.3% on Gavel's: issue 4's round 3 in the git history of ``experiments/results/accuracy.md``);
  ``B = w wᵀ + diag(v)`` is a rank-1-plus-diagonal covariance
  between GPU types, so residual structure learned on one type moves to the
  others in proportion to their learned correlation. ``x`` are the
  configuration features of :func:`config_features`.
* ``s(x, t)ᵀ δ`` is a Bayesian linear model in the (log) Pollux parameters:
  ``s`` holds the sensitivities ``∂ log T / ∂u`` of the prediction times the
  Cholesky factor of the parameters' prior covariance, and ``δ ~ N(0, I)``.
  Marginalising ``δ`` adds the fixed kernel ``s sᵀ``; conditioning on data is
  then the linearised (Laplace) posterior of the parameters, the job's types
  coupled as the prior couples them (:mod:`goodput.posterior`,
  :mod:`goodput.hierarchy`).
* ``ε ~ N(0, σ² + d(x))``: learned measurement noise plus an optional fixed
  per-point variance ``d``.

Hyperparameters (Matérn length scales, ``w``, ``v``, ``σ²``) are fitted
(:mod:`goodput.gp_fit`) by maximising the exact marginal likelihood of gpytorch's model in float64 (its
value and analytic gradient in numpy, by scipy's L-BFGS-B: for the few
hundred points of a job, gpytorch's and autograd's bookkeeping cost 10× the
arithmetic); the posterior is
then held as a Cholesky factor in numpy (:class:`OnlinePosterior`) that new
observations extend incrementally in O(n²), without refitting the
hyperparameters. Gpytorch's ``get_fantasy_model`` does the same; an explicit
factor keeps the scheduler's hot path free of torch and lets the jitter be
escalated per update. :func:`goodput.gp_fit.gpytorch_posterior` computes the same posterior
with gpytorch's own batch prediction — the reference the online update is
tested against.

Numerical trouble (a covariance that is not positive definite) is answered by
escalating jitter; if that fails, :class:`GPNumericalError` is raised for the
caller (``JobModel``) to fall back to the parametric prediction.

Example::

    x = config_features(np.ones(3), np.array([1, 2, 4]), np.full(3, 64.0), np.zeros(3))
    hyper = GPHyperparameters.default(num_features=x.shape[1], num_tasks=1)
    post = OnlinePosterior(hyper, x, np.zeros(3, int), np.zeros((3, 0)), np.array([0.0, 0.1, 0.2]))
    mean, var = post.predict(x[:1], np.zeros(1, int), np.zeros((1, 0)))
    post.condition(x[1:2], np.zeros(1, int), np.zeros((1, 0)), np.array([0.12]))
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import scipy.linalg
import scipy.optimize
import scipy.special

from .errors import ValidationError
from .validation import check_float, is_collection

__all__ = [
    "FEATURE_NAMES",
    "config_features",
    "GPHyperparameters",
    "GPNumericalError",
    "OnlinePosterior",
    "covariance",
    "cholesky_with_jitter",
    "HyperPrior",
]

FEATURE_NAMES = ("log2_local_bsz", "log2_replicas", "log2_nodes", "multi_replica", "multi_node", "log2_accum")

# Relative jitters tried, in order, when a covariance is not numerically positive definite.
JITTERS = (0.0, 1e-10, 1e-8, 1e-6, 1e-4, 1e-2)
NOISE_FLOOR = 1e-5  # variance of log step time: a 0.3% measurement spread
NOISE_PRIOR = 1e-3  # median of the noise variance's log-normal prior: a 3% spread
LENGTHSCALE_BOUNDS = (0.05, 50.0)  # the Matérn length scales' interval (gpytorch Interval constraint), feature units
# The correlation of a job's residuals across its GPU types before a cluster says otherwise, and how far (in logit of
# each type's shared fraction w²/(w² + v)) one job's may depart from the cluster's typical one.
DEFAULT_TASK_CORRELATION = 0.9
CORRELATION_LOGIT_STD = 1.0
CORRELATION_RANGE = (0.02, 0.98)
# Query sets whose kernel against the training points predict_mean keeps (cache_key): a goodput table asks for the
# same candidates on each type after every observation, so only the new training points' rows are computed. At
# most QUERY_CACHE_ENTRIES sets and QUERY_CACHE_BYTES in all per posterior (a service holds one per job: 350
# candidates against 200 points take 0.56 MB), the least recently used leaving first.
QUERY_CACHE_ENTRIES = 8
QUERY_CACHE_BYTES = 8 << 20


def keep_recent(cache: OrderedDict, key: Hashable, value: Any, entries: int, max_bytes: int | None = None) -> None:
    """Put ``value`` in ``cache`` as its most recently used entry, then drop the least recently used until at
    most ``entries`` remain (and, with ``max_bytes``, their arrays' ``nbytes`` add up to at most that; a
    value above it alone is not kept and evicts nothing)."""
    cache.pop(key, None)
    if max_bytes is None:
        cache[key] = value
        while len(cache) > entries:
            cache.popitem(last=False)
        return
    if value.nbytes > max_bytes:
        return
    cache[key] = value
    kept = sum(v.nbytes for v in cache.values())
    while len(cache) > entries or kept > max_bytes:
        kept -= cache.popitem(last=False)[1].nbytes


def _kern(d2: np.ndarray) -> np.ndarray:
    """Matérn-5/2 correlation of squared scaled distances ``d2`` (Rasmussen & Williams 2006, eq. 4.17).

    ``(1 + r + r²/3) e^{−r}`` with ``r = √(5·d2)``, on three arrays and no other temporaries: the hot
    path of a goodput table (a few hundred candidates against every observation).
    """
    r = np.multiply(d2, 5.0)
    np.sqrt(r, out=r)
    decay = np.negative(r)
    np.exp(decay, out=decay)
    out = np.multiply(r, r)
    out *= 1.0 / 3.0
    out += r
    out += 1.0
    out *= decay
    return out


def _sq_dist(scaled_a: np.ndarray, sq_a: np.ndarray, scaled_b: np.ndarray) -> np.ndarray:
    """Squared Euclidean distances (n, m) between rows of ``scaled_a`` (n, D), whose squared norms are ``sq_a``,
    and of ``scaled_b`` (m, D), floored at 0 (rounding), in place on one (n, m) array."""
    d2 = scaled_a @ scaled_b.T
    d2 *= -2.0
    d2 += sq_a[:, None]
    d2 += np.einsum("ij,ij->i", scaled_b, scaled_b)[None, :]
    np.maximum(d2, 0.0, out=d2)
    return d2


def _matern_terms(sq_diff: np.ndarray, lengthscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(r, e^{−r}, k)`` of the Matérn-5/2 correlation for squared feature differences ``sq_diff`` (n, n, D):
    ``r = √5·|Δ/ℓ|`` (floored at 1e-15 so its gradient stays finite), ``k = (1 + r + r²/3) e^{−r}``. The
    hyperparameter fits' gradient in ``ℓ_d`` is ``(5/3)(1 + r) e^{−r} Δ_d² / ℓ_d³`` times ``∂/∂k``."""
    r = np.sqrt(np.maximum(5.0 * (sq_diff @ lengthscale**-2.0), 1e-30))
    decay = np.exp(-r)
    return r, decay, (1.0 + r + r * r / 3.0) * decay


def _gaussian_nll(k: np.ndarray, y: np.ndarray, jitters: tuple[float, ...] = (0.0,)) -> tuple[float, np.ndarray]:
    """``½ yᵀK⁻¹y + ½ log|K|`` (no 2π term) and its gradient in K, ``½ (K⁻¹ − ααᵀ)`` (Rasmussen & Williams 2006,
    eq. 5.9); the absolute ``jitters`` are tried in turn until K factorises (else :class:`GPNumericalError`)."""
    chol, inverse = _factor(k, jitters)
    alpha = scipy.linalg.cho_solve((chol, True), y, check_finite=False)
    return float(0.5 * y @ alpha + np.log(np.diag(chol)).sum()), 0.5 * (inverse - np.outer(alpha, alpha))


def _factor(k: np.ndarray, jitters: tuple[float, ...] = (0.0,)) -> tuple[np.ndarray, np.ndarray]:
    """The lower Cholesky factor of ``k`` and ``K⁻¹``, the absolute ``jitters`` tried in turn until K factorises
    (else :class:`GPNumericalError`)."""
    n = k.shape[0]
    for jitter in jitters:
        try:
            chol = scipy.linalg.cholesky(k + jitter * np.eye(n) if jitter else k, lower=True, check_finite=False)
            break
        except np.linalg.LinAlgError:
            continue
    else:
        raise GPNumericalError(f"covariance not positive definite with jitter {jitters[-1]:g}")
    return chol, scipy.linalg.cho_solve((chol, True), np.eye(n), check_finite=False)


class GPNumericalError(ArithmeticError):
    """The covariance could not be factorised even with the largest jitter."""


def config_features(nodes: Any, replicas: Any, bsz: Any, accum: Any) -> np.ndarray:
    """GP inputs of configurations, shape (N, 6): see :data:`FEATURE_NAMES`.

    Logarithms base 2 make a doubling one unit; the two indicators mark the
    regimes where Pollux's model changes form (gradient sync appears at 2
    replicas; inter-node sync at 2 nodes).
    """
    nodes, replicas, bsz, accum = (np.asarray(a, dtype=float).ravel() for a in np.broadcast_arrays(nodes, replicas, bsz, accum))
    return np.column_stack(
        [np.log2(bsz), np.log2(replicas), np.log2(nodes), (replicas > 1).astype(float), (nodes > 1).astype(float), np.log2(accum + 1.0)]
    )


@dataclass(frozen=True)
class GPHyperparameters:
    """Hyperparameters of the residual GP.

    Attributes:
        lengthscale: Matérn length scale per feature (feature units: doublings, indicators).
        task_factor: ``w`` of the task covariance ``B = w wᵀ + diag(v)`` (one per GPU type).
        task_var: ``v``, per-type variance not shared with other types.
        noise: variance of the measurement noise of log step time.
        task_names: the GPU type of each task, where known (``()``: by position).
            :meth:`for_types` matches them to another job's types by name.
    """

    lengthscale: tuple[float, ...]
    task_factor: tuple[float, ...]
    task_var: tuple[float, ...]
    noise: float
    task_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # tuples of finite floats (lists from JSON or numpy arrays accepted), lengths consistent
        for name, lower in (("lengthscale", "positive"), ("task_factor", None), ("task_var", "nonnegative")):
            values = getattr(self, name)
            if not is_collection(values):
                raise ValidationError(name, values, "expected a sequence of numbers")
            checked = tuple(check_float(f"{name}[{i}]", v, positive=lower == "positive", nonnegative=lower == "nonnegative")
                            for i, v in enumerate(values))
            object.__setattr__(self, name, checked)
        if not self.lengthscale:
            raise ValidationError("lengthscale", self.lengthscale, "expected one length scale per feature")
        if len(self.task_var) != len(self.task_factor):
            raise ValidationError("task_var", self.task_var, f"expected one per task ({len(self.task_factor)}, as task_factor)")
        object.__setattr__(self, "noise", check_float("noise", self.noise, nonnegative=True))  # 0: exact data (ill-conditioned: the fallback)
        object.__setattr__(self, "task_names", tuple(self.task_names))
        if self.task_names and len(self.task_names) != len(self.task_factor):
            raise ValidationError("task_names", self.task_names, f"expected one name per task ({len(self.task_factor)})")

    @classmethod
    def default(cls, num_features: int = len(FEATURE_NAMES), num_tasks: int = 1) -> GPHyperparameters:
        """A prior guess: residual std ≈ 0.1 (10%), 90% correlated across types, length scale 2 doublings, 3% noise."""
        return cls(
            lengthscale=(2.0,) * num_features,
            task_factor=(0.095,) * num_tasks,
            task_var=(0.001,) * num_tasks,
            noise=1e-3,
        )

    @property
    def num_tasks(self) -> int:
        return len(self.task_factor)

    def task_covariance(self) -> np.ndarray:
        w = np.asarray(self.task_factor, dtype=float)
        return np.outer(w, w) + np.diag(np.asarray(self.task_var, dtype=float))

    def task_correlation(self) -> np.ndarray:
        b = self.task_covariance()
        d = np.sqrt(np.diag(b))
        return b / np.outer(d, d)

    def with_tasks(self, num_tasks: int) -> GPHyperparameters:
        """The same hyperparameters for more GPU types (new ones start at the mean of the known), by position; names dropped."""
        if num_tasks <= self.num_tasks:
            return replace(self, task_factor=self.task_factor[:num_tasks], task_var=self.task_var[:num_tasks], task_names=())
        extra = num_tasks - self.num_tasks
        w, v = self._task_means()
        return replace(self, task_factor=self.task_factor + (w,) * extra, task_var=self.task_var + (v,) * extra, task_names=())

    def for_types(self, types: Any) -> GPHyperparameters:
        """These hyperparameters for the GPU types ``types``, in that order, named.

        Tasks are matched by name when these hyperparameters carry names (those
        of another job, which may have met its types in another order); types
        they do not know start at the mean of the known ones. Without names,
        by position (:meth:`with_tasks`).
        """
        types = tuple(str(t) for t in types)
        if not self.task_names:
            return replace(self.with_tasks(len(types)), task_names=types)
        w_mean, v_mean = self._task_means()
        where = {name: k for k, name in enumerate(self.task_names)}
        w = tuple(self.task_factor[where[t]] if t in where else w_mean for t in types)
        v = tuple(self.task_var[where[t]] if t in where else v_mean for t in types)
        return replace(self, task_factor=w, task_var=v, task_names=types)

    def _task_means(self) -> tuple[float, float]:
        """Mean ``w`` and ``v`` of the known tasks (the defaults' without any): where a new type starts."""
        w = float(np.mean(self.task_factor)) if self.task_factor else 0.095
        v = float(np.mean(self.task_var)) if self.task_var else 0.001
        return w, v

    def to_dict(self) -> dict[str, Any]:
        return {"lengthscale": list(self.lengthscale), "task_factor": list(self.task_factor),
                "task_var": list(self.task_var), "noise": self.noise, "task_names": list(self.task_names)}


@dataclass(frozen=True)
class HyperPrior:
    """A prior on the residual GP's hyperparameters: log-normal around typical values (e.g. a cluster's).

    Attributes:
        lengthscale: median Matérn length scale per feature.
        signal_var: median variance of each GPU type's residual process (the task covariance's diagonal).
        noise: median measurement-noise variance.
        log_std: log-std of every one of them: how far one job may differ.
        correlation: typical correlation of a job's residuals on two GPU types, in (0, 1): each type's
            shared fraction ``w²/(w² + v)`` of its residual variance gets a logit-normal prior around it
            (std :data:`CORRELATION_LOGIT_STD`), so how much one type's misfit says about another's is the
            cluster's measured figure, not an assumption (:func:`goodput.gp_fit.fit_shared_hyperparameters` finds 0.17 on
            Gavel's K80/P100/V100 and 0.68 on Zeus's four types).
        noise_dof: degrees of freedom of the measurement noise's Student-t tails (> 2; ``inf``: Gaussian),
            :func:`goodput.tails.fit_noise_dof` of the cluster's residuals (Pollux's traces: 6.2; Zeus:
            7.0; Gavel: inf). They weigh each step in a job's fit (:mod:`goodput.posterior`) and widen its intervals.
        alternatives: the cluster's other modes, ``((HyperPrior, log weight), ...)``, each weight its log
            evidence relative to this one's (≤ 0). A cluster whose jobs were each measured once per
            configuration (Gavel's) cannot tell noise from a residual that varies on a short scale: its
            likelihood has a mode for each (9–43 apart in log evidence on Gavel's clusters), and which one
            is highest can turn on one job. A job's fit weighs each mode by its weight and its own data
            (:meth:`modes`, :func:`goodput.posterior.build_posterior`), so that one job leaving the cluster
            does not move every other job's model from one mode to the other.
    """

    lengthscale: tuple[float, ...]
    signal_var: float
    noise: float
    log_std: float = 0.5
    correlation: float = DEFAULT_TASK_CORRELATION
    noise_dof: float = math.inf
    alternatives: tuple[tuple[HyperPrior, float], ...] = ()

    def __post_init__(self) -> None:
        if not is_collection(self.lengthscale) or len(tuple(self.lengthscale)) != len(FEATURE_NAMES):
            raise ValidationError("lengthscale", self.lengthscale, f"expected {len(FEATURE_NAMES)} length scales, one per "
                                  f"feature ({', '.join(FEATURE_NAMES)})")
        object.__setattr__(self, "lengthscale", tuple(check_float(f"lengthscale[{i}]", v, positive=True) for i, v in enumerate(self.lengthscale)))
        for name in ("signal_var", "noise", "log_std", "correlation"):
            object.__setattr__(self, name, check_float(name, getattr(self, name), positive=True))
        if not self.correlation < 1.0:
            raise ValidationError("correlation", self.correlation, "expected a correlation in (0, 1)")
        dof = math.inf if self.noise_dof is None else self.noise_dof
        if isinstance(dof, bool) or not isinstance(dof, numbers.Real) or math.isnan(dof) or not dof > 2:
            raise ValidationError("noise_dof", self.noise_dof, "expected degrees of freedom > 2 (inf: Gaussian noise)")
        object.__setattr__(self, "noise_dof", float(dof))
        if not is_collection(self.alternatives):
            raise ValidationError("alternatives", self.alternatives, "expected ((HyperPrior, log weight), ...)")
        checked = []
        for index, item in enumerate(self.alternatives):
            if not (is_collection(item) and len(item) == 2 and isinstance(item[0], HyperPrior) and not item[0].alternatives):
                raise ValidationError(f"alternatives[{index}]", item, "expected (HyperPrior without alternatives, log weight)")
            weight = check_float(f"alternatives[{index}].log_weight", item[1])
            if weight > 0:
                raise ValidationError(f"alternatives[{index}].log_weight", weight, "expected <= 0 (relative to this mode's)")
            checked.append((item[0], weight))
        object.__setattr__(self, "alternatives", tuple(checked))

    def modes(self) -> list[tuple[HyperPrior, float]]:
        """Every mode with its log weight: this one (0) and each alternative, with this one's spread and noise tails."""
        return [(replace(self, alternatives=()), 0.0),
                *((replace(alt, log_std=self.log_std, noise_dof=self.noise_dof), weight) for alt, weight in self.alternatives)]

    def initial(self, num_tasks: int, correlation: float | None = None) -> GPHyperparameters:
        """Hyperparameters at the prior's medians, types correlated by ``correlation`` (default: the prior's)."""
        rho = self.correlation if correlation is None else correlation
        w = math.sqrt(rho * self.signal_var)
        return GPHyperparameters(self.lengthscale, (w,) * num_tasks, ((1.0 - rho) * self.signal_var,) * num_tasks,
                                 max(self.noise, NOISE_FLOOR))

    def to_dict(self) -> dict[str, Any]:
        out = {"lengthscale": list(self.lengthscale), "signal_var": self.signal_var, "noise": self.noise, "log_std": self.log_std,
               "correlation": self.correlation, "noise_dof": None if math.isinf(self.noise_dof) else self.noise_dof}
        if self.alternatives:
            out["alternatives"] = [{"prior": alt.to_dict(), "log_weight": weight} for alt, weight in self.alternatives]
        return out

    @classmethod
    def from_dict(cls, data: Any) -> HyperPrior:
        if not isinstance(data, dict):
            raise ValidationError("gp_prior", data, "expected {lengthscale, signal_var, noise, log_std, correlation, noise_dof}")
        alternatives = data.get("alternatives") or []
        if not isinstance(alternatives, list) or not all(isinstance(a, dict) and {"prior", "log_weight"} <= set(a) for a in alternatives):
            raise ValidationError("alternatives", alternatives, "expected [{prior, log_weight}, ...]")
        return cls(tuple(data["lengthscale"]), data["signal_var"], data["noise"], data.get("log_std", 0.5),
                   data.get("correlation", DEFAULT_TASK_CORRELATION), data.get("noise_dof"),  # None: Gaussian
                   tuple((cls.from_dict(a["prior"]), a["log_weight"]) for a in alternatives))


def _task_matrix(hyper: GPHyperparameters) -> np.ndarray:
    """The task covariance with one more task, index ``hyper.num_tasks``, of zero variance: points of that task
    have no residual, only the linear part (measurements of the parameters alone, such as a measured compute
    time, :meth:`goodput.posterior.JobPosterior.condition`)."""
    task = hyper.task_covariance()
    out = np.zeros((task.shape[0] + 1, task.shape[1] + 1))
    out[:-1, :-1] = task
    return out


def covariance(
    hyper: GPHyperparameters,
    x1: np.ndarray,
    t1: np.ndarray,
    s1: np.ndarray,
    x2: np.ndarray,
    t2: np.ndarray,
    s2: np.ndarray,
) -> np.ndarray:
    """Prior covariance of the residual (without noise) between two sets of points.

    ``x``: features (N, D); ``t``: GPU-type indices (N,), ``hyper.num_tasks`` for a point without a residual
    (its linear part alone); ``s``: sensitivity features (N, P) of the linear parameter model (P may be 0).
    """
    ls = np.asarray(hyper.lengthscale, dtype=float)
    a = x1 / ls
    b = x2 / ls
    d2 = _sq_dist(a, np.einsum("ij,ij->i", a, a), b)
    task = _task_matrix(hyper)
    k = _kern(d2) * task[np.ix_(t1, t2)]
    if s1.shape[1]:
        k = k + s1 @ s2.T
    return k


def cholesky_with_jitter(k: np.ndarray, start: float = 0.0) -> tuple[np.ndarray, float]:
    """Lower Cholesky factor of ``k``, adding jitter (relative to its mean diagonal) until it factorises.

    Returns the factor and the absolute jitter added; raises :class:`GPNumericalError`.
    """
    if not np.all(np.isfinite(k)):
        raise GPNumericalError("covariance has non-finite entries")
    scale = float(np.mean(np.diag(k))) if k.size else 1.0
    if not scale > 0:
        scale = 1.0
    for rel in JITTERS:
        jitter = max(rel * scale, start)
        if rel and jitter <= start and start:
            continue
        try:
            factor = np.linalg.cholesky(k + jitter * np.eye(k.shape[0]) if jitter else k)
        except np.linalg.LinAlgError:
            continue
        if np.all(np.isfinite(factor)):
            return factor, jitter
    raise GPNumericalError(f"covariance of size {k.shape[0]} is not positive definite even with jitter {JITTERS[-1]:g}×{scale:.3g}")


@dataclass
class OnlinePosterior:
    """The GP posterior given training points, extended online by :meth:`condition`.

    Holds ``L`` with ``L Lᵀ = K + diag(σ² + d + j)`` and ``α = (L Lᵀ)⁻¹ y``, ``j`` the jitter each point took
    (0 unless its block would not factorise: the first block's, then each conditioned block's the jitter before it
    plus what its own Schur complement needed; :attr:`jitter` the largest). A point whose type index is
    ``hyper.num_tasks`` has no residual: it measures the linear part alone (its noise ``σ² + d``).
    Conditioning on m new points appends m rows to ``L`` (a block Cholesky
    update, O(n² m)); the hyperparameters stay fixed.

    Args:
        hyper: the GP hyperparameters.
        x, t, s, y: features, type indices, sensitivity features, residuals.
        extra_noise: per-point extra variance ``d`` (default 0).
    """

    hyper: GPHyperparameters
    x: np.ndarray
    t: np.ndarray
    s: np.ndarray
    y: np.ndarray
    extra_noise: np.ndarray | None = None
    jitter: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.x = np.asarray(self.x, dtype=float).reshape(len(self.y), -1)
        self.t = np.asarray(self.t, dtype=int).ravel()
        self.s = np.asarray(self.s, dtype=float).reshape(len(self.y), -1)
        self.y = np.asarray(self.y, dtype=float).ravel()
        d = np.zeros_like(self.y) if self.extra_noise is None else np.asarray(self.extra_noise, dtype=float).ravel()
        self.extra_noise = d
        k = covariance(self.hyper, self.x, self.t, self.s, self.x, self.t, self.s)
        k[np.diag_indices_from(k)] += self.hyper.noise + d
        self.L, self.jitter = cholesky_with_jitter(k)
        self._root_s: np.ndarray | None = None
        self._weights_cov: np.ndarray | None = None
        self._query_kernels: OrderedDict[Hashable, np.ndarray] = OrderedDict()  # cache_key -> k_M(X, x) (n', m), n' <= n
        self._refresh()

    def __len__(self) -> int:
        return len(self.y)

    def weights_cov(self) -> np.ndarray:
        """Posterior covariance of the linear part's weights δ (P, P): ``I − Vᵀ V`` with ``V = L⁻¹ S``.

        ``V`` is computed on first use and extended by :meth:`condition` (its new rows only).
        """
        if self._root_s is None:
            self._root_s = scipy.linalg.solve_triangular(self.L, self.s, lower=True, check_finite=False)
        if self._weights_cov is None:
            self._weights_cov = np.eye(self.s.shape[1]) - self._root_s.T @ self._root_s
        return self._weights_cov

    def _refresh(self) -> None:
        self.alpha = scipy.linalg.cho_solve((self.L, True), self.y, check_finite=False)
        # mean of the linear part's weights: the posterior mean of δ, E[δ] = Sᵀ α
        self.weights = self.s.T @ self.alpha
        ls = np.asarray(self.hyper.lengthscale, dtype=float)
        self._scaled_x = self.x / ls
        self._scaled_sq = (self._scaled_x**2).sum(1)
        self._task = _task_matrix(self.hyper)

    def condition(self, x: np.ndarray, t: np.ndarray, s: np.ndarray, y: np.ndarray, extra_noise: np.ndarray | None = None) -> None:
        """Add observations without refitting hyperparameters (block Cholesky update)."""
        y = np.asarray(y, dtype=float).ravel()
        m = len(y)
        if m == 0:
            return
        x = np.asarray(x, dtype=float).reshape(m, -1)
        t = np.asarray(t, dtype=int).ravel()
        s = np.asarray(s, dtype=float).reshape(m, -1)
        d = np.zeros(m) if extra_noise is None else np.asarray(extra_noise, dtype=float).ravel()
        k_old_new = self._cross(x, t, s)
        k_new = covariance(self.hyper, x, t, s, x, t, s)
        k_new[np.diag_indices_from(k_new)] += self.hyper.noise + d + self.jitter
        l12 = scipy.linalg.solve_triangular(self.L, k_old_new, lower=True, check_finite=False)
        schur = k_new - l12.T @ l12
        schur = 0.5 * (schur + schur.T)
        l22, extra_jitter = cholesky_with_jitter(schur)
        n = len(self.y)
        if self._root_s is not None:  # V's new rows: L22⁻¹ (S_new − L21 V)
            new_rows = scipy.linalg.solve_triangular(l22, s - l12.T @ self._root_s, lower=True, check_finite=False)
            self._root_s = np.vstack([self._root_s, new_rows])
        self._weights_cov = None
        big = np.zeros((n + m, n + m))
        big[:n, :n] = self.L
        big[n:, :n] = l12.T
        big[n:, n:] = l22
        self.L = big
        if extra_jitter:  # the new block absorbed more jitter: record it for diagnostics
            self.jitter = max(self.jitter, extra_jitter)
        self.x = np.vstack([self.x, x])
        self.t = np.concatenate([self.t, t])
        self.s = np.vstack([self.s, s])
        self.y = np.concatenate([self.y, y])
        self.extra_noise = np.concatenate([self.extra_noise, d])
        self._refresh()

    def _cross(self, x: np.ndarray, t: np.ndarray, s: np.ndarray) -> np.ndarray:
        """k(X_train, x): (n, m)."""
        k = self._query_kernel(x, None)  # a fresh array: scaled in place
        k *= self._task[np.ix_(self.t, t)]
        if self.s.shape[1]:
            k += self.s @ s.T
        return k

    def _query_kernel(self, x: np.ndarray, cache_key: Hashable | None) -> np.ndarray:
        """The Matérn part of k(X_train, x), (n, m). With ``cache_key``, kept for the next call with that key
        (the same ``x``: the caller's promise) and extended by the rows of the points conditioned on since:
        the hyperparameters are fixed, and :meth:`condition` only appends training points."""
        scaled = x / np.asarray(self.hyper.lengthscale, dtype=float)
        if cache_key is None:
            return _kern(_sq_dist(self._scaled_x, self._scaled_sq, scaled))
        kernel = self._query_kernels.get(cache_key)
        done = 0 if kernel is None else kernel.shape[0]
        if done < len(self.y):
            rows = _kern(_sq_dist(self._scaled_x[done:], self._scaled_sq[done:], scaled))
            kernel = rows if kernel is None else np.vstack([kernel, rows])
        keep_recent(self._query_kernels, cache_key, kernel, QUERY_CACHE_ENTRIES, QUERY_CACHE_BYTES)
        return kernel

    def predict_mean(self, x: np.ndarray, t: np.ndarray, s: np.ndarray | None = None, *,
                     cache_key: Hashable | None = None) -> np.ndarray:
        """Posterior mean of the residual at query points (the hot path: no variance).

        ``s=None`` leaves out the linear part (a caller that adds ``s @ weights`` itself, cheaper).
        ``cache_key`` (hashable) names the query set ``x`` for the next calls: its kernel against the
        training points is kept (the most recent sets, :data:`QUERY_CACHE_ENTRIES` and
        :data:`QUERY_CACHE_BYTES` at most), and each later call computes only the rows of the points
        conditioned on since (O(m) per new point, not O(n m)).
        """
        k = self._query_kernel(x, cache_key)
        # Σ_i k(x_i, x) B[t_i, t] α_i: the task covariance weighs α per query type, not the (n, m) kernel
        mean = np.empty(len(t))
        for task in np.unique(t):
            cols = t == task
            weighted = self.alpha * self._task[self.t, task]
            mean[cols] = weighted @ k if cols.all() else weighted @ k[:, cols]
        if s is not None and self.s.shape[1]:
            mean = mean + s @ self.weights
        return mean

    def predict(
        self, x: np.ndarray, t: np.ndarray, s: np.ndarray, *, noise: bool = True, extra_noise: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and variance of the residual; ``noise=True`` adds σ² (+ ``extra_noise``): a new measurement's spread."""
        x = np.asarray(x, dtype=float).reshape(len(t), -1)
        t = np.asarray(t, dtype=int).ravel()
        s = np.asarray(s, dtype=float).reshape(len(t), -1)
        k = self._cross(x, t, s)
        mean = k.T @ self.alpha
        v = scipy.linalg.solve_triangular(self.L, k, lower=True, check_finite=False)
        prior = self._task[t, t] + (np.einsum("ij,ij->i", s, s) if s.shape[1] else 0.0)
        var = np.maximum(prior - np.einsum("ij,ij->j", v, v), 1e-12)
        if noise:
            var = var + self.hyper.noise + (0.0 if extra_noise is None else np.asarray(extra_noise, dtype=float))
        return mean, var


def log_marginal_likelihood(post: OnlinePosterior) -> float:
    """log p(y) of the posterior's data under its hyperparameters (diagnostics)."""
    n = len(post.y)
    return float(-0.5 * post.y @ post.alpha - np.log(np.diag(post.L)).sum() - 0.5 * n * math.log(2 * math.pi))
