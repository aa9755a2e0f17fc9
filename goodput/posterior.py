"""The online posterior of one job: Pollux's mean, the hierarchical prior on its parameters, a GP residual.

A job's log step time on GPU type t at configuration x is modelled as

    log y = log T(u_t, x) + f(x, t) + ε,     u ~ prior (goodput.hierarchy),  f ~ GP,  ε ~ t_ν(0, σ²)

with ``T`` Pollux's form in the coordinates of :mod:`goodput.parametric`,
``f`` a Gaussian process with a Hadamard multitask kernel over GPU types
(:mod:`goodput.gp`) for what the form misses, and ``ε`` Student-t noise whose
degrees of freedom ν the cluster's residuals give (:attr:`goodput.gp.HyperPrior.noise_dof`;
∞, Gaussian, where they show no heavier tails). The t is a scale mixture of normals,
``ε ~ N(0, σ²/w)``: each step's weight ``w`` is its E-step (Lange, Little & Taylor,
*JASA* 84, 1989), at the MAP's residuals for the MAP and the GP's hyperparameters, then at
the GP's posterior (its latent variance counted) for the posterior and each step conditioned
online, so one step far off (a checkpoint's, a stalled loader's) weighs as the tails say
instead of pulling its configuration's prediction toward it.

A refit finds the maximum a posteriori ``û`` (:func:`goodput.parametric.fit_map`;
Pollux's soft maximum can give two optima, compute or sync explaining a step that
includes both, so a refit whose types changed also starts from the previous MAP
and the new types' prior mean given it, and keeps the lower objective)
and linearises ``T`` there (a Laplace approximation: MacKay, "Bayesian
interpolation", *Neural Computation* 4, 1992): with ``J`` the Jacobian of
``log T`` at ``û`` and the prior N(m, C = L Lᵀ), the model becomes Gaussian,

    log y − log T(û, x) − J(x)(m − û) = J(x) L z + f(x, t) + ε,    z ~ N(0, I),

a GP whose kernel adds the linear part ``J L (J L)ᵀ`` (every type's rows carry
the whole ``L``, so the prior's coupling of types through the job's shared
effect is exact conditioning, not a rule). Every observation, on any type,
conditions this one GP, so each type's parameters and residual learn from all
of them; :meth:`JobPosterior.condition` adds observations online (a block
Cholesky update, no refit), and a refit moves the linearisation point to the
new MAP. Predictions of log step time are normal: mean
``log T(û, x) + J(x)(m − û) + E[J L z + f]`` and the GP's variance plus ``σ²``,
with the parametric part's share of it taken by the unscented transform of ``log T``
over the coordinates' posterior instead of the linearisation's ``J Cov Jᵀ``
(:func:`goodput.parametric.unscented_log_step_time`: Pollux's form bends within the
spread; the 90% intervals' P4 coverage moved toward 90 on Pollux's traces, Gavel and the
derived sets, experiments/results/accuracy.md);
the noise's Student-t tails also widen the intervals of :class:`goodput.model.Prediction`
beyond the normal's (:mod:`goodput.tails`).

A step on several replicas whose sync was measured also gives its compute, ``(step − sync) / (a + 1)``
(``Observation.compute_time``; Pollux's fit reads it beside the step time: Qiao et al., OSDI'21, §3.2), whose
log is ``log C(û, x)`` plus noise of its own (Student-t, :data:`COMPUTE_DOF`, its scale estimated from its
residuals as σ is, so a wrong sync reading is weighed down): the MAP fits both, and the prior the GP's
linear part starts from is the prior conditioned on these compute times at ``û`` (the linear-Gaussian
update), so the step times' GP conditions what they leave of the compute/sync split. Where the step time
alone leaves that split to the prior (a type whose steps all include sync), the measured compute pins it
(on Pollux's traces, P3 6.8 → 6.6 and online P4 next 5.8 → 5.5, ``git show 5b43f24:experiments/results/accuracy.md``). Between
refits, :meth:`JobPosterior.condition` conditions the GP on new compute times too, as points without a residual
(the linear part alone).

The prior is Student-t in :mod:`goodput.hierarchy` (a scale mixture of
normals): the refit sets its scale from the job's own distance to it (E-steps
of Lange, Little & Taylor, *JASA* 84, 1989), so an unusual job widens its own
prior rather than being pulled to the cluster's typical one; one scale per
block of coordinates, compute and sync (:data:`goodput.hierarchy.SCALE_BLOCKS`,
as the cluster's EM weighs its jobs), so a job odd in its compute (Pollux's
host-bound ncf) keeps a typical job's prior on its sync (ncf's 90% intervals
on Pollux's P1: ±1.61 in log with one scale, ±0.84 with two). The GP's
hyperparameters (Matérn length scales, task covariance, noise) are fitted by
the exact marginal likelihood of gpytorch's model (computed in numpy,
:func:`goodput.gp_fit.fit_hyperparameters`) to the MAP's residuals, under a prior of
what the cluster's jobs show (:class:`goodput.gp.HyperPrior`; where the cluster's
likelihood has several modes, under each, the job's data and the modes' evidence
choosing: :func:`goodput.gp_fit.fit_hyperparameters_over_modes`), now and then.
If the covariance cannot be factorised even with jitter, the state falls back
to the parametric mean with an inflated log-std and says why (``reason``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import scipy.linalg
from scipy.special import ndtri

from .cells import compute_rows, step_rows
from .gp import QUERY_CACHE_ENTRIES, GPHyperparameters, GPNumericalError, HyperPrior, OnlinePosterior, config_features, keep_recent
from .gp_fit import fit_hyperparameters_over_modes
from .observations import Observation
from .parametric import (K, MapFit, Rows, fit_map, log_step_time, power_from_log, rebase_u, reference_bsz, sigma_points, stacked_log_compute_time,
                         theta_from_u, unscented_moments)
from .shifts import LevelShift, find_level_shift
from .sync_shape import SyncShape
from .tails import DEFAULT_NOISE_DOF, gaussian_t_cdf, split_std

__all__ = ["JobPosterior", "build_posterior", "prior_cholesky", "FALLBACK_LOG_STD", "DEFAULT_HYPER_PRIOR"]

FALLBACK_LOG_STD = 0.5  # std of log step time when the GP is unusable: a factor 2.3 at 90%
FIT_ITERATIONS = 60  # L-BFGS iterations of a hyperparameter fit
MAX_FIT_POINTS = 256  # hyperparameters are fitted on at most this many observations (random subset)
NOISE_PRIOR_WEIGHT = 5.0  # pseudo-observations of the cluster's residual std in the MAP's noise
NOISE_RANGE = (0.005, 0.5)
STEP_SCALE_ITERATIONS = 20  # EM steps of a Student-t step-noise scale at fixed residuals (_step_noise)
ONLINE_E_STEPS = 20  # EM steps of a point's weight conditioned online (_online_weights)
COMPUTE_DOF = 4.0  # degrees of freedom of a compute time's Student-t noise (Lange, Little & Taylor, JASA 84, 1989: ν = 4)
# Without a cluster: a residual ~5% (half smooth misfit of the form, half noise), length scales of 2
# doublings, each a factor e (log-std 1) either way, and the noise's tails Pollux's (goodput.tails.DEFAULT_NOISE_DOF).
DEFAULT_HYPER_PRIOR = HyperPrior((2.0,) * 6, 0.0015, 0.001, log_std=1.0, noise_dof=DEFAULT_NOISE_DOF)


def _shrunk(rms: float, n: int, prior: float) -> float:
    value = math.sqrt((n * rms**2 + NOISE_PRIOR_WEIGHT * prior**2) / (n + NOISE_PRIOR_WEIGHT))
    return min(max(value, NOISE_RANGE[0]), NOISE_RANGE[1])


@dataclass
class Design:
    """GP inputs of configurations on one type: features, task, linear part, parametric means of the log."""

    x: np.ndarray  # (N, 6)
    t: np.ndarray  # (N,)
    s: np.ndarray  # (N, KT): J L
    log_mean: np.ndarray  # (N,) log T(û) + J (m − û): the GP's prior mean
    log_map: np.ndarray  # (N,) log T(û)


@dataclass
class JobPosterior:
    """One refit's linearisation point, prior, hyperparameters and (online-updated) posterior."""

    types: list[str]
    u_hat: np.ndarray  # (T, K) MAP coordinates
    prior_mean: np.ndarray  # (T, K) the prior's mean conditioned on the measured compute times (_conditioned_on_compute)
    prior_chol: np.ndarray  # (KT, KT) lower Cholesky factor of that prior's covariance (its scale set by the job)
    shapes: dict[str, SyncShape | None]
    ref_bsz: float  # the job's reference micro-batch (goodput.parametric.reference_bsz)
    hyper: GPHyperparameters
    noise_std: float  # the MAP's residual std of log step time
    posterior: OnlinePosterior | None = None
    reason: str | None = None
    n_fit: int = 0  # observations the refit conditioned on
    gp_mode: int = 0  # which of the cluster's GP hyperprior modes the fit chose (goodput.gp.HyperPrior.modes; 0: its best)
    fallback_log_std: float = FALLBACK_LOG_STD
    noise_dof: float = math.inf  # the measurement noise's Student-t tails (goodput.tails; inf: Gaussian)
    compute_scale: float = 0.05  # the Student-t scale of a measured compute time's log noise (COMPUTE_DOF)
    window: list[Observation] = field(default_factory=list, repr=False)  # the step times the GP was built on, in its order
    z_sum: float = 0.0  # the signed z of the step times conditioned on since the refit (condition), summed
    z_count: int = 0  # ... and how many
    index: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.index = {t: i for i, t in enumerate(self.types)}
        self._offset = self.prior_mean - self.u_hat  # the prior mean's offset from the linearisation point
        self._chol_rows = [self.prior_chol[K * i:K * (i + 1)] for i in range(len(self.types))]
        self._sigma_of: np.ndarray | None = None  # the weights' covariance the cached sigma points are of
        self._sigma: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # per type: sigma points of u, their weights
        self._queries: OrderedDict[tuple, tuple[np.ndarray, ...]] = OrderedDict()  # log_mean's query sets (its docstring)

    def theta(self, gpu: str) -> np.ndarray:
        """Pollux's θ (PARAM_NAMES order) at the MAP on ``gpu`` (compute's terms those of its soft maximum: :meth:`compute_power`)."""
        return theta_from_u(self.u_hat[self.index[gpu]], self.ref_bsz)

    def compute_power(self, gpu: str) -> float:
        """The power ``p`` of the soft maximum that combines compute's two terms at the MAP on ``gpu`` (1: Pollux's sum)."""
        return float(power_from_log(self.u_hat[self.index[gpu], K - 1]))

    # ------------------------------------------------------------------ design
    def _rows(self, gpu: str, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray, accum: np.ndarray) -> Rows:
        shape = self.shapes.get(gpu)
        return Rows(nodes, replicas, bsz, accum, self.ref_bsz, None if shape is None else np.asarray(shape(nodes, replicas), dtype=float))

    def design(self, gpu: str, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray, accum: np.ndarray) -> Design:
        """GP inputs of configurations (flat float arrays) on ``gpu``."""
        return self._design(gpu, self._rows(gpu, nodes, replicas, bsz, accum))

    def _design(self, gpu: str, rows: Rows) -> Design:
        k = self.index[gpu]
        log_t, jac = log_step_time(self.u_hat[k], rows)
        return Design(config_features(rows.nodes, rows.replicas, rows.bsz, rows.accum), np.full(rows.nodes.size, k),
                      jac @ self._chol_rows[k], log_t + jac @ self._offset[k], log_t)

    def rows_of(self, observations: Sequence[Observation]) -> tuple[Design, np.ndarray]:
        """Design and targets (residuals of log step time around the GP's prior mean) of observations, in their order."""
        y = np.log([o.step_time for o in observations])
        parts = []
        for gpu in dict.fromkeys(o.gpu_type for o in observations):
            idx = np.array([i for i, o in enumerate(observations) if o.gpu_type == gpu])
            rows = Rows.of([observations[i] for i in idx], self.ref_bsz)
            parts.append((idx, self.design(gpu, rows.nodes, rows.replicas, rows.bsz, rows.accum)))
        order = np.concatenate([idx for idx, _ in parts])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        design = Design(*(np.concatenate([getattr(d, name) for _, d in parts])[inverse] for name in ("x", "t", "s", "log_mean", "log_map")))
        return design, y - design.log_mean

    def level_shift(self, at: float | None = None) -> LevelShift | None:
        """A change of the job's speed among the steps the GP was built on (:func:`goodput.shifts.find_level_shift`,
        ``at`` as there); ``None`` without one, without a posterior, or where a step has no timestamp."""
        if self.posterior is None or len(self.window) != len(self.posterior) or any(o.timestamp is None for o in self.window):
            return None
        # read with at least Pollux's tails: under near-Gaussian noise two stalled steps among the last three had read
        # as a change to 3x the speed (tests/test_level_shift.py), an E-step toward ν = 6 weighs them down
        post = self.posterior if self.noise_dof <= DEFAULT_NOISE_DOF else _reweighted(self.posterior, DEFAULT_NOISE_DOF)
        configs = [(o.gpu_type, o.num_nodes, o.num_replicas, o.local_bsz, o.accum_steps) for o in self.window]
        return find_level_shift(post.L, post.alpha, np.array([o.timestamp for o in self.window]), configs, at)

    # ------------------------------------------------------------------ prediction
    def log_mean(self, gpu: str, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray, accum: np.ndarray) -> np.ndarray:
        """Posterior mean of log step time (the hot path: no variance).

        The linear part's posterior mean is ``J L E[z]``: one K-vector per type, not the (N, KT) design.
        What the MAP fixes of a query set (its prediction, Jacobian, features) and the GP's kernel against
        the training points are kept for the :data:`goodput.gp.QUERY_CACHE_ENTRIES` most recent sets: a
        goodput table asks for the same candidates after every observation (``experiments/bench_model.py``).
        """
        k = self.index[gpu]
        if self.posterior is None:  # the fallback: the MAP's prediction
            return log_step_time(self.u_hat[k], self._rows(gpu, nodes, replicas, bsz, accum), jacobian=False)[0]
        key = (gpu,) + tuple((a.dtype.str, a.shape, a.tobytes()) for a in (nodes, replicas, bsz, accum))
        query = self._queries.get(key)
        if query is None:  # what the MAP fixes: its prediction, Jacobian and the GP's features
            log_t, jac = log_step_time(self.u_hat[k], self._rows(gpu, nodes, replicas, bsz, accum))
            query = (log_t, jac, config_features(nodes, replicas, bsz, accum), np.full(nodes.size, k))
        keep_recent(self._queries, key, query, QUERY_CACHE_ENTRIES)
        log_t, jac, features, tasks = query
        shift = self._offset[k] + self._chol_rows[k] @ self.posterior.weights
        with np.errstate(all="ignore"):
            out = log_t + jac @ shift + self.posterior.predict_mean(features, tasks, cache_key=key)
        return np.where(np.isfinite(out), out, log_t)

    def predict(self, gpu: str, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray,
                accum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and std of log step time of a new measurement (noise included)."""
        rows = self._rows(gpu, nodes, replicas, bsz, accum)
        d = self._design(gpu, rows)
        fallback = np.full(d.log_mean.shape, self.fallback_log_std)  # around the MAP's prediction
        if self.posterior is None:
            return d.log_map, fallback
        try:
            with np.errstate(all="ignore"):
                mu, var = self.posterior.predict(d.x, d.t, d.s, noise=True)
                # at least the noise a new measurement has around the parametric fit (the MAP's residual, shrunk
                # toward the cluster's): with few points the GP's noise fit takes noise for signal (10 noisy
                # steps: σ 0.017 against a residual of 0.115, and 33-56% of new measurements in 90% intervals)
                floor = max(self.posterior.hyper.noise, self.noise_std**2)
                var = np.maximum(var + self._unscented_correction(gpu, d, rows), floor)
        except (FloatingPointError, ValueError, np.linalg.LinAlgError):
            return d.log_map, fallback
        ok = np.isfinite(mu) & np.isfinite(var)
        return np.where(ok, d.log_mean + mu, d.log_map), np.where(ok, np.sqrt(np.maximum(var, 0.0)), fallback)

    def _unscented_correction(self, gpu: str, d: Design, rows: Rows) -> np.ndarray:
        """The parametric part's variance by the unscented transform minus the linearised one the GP holds (N,).

        Over the posterior of the type's coordinates, ``u ~ N(m + L E[δ], L Cov[δ] Lᵀ)``
        (:func:`goodput.parametric.unscented_log_step_time`); the GP's cross terms with the
        residual stay as they are (:meth:`predict` floors the total at the noise's variance).
        """
        assert self.posterior is not None
        k = self.index[gpu]
        weights_cov = self.posterior.weights_cov()
        if self._sigma_of is not weights_cov:  # the posterior moved (a refit's first question, an observation)
            self._sigma_of, self._sigma = weights_cov, {}
        if k not in self._sigma:
            cov_u = self._chol_rows[k] @ weights_cov @ self._chol_rows[k].T
            self._sigma[k] = sigma_points(self.prior_mean[k] + self._chol_rows[k] @ self.posterior.weights, cov_u)
        _, var_ut = unscented_moments(*self._sigma[k], rows)
        var_lin = np.einsum("ij,ij->i", d.s @ weights_cov, d.s)
        return np.where(np.isfinite(var_ut), var_ut - var_lin, 0.0)

    def noise_tails(self) -> tuple[float, float]:
        """Scale (std of log step time) and degrees of freedom of the measurement noise's Student-t, the part
        of :meth:`predict`'s std whose tails are heavier than a normal's: the GP's noise std (its core) and
        :attr:`noise_dof`; ``(0, inf)`` on the fallback."""
        if self.posterior is None:
            return 0.0, math.inf
        return math.sqrt(self.hyper.noise), self.noise_dof

    def normal_z(self, residual: np.ndarray, var: np.ndarray) -> np.ndarray:
        """|z| a normal would give residuals of log step time as far into the predictive's tails (variance
        ``var``, noise included): ``|r| / √var`` with Gaussian noise; with Student-t noise (:meth:`noise_tails`)
        ``−Φ⁻¹(P(X < −|r|))``, so an outlier the noise's tails expect is not a surprise."""
        sd = np.sqrt(np.maximum(var, 1e-300))
        noise, dof = self.noise_tails()
        if math.isinf(dof) or noise <= 0:
            return np.abs(residual) / sd
        tail = gaussian_t_cdf(-np.abs(residual), *split_std(sd, noise), dof)
        return -ndtri(np.clip(tail, 1e-300, 0.5))

    # ------------------------------------------------------------------ online
    def condition(self, observations: Sequence[Observation]) -> float:
        """Condition the posterior on observations of known types; returns the largest |z| before the update
        (and adds their signed z to :attr:`z_sum`, their count to :attr:`z_count`).

        Raises :class:`GPNumericalError` when the update cannot be factorised.
        """
        if self.posterior is None:
            raise GPNumericalError("no posterior to update")
        design, y = self.rows_of(observations)
        # the surprise reads the GP's own (linearised) variance, on every observation's path: read with the
        # unscented one (a probe on four folders), P4's median APE moved by at most 0.2 and its coverage by 1.0,
        # either way
        mu, var = self.posterior.predict(design.x, design.t, design.s, noise=True)
        z = self.normal_z(y - mu, var)
        self.z_sum += float(np.sum(np.sign(y - mu) * z))
        self.z_count += z.size
        # each one weighed by its E-step under the Student-t noise, as a refit weighs it (1 if Gaussian)
        sigma_sq = self.posterior.hyper.noise
        weights = _online_weights(y - mu, var - sigma_sq, sigma_sq, self.noise_dof)
        self.posterior.condition(design.x, design.t, design.s, y, extra_noise=sigma_sq * (1.0 / weights - 1.0))
        z_compute = self._condition_on_compute(observations)
        return float(max(np.max(z) if z.size else 0.0, z_compute))

    def _condition_on_compute(self, observations: Sequence[Observation]) -> float:
        """The measured compute times among ``observations`` (:func:`goodput.cells.compute_rows`) as points of
        the GP without a residual: their log is the linear part's ``log C(û) + J_C (u − û)`` plus Student-t noise of
        the refit's scale, as the refit's MAP and prior conditioning read them (each weighs as its residual at the
        MAP says, :func:`_compute_noise`'s E-step). Returns their largest ``|z|`` before the update (the refit's
        scale as their noise): a compute time far from the linearisation point is weighed down here, as an
        outlier would be, and it is the refit it calls for that reads it."""
        assert self.posterior is not None
        computes = _compute_groups(((self.index[gpu], [o for o in observations if o.gpu_type == gpu])
                                    for gpu in dict.fromkeys(o.gpu_type for o in observations)), self.ref_bsz)
        if not computes:
            return 0.0
        target = np.concatenate([y for _, _, y in computes])
        log_c, jac = stacked_log_compute_time(self.u_hat, computes)
        residual = target - log_c
        weight = _compute_weights(residual, self.compute_scale)
        y = residual - jac @ self._offset.ravel()
        x, t, s = np.zeros((y.size, self.posterior.x.shape[1])), np.full(y.size, self.posterior.hyper.num_tasks), jac @ self.prior_chol
        mu, var = self.posterior.predict(x, t, s, noise=False)
        z = np.abs(y - mu) / np.sqrt(var + self.compute_scale**2)
        self.posterior.condition(x, t, s, y, extra_noise=self.compute_scale**2 / weight - self.posterior.hyper.noise)
        return float(np.max(z))


def _recent_window(stamps: np.ndarray, gpu_types: np.ndarray, max_points: int) -> np.ndarray:
    """Indices of the ``max_points`` most recent observations, each type keeping its most recent few.

    A type whose observations are older than the others' keeps its ``max_points // (2 × types)``
    most recent ones, at least one (or all it has): without any, the GP would forget its residuals.
    With fewer points than types, the most recent alone.
    """
    order = np.argsort(stamps, kind="stable")
    types = np.unique(gpu_types)
    floor = max(1, max_points // (2 * len(types)))
    chosen = np.zeros(stamps.size, dtype=bool)
    for gpu in types if max_points >= len(types) else ():
        chosen[order[gpu_types[order] == gpu][-floor:]] = True
    newest_first = order[::-1]
    rest = newest_first[~chosen[newest_first]]
    chosen[rest[: max(0, max_points - int(chosen.sum()))]] = True
    return np.flatnonzero(chosen)


def _window(observations: Mapping[str, Sequence[Observation]], max_points: int) -> list[Observation]:
    """At most ``max_points`` observations for the GP: the most recent (by timestamp when all have one)."""
    obs = [o for t in observations for o in observations[t]]
    if len(obs) <= max_points:
        return obs
    stamps = np.array([o.timestamp if o.timestamp is not None else math.nan for o in obs])
    if np.isfinite(stamps).all():
        return [obs[i] for i in _recent_window(stamps, np.array([o.gpu_type for o in obs]), max_points)]
    per = {t: observations[t][-max(1, max_points * len(observations[t]) // len(obs)):] for t in observations}
    return [o for t in observations for o in per[t]]


def prior_cholesky(cov: np.ndarray) -> np.ndarray:
    """Lower Cholesky factor of a prior covariance over the job's coordinates (KT, KT).

    A covariance that rounding, or a nearly singular estimate of the cluster's (a correlation of job
    effects at its bound), left indefinite is made positive definite by flooring its eigenvalues at
    1e-9 of its largest variance, so a prediction never fails on the prior. Raises
    :class:`goodput.gp.GPNumericalError` on non-finite entries.
    """
    cov = np.asarray(cov, dtype=float)
    if not np.all(np.isfinite(cov)):
        raise GPNumericalError("the prior covariance has non-finite entries")
    cov = 0.5 * (cov + cov.T)
    eye = np.eye(cov.shape[0])
    try:
        return np.linalg.cholesky(cov + 1e-10 * eye)
    except np.linalg.LinAlgError:
        values, vectors = np.linalg.eigh(cov)
        floor = 1e-9 * max(float(np.max(np.diag(cov))), 1e-12)
        return np.linalg.cholesky((vectors * np.maximum(values, floor)) @ vectors.T + 1e-10 * eye)


def _carried_rows(previous: JobPosterior | None, types: Sequence[str], ref_bsz: float) -> dict[int, np.ndarray]:
    """The previous MAP's coordinates of the types it had, by index in ``types``, rewritten for the new
    reference batch (the same step times, :func:`goodput.parametric.rebase_u`)."""
    if previous is None:
        return {}
    return {k: rebase_u(previous.u_hat[previous.types.index(gpu)], previous.ref_bsz, ref_bsz)
            for k, gpu in enumerate(types) if gpu in previous.types}


def _coordinates(types: Sequence[int]) -> np.ndarray:
    """Positions of the listed types' coordinates in the job's type-major (KT,) vector."""
    return np.concatenate([np.arange(K * k, K * (k + 1)) for k in types])


def _pinned_rows(steps: Sequence[tuple[int, Rows, np.ndarray]], computes: Sequence[tuple[int, Rows, np.ndarray]],
                 pinned: Sequence[int], mean: np.ndarray, cov: np.ndarray, noise: float) -> dict[int, np.ndarray]:
    """The MAP of the types whose compute 1-replica steps pin (``pinned``), under their marginal prior, by index."""
    index = _coordinates(pinned)
    position = {k: i for i, k in enumerate(pinned)}
    sub = [(position[k], rows, y) for k, rows, y in steps if k in position]
    sub_computes = [(position[k], rows, y) for k, rows, y in computes if k in position]
    fit = fit_map(sub, mean[list(pinned)], prior_cholesky(cov[np.ix_(index, index)]), noise, computes=sub_computes)
    return {k: fit.u[i] for i, k in enumerate(pinned)}


def _conditional_start(known: Mapping[int, np.ndarray], mean: np.ndarray, cov: np.ndarray) -> np.ndarray | None:
    """``known`` rows as given, the other types at their prior mean given them (the Gaussian conditional).

    A type whose steps all include synchronisation is explained by its compute or by its sync (Pollux's soft
    maximum makes two basins). Started at the weak default mean, where the sync is half the compute, the fit
    grew the compute although the job's other type put its sync at 30x its compute: a 1-GPU step predicted
    100-300x too slow (found by ``tests/test_model.py``'s online property test). Started here, it begins where
    the job's other types point.
    """
    start = np.array(mean, dtype=float)
    for k, row in known.items():
        start[k] = row
    fresh = [k for k in range(start.shape[0]) if k not in known]
    if known and fresh:
        seen, unseen = _coordinates(list(known)), _coordinates(fresh)
        gain = np.linalg.lstsq(cov[np.ix_(seen, seen)], cov[np.ix_(seen, unseen)], rcond=1e-12)[0].T
        flat = start.ravel()
        flat[unseen] = mean.ravel()[unseen] + gain @ (flat[seen] - mean.ravel()[seen])
    return start if np.all(np.isfinite(start)) else None


def _map_fit(observations: Mapping[str, Sequence[Observation]], types: list[str], ref_bsz: float, mean: np.ndarray,
             chol: np.ndarray, shapes: Mapping[str, SyncShape | None], noise: float, initial: np.ndarray | None,
             residual_std: float, dof: float | None, cov: np.ndarray | None = None,
             carried: Mapping[int, np.ndarray] | None = None, blocks: Sequence[Sequence[int]] | None = None,
             step_dof: float = math.inf
             ) -> tuple[MapFit, float, np.ndarray, list[tuple[int, Rows, np.ndarray]], np.ndarray | None, float]:
    """The MAP under the prior, its noise re-estimated from its residuals and, with ``dof``, the prior's
    scale from the job's distance to it (Student-t prior as a scale mixture), one scale per block of
    coordinates (``blocks``, on every type; ``None``: one for all). Returns the fit, the noise,
    the prior's Cholesky factor used, the compute times' rows per type (:func:`goodput.cells.compute_rows`),
    each one's noise std (:func:`_compute_noise`; ``None`` without compute times) and that noise's scale (the
    prior's, shrunk as the step times' is, without them). The step times' noise is Student-t with ``step_dof``
    degrees of freedom (∞: Gaussian), each step weighed as its residual says (:func:`_step_noise`); the noise
    returned is its scale.

    Without ``initial``, the search also starts from :func:`_conditional_start` of ``carried`` (the
    previous MAP's types) or, cold, of the MAP of the types whose compute 1-replica steps pin; the
    optimum with the lowest objective wins."""
    steps = [(k, *step_rows(observations[gpu], ref_bsz, shapes.get(gpu))) for k, gpu in enumerate(types)]
    computes = _compute_groups(enumerate(observations[gpu] for gpu in types), ref_bsz)
    starts = []
    if initial is None and cov is not None:
        # a fresh fit's starts (the prior mean, and the types whose 1-replica steps pin their compute), and the
        # previous MAP's rows where given (``carried``): the lowest optimum wins
        pinned = [k for k, gpu in enumerate(types) if any(o.num_replicas == 1 for o in observations[gpu])]
        for known in ((_pinned_rows(steps, computes, pinned, mean, cov, noise) if 0 < len(pinned) < len(types) else {}),
                      dict(carried or {})):
            start = _conditional_start(known, mean, cov) if known else None
            if start is not None:
                starts.append(start)
    fit = fit_map(steps, mean, chol, noise, initial, starts, computes)
    robust = not math.isinf(step_dof)
    noise, step_std = _step_noise(fit.residuals, residual_std, step_dof)
    if robust:  # the steps weighed as their tails say, before anything else reads the fit
        fit = fit_map(steps, mean, chol, step_std, fit.u, computes=computes)
        noise, step_std = _step_noise(fit.residuals, residual_std, step_dof)
    compute_noise, scale = None, _shrunk(0.0, 0, residual_std)  # without compute times: the prior's scale
    if computes:
        # the compute times' own Student-t noise (an EM step here and one before each refit below), then the fit
        # and the step times' noise again: a misfit of Pollux's placement-free compute (contention on several
        # GPUs) or a wrong sync reading weighs its rows down instead of bending the fit (one compute time at 0.1%
        # of its step had taken the step times' noise from 0.03 to 0.23)
        scale = _shrunk(fit.compute_rms, fit.compute_n, residual_std)
        scale, compute_noise = _compute_noise(fit.u, computes, scale, residual_std)
        fit = fit_map(steps, mean, chol, step_std, fit.u, computes=computes, compute_noise_std=compute_noise)
    base_cov = chol @ chol.T
    base_prec = np.linalg.inv(base_cov)
    # each block's coordinates on every type and their marginal precision (their scale is the job's: a job odd in its
    # compute, host-bound, keeps its sync's prior as wide as a typical job's, as the cluster's EM weighs it,
    # goodput.hierarchy.SCALE_BLOCKS)
    offsets = K * np.arange(len(types))[:, None]
    indices = [(offsets + np.asarray(block)).ravel() for block in (blocks or (range(K),))]
    scaled = [(idx, np.linalg.inv(base_cov[np.ix_(idx, idx)])) for idx in indices]
    for _ in range(2 if dof is not None else 1):
        if computes or robust:
            noise, step_std = _step_noise(fit.residuals, residual_std, step_dof)
        if computes:
            scale, compute_noise = _compute_noise(fit.u, computes, scale, residual_std)
        if dof is not None:
            info = np.zeros_like(base_cov)
            row = 0
            for k, rows, y in steps:
                jac = log_step_time(fit.u[k], rows)[1] / step_std[row:row + y.size, None]
                info[K * k:K * (k + 1), K * k:K * (k + 1)] += jac.T @ jac
                row += y.size
            if computes:
                jac = stacked_log_compute_time(fit.u, computes)[1] / compute_noise[:, None]
                info += jac.T @ jac
            scale_sq = _prior_scales((fit.u - mean).ravel(), info, base_prec, scaled, dof)
            chol = prior_cholesky(base_cov * np.sqrt(np.outer(scale_sq, scale_sq)))
        fit = fit_map(steps, mean, chol, step_std, fit.u, computes=computes, compute_noise_std=compute_noise)
    if computes or robust:  # the step times' noise of the fit whose compute times are weighed as their noise says
        noise = _step_noise(fit.residuals, residual_std, step_dof)[0]
    return fit, noise, chol, computes, compute_noise, scale


def _prior_scales(delta: np.ndarray, info: np.ndarray, scale_prec: np.ndarray,
                  blocks: Sequence[tuple[np.ndarray, np.ndarray]], dof: float) -> np.ndarray:
    """One E-step of a Student-t prior's scale per block (Lange, Little & Taylor, *JASA* 84, 1989): each
    coordinate's variance factor ``1 / E[w] = (ν + E[δᵀ C⁻¹ δ]) / (ν + p)`` over its block (``blocks``: the
    block's indices and ``C⁻¹``, the inverse of its marginal in the t's scale matrix; p its size), the
    expectation over ``δ = u − m`` at the MAP ``δ`` with the spread ``(H + S⁻¹)⁻¹`` (``info`` H the data's
    information, ``scale_prec`` S⁻¹ the scale matrix's inverse).

    The spread is taken under the scale matrix, not under the prior the last E-step scaled: a direction the
    data do not inform then adds its p to the quadratic form, as its share of the prior's spread, and leaves
    the weight alone, as it leaves the marginal likelihood of the data. Under the scaled prior (mean-field
    variational Bayes) such directions feed the last factor back, ``s = (ν + q + s·p_u) / (ν + p)``, and an
    odd job's prior widens at every step: a one-batch-size type then fell into the flat basin of its compute
    (``experiments/data/profiles``' zoo-resnet on the CPU, P5 18% → 93%; Zeus's deepspeech2 P5 5.5% → 14.5%)."""
    post = np.linalg.inv(info + scale_prec)
    scale_sq = np.ones(delta.size)
    for idx, prec in blocks:
        quad = float(delta[idx] @ prec @ delta[idx] + np.trace(prec @ post[np.ix_(idx, idx)]))
        scale_sq[idx] = (dof + quad) / (dof + idx.size)
    return scale_sq


def _t_weights(residual_sq: np.ndarray, scale: float, dof: float) -> np.ndarray:
    """E-step weights ``w = (ν + 1) / (ν + E[r²] / s²)`` of residuals under Student-t noise of scale ``s`` and ``dof`` ν
    (Lange, Little & Taylor, *JASA* 84, 1989): a point's std in the normal it mixes is ``s / √w``. All 1 for
    Gaussian noise (ν = ∞) and without noise (``s`` 0: no point to weigh)."""
    if math.isinf(dof) or not scale > 0.0:
        return np.ones_like(residual_sq)
    return (dof + 1.0) / (dof + residual_sq / scale**2)


def _online_weights(residual: np.ndarray, latent_var: np.ndarray, sigma_sq: float, dof: float) -> np.ndarray:
    """E-step weights (:func:`_t_weights`) of new points, each at the posterior that includes it: with ``r`` its
    residual and ``v`` the latent variance of the GP's prediction before it, the posterior given it and the noise
    ``σ² / w`` leaves ``(y − E f) = s r`` and ``Var f = s v``, ``s = (σ² / w) / (v + σ² / w)``; the weight is
    iterated to its fixed point (EM on the one point, :data:`ONLINE_E_STEPS`). A step far from what the job's data
    pin is weighed down; a step where they pin nothing (``v`` ≫ σ²: a regime it had not run) is not, as the
    prediction before it says nothing against it. A non-finite residual is read as 0 (the update then fails as it
    did, and a refit reads it)."""
    residual = np.where(np.isfinite(residual), residual, 0.0)
    latent_var = np.where(np.isfinite(latent_var), np.maximum(latent_var, 0.0), 0.0)
    weights = np.ones_like(residual)
    if math.isinf(dof):
        return weights
    for _ in range(ONLINE_E_STEPS):
        noise = sigma_sq / weights
        share = noise / (latent_var + noise)
        weights = _t_weights((share * residual) ** 2 + share * latent_var, math.sqrt(sigma_sq), dof)
    return weights


def _compute_weights(residual: np.ndarray, scale: float) -> np.ndarray:
    """:func:`_t_weights` of log compute residuals under their Student-t noise (:data:`COMPUTE_DOF`)."""
    return _t_weights(residual**2, scale, COMPUTE_DOF)


def _step_noise(residuals: np.ndarray, residual_std: float, dof: float) -> tuple[float, np.ndarray]:
    """The step times' noise at a fit's log residuals: its scale (shrunk toward the cluster's residual std,
    :func:`_shrunk`) and each step time's std (n,).

    Gaussian (``dof`` ∞): the residuals' RMS, the same std for all. Student-t: the scale at the fixed point of
    EM's ``s² = mean(w r²)`` (:func:`_t_weights` at ``s``, from the RMS), and each step's std in the normal it
    mixes, ``s / √w``: one step far off (a checkpoint's, a stalled loader's) weighs as the tails the cluster's
    residuals show say (:class:`goodput.gp.HyperPrior.noise_dof`), instead of pulling the fit and the noise
    toward it."""
    n = residuals.size
    sq = residuals**2
    scale = _shrunk(math.sqrt(float(np.mean(sq))) if n else 0.0, n, residual_std)
    if math.isinf(dof) or not n:
        return scale, np.full(n, scale)
    return _t_noise(sq, scale, residual_std, dof, STEP_SCALE_ITERATIONS)


def _t_noise(residual_sq: np.ndarray, scale: float, residual_std: float, dof: float, steps: int) -> tuple[float, np.ndarray]:
    """``steps`` EM steps of a Student-t noise's scale from ``scale``, ``s² = mean(w r²)`` shrunk toward
    ``residual_std`` (:func:`_shrunk`), and each residual's std in the normal it mixes, ``s / √w``."""
    for _ in range(steps):
        scale = _shrunk(math.sqrt(float(np.mean(_t_weights(residual_sq, scale, dof) * residual_sq))), residual_sq.size, residual_std)
    return scale, scale / np.sqrt(_t_weights(residual_sq, scale, dof))


def _compute_groups(groups: Iterable[tuple[int, Sequence[Observation]]], ref_bsz: float) -> list[tuple[int, Rows, np.ndarray]]:
    """``(type index, rows, log compute times)`` of each type's measured compute times
    (:func:`goodput.cells.compute_rows`), the types without any left out."""
    out = []
    for k, observations in groups:
        rows, y = compute_rows(observations, ref_bsz)
        if y.size:
            out.append((k, rows, y))
    return out


def _compute_noise(u: np.ndarray, computes: Sequence[tuple[int, Rows, np.ndarray]], scale: float,
                   residual_std: float) -> tuple[float, np.ndarray]:
    """One EM step of the compute times' Student-t noise at ``u``: its scale (shrunk as the step times' noise
    is) and each compute time's std in the normal it is a scale mixture of, ``scale / √w`` with
    ``w = (ν + 1) / (ν + r² / scale²)`` (Lange, Little & Taylor 1989), in the order of ``computes``' rows."""
    r = np.concatenate([y for _, _, y in computes]) - stacked_log_compute_time(u, computes)[0]
    r = np.where(np.isfinite(r), r, 0.0)
    return _t_noise(r**2, scale, residual_std, COMPUTE_DOF, 1)


def _conditioned_on_compute(u_hat: np.ndarray, mean: np.ndarray, chol: np.ndarray, computes: Sequence[tuple[int, Rows, np.ndarray]],
                            noise: float | np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The prior N(m, L Lᵀ) conditioned on the measured compute times, linearised at the MAP ``û``: mean (T, K)
    and lower Cholesky factor (KT, KT).

    With ``g`` the log compute times, ``J`` their Jacobian at ``û`` and ``Σ`` their noise's covariance
    (diagonal: ``noise``², one per compute time or one for all), the linear-Gaussian update (Bishop 2006,
    §2.3.3) has precision ``C⁻¹ + Jᵀ Σ⁻¹ J`` and mean ``m + C Jᵀ (J C Jᵀ + Σ)⁻¹ (y − g(û) − J (m − û))``. The step
    times then condition the GP as before, so the two kinds of measurement enter one linearised likelihood.
    """
    if not computes or noise is None:
        return mean, chol
    dim = chol.shape[0]
    log_c, jac = stacked_log_compute_time(u_hat, computes)
    target = np.concatenate([y for _, _, y in computes]) - log_c - jac @ (mean - u_hat).ravel()
    scale = np.broadcast_to(np.asarray(noise, dtype=float), target.shape)
    s = (jac @ chol) / scale[:, None]  # Σ^(-1/2) J L
    # in the whitened coordinates z (u = m + L z): N(0, I) conditioned on s z + ε = target / scale, ε ~ N(0, I)
    cov_z = np.linalg.inv(s.T @ s + np.eye(dim))
    cov_z = 0.5 * (cov_z + cov_z.T)
    mean_z = cov_z @ (s.T @ (target / scale))
    new_mean = mean + (chol @ mean_z).reshape(mean.shape)
    return new_mean, prior_cholesky(chol @ cov_z @ chol.T)


def build_posterior(
    observations: Mapping[str, Sequence[Observation]],
    prior_mean: np.ndarray,
    prior_cov: np.ndarray,
    shapes: Mapping[str, SyncShape | None],
    previous: JobPosterior | None = None,
    hyper: GPHyperparameters | None = None,
    *,
    hyper_prior: HyperPrior = DEFAULT_HYPER_PRIOR,
    prior_dof: float | None = None,
    prior_blocks: Sequence[Sequence[int]] | None = None,
    fit_hyper: bool = True,
    max_points: int = 1024,
    seed: int = 0,
) -> JobPosterior:
    """A refit: the MAP of every type's coordinates, then the GP on all observations (hyperparameters refitted when asked).

    ``prior_mean`` (T, K), ``prior_cov`` (KT, KT): the prior over the job's coordinates on its types,
    in the order of ``observations``; ``prior_dof``: the degrees of freedom of a Student-t prior
    (:data:`goodput.hierarchy.EFFECT_DOF`) whose scale the job's own distance from it sets (``None``:
    the Gaussian prior as given), one scale per block of coordinates ``prior_blocks`` (indices into the K
    coordinates, on every type: :data:`goodput.hierarchy.SCALE_BLOCKS`; ``None``: one scale for all).
    ``hyper_prior``: what a job's residual GP typically looks like on this cluster
    (:attr:`goodput.hierarchy.ClusterPrior.gp_prior`, else weak defaults): the prior of the GP's hyperparameters
    and, through its variance, of the MAP's noise; few observations cannot estimate them.
    ``hyper``: hyperparameters (another job's) that a fit also starts from, and that stand until one (else the
    previous refit's, else the prior's medians). A fit always starts from the prior's medians, so the
    hyperparameters are a function of the observations, not of when the model was asked.
    """
    types = list(observations)
    ref_bsz = reference_bsz([o for t in types for o in observations[t]])
    residual_std = math.sqrt(hyper_prior.signal_var + hyper_prior.noise)
    chol = prior_cholesky(prior_cov)
    # A refit on the same types is a fresh fit (its noise from the prior's, its starts a fresh fit's): the
    # previous fit's noise and MAP as its only start had made each refit of the same observations move a
    # prediction's std by up to 1%, and a service's model differ from the one a restart rebuilds. Where the
    # types changed, the previous MAP's rows are one more start.
    same = previous is not None and previous.types == types
    fit, noise, chol, computes, compute_noise, compute_scale = _map_fit(
        observations, types, ref_bsz, prior_mean, chol, shapes, residual_std, None, residual_std, prior_dof, prior_cov,
        None if same else _carried_rows(previous, types, ref_bsz), prior_blocks, hyper_prior.noise_dof)
    prior_mean, chol = _conditioned_on_compute(fit.u, prior_mean, chol, computes, compute_noise)
    cold = hyper_prior.initial(len(types)).for_types(types)  # the prior's medians
    start = hyper if hyper is not None else (previous.hyper if previous is not None else None)
    start = cold if start is None else start.for_types(types)  # kept as they are when not fitted now
    state = JobPosterior(types, fit.u, prior_mean, chol, dict(shapes), ref_bsz, start, noise, noise_dof=hyper_prior.noise_dof,
                         compute_scale=compute_scale)
    state.window = _window(observations, max_points)
    design, y = state.rows_of(state.window)
    state.n_fit = y.size
    rms = float(np.sqrt(np.mean(y**2))) if y.size else 0.0
    state.fallback_log_std = max(FALLBACK_LOG_STD, 3.0 * rms) if np.isfinite(rms) else FALLBACK_LOG_STD
    if not np.all(np.isfinite(y)):
        state.reason = "non-finite residuals"
        return state
    dof = hyper_prior.noise_dof
    # each step's E-step weight under the Student-t noise, at the MAP's residuals and scale first (all 1 if Gaussian)
    weights = _t_weights((y + design.log_mean - design.log_map) ** 2, noise, dof)
    if fit_hyper and y.size >= 4:
        # The GP models what Pollux's form misses at the MAP: its hyperparameters are fitted to the MAP's
        # residuals. (Fitted to the residuals around the prior mean, with the linear part, a job far from
        # the cluster's typical one would have its prior's miss read as residual structure.)
        idx = np.arange(y.size)
        if idx.size > MAX_FIT_POINTS:
            idx = np.sort(np.random.default_rng(seed).choice(idx, MAX_FIT_POINTS, replace=False))
        at_map = y[idx] + design.log_mean[idx] - design.log_map[idx]
        # Fitted from the prior's medians every time, not from the previous refit's optimum: a warm start
        # kept a refit near the optimum of the fewer points an earlier fit saw, so the model depended on when
        # it had been asked (3.4-26% apart on the same observations) and a service's model rebuilt after a
        # restart differed from the one it had updated online. Given ``hyper`` (another job's), both start.
        # Under each of the cluster's modes where it has several (goodput.gp.HyperPrior.alternatives), the job's data
        # and the modes' weights choosing.
        state.hyper, state.gp_mode = fit_hyperparameters_over_modes(
            design.x[idx], design.t[idx], np.zeros((idx.size, 0)), at_map, cold if hyper is None else start, hyper_prior,
            max_iter=FIT_ITERATIONS, restarts=[] if hyper is None else [(cold, FIT_ITERATIONS)], noise_scale=1.0 / weights[idx])
    try:
        state.posterior = _weighted_posterior(state.hyper, design, y, weights)
        if not math.isinf(dof):
            # the E-step again, at the GP's posterior: a residual the GP explains (the form's misfit, smooth over
            # configurations) is no outlier (Lange, Little & Taylor 1989; the GP's own latent variance counted)
            state.posterior = _reweighted(state.posterior, dof)
    except GPNumericalError as exc:
        state.reason = f"GP not positive definite: {exc}"
    return state


def _weighted_posterior(hyper: GPHyperparameters, design: Design, y: np.ndarray, weights: np.ndarray) -> OnlinePosterior:
    """The GP posterior of residuals ``y`` at ``design`` with each point's noise ``σ² / w`` (its E-step weight)."""
    return OnlinePosterior(hyper, design.x, design.t, design.s, y, extra_noise=hyper.noise * (1.0 / weights - 1.0))


def _reweighted(post: OnlinePosterior, dof: float) -> OnlinePosterior:
    """The posterior of the same points with each point's noise ``σ² / w`` at its E-step under it (:func:`_gp_weights`)."""
    return OnlinePosterior(post.hyper, post.x, post.t, post.s, post.y, extra_noise=post.hyper.noise * (1.0 / _gp_weights(post, dof) - 1.0))


def _gp_weights(post: OnlinePosterior, dof: float) -> np.ndarray:
    """E-step weights (:func:`_t_weights`) of a posterior's training points under Student-t noise of scale σ (the GP's
    noise): ``E[(y − f)²] = (y − E f)² + Var f``, from the noise's share of α (``y − E f = D α``, ``D`` each point's
    noise variance) and the diagonal of ``(K + D)⁻¹`` (``Var f = d − d² (K + D)⁻¹ᵢᵢ``)."""
    noise = post.hyper.noise + post.extra_noise
    inverse_l, _ = scipy.linalg.lapack.dtrtri(post.L, lower=1)  # L⁻¹ (a third of a triangular solve against I)
    inverse_diag = np.sum(inverse_l**2, axis=0)
    latent_var = np.maximum(noise - noise**2 * inverse_diag, 0.0)
    return _t_weights((noise * post.alpha) ** 2 + latent_var, math.sqrt(post.hyper.noise), dof)
