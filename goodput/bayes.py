"""The Bayesian layer of a job's model: Pollux mean × GP residual, per refit.

A :class:`BayesState` is what one refit of :class:`goodput.model.JobModel`
produces: per GPU type the prior mean (the type's own Pollux fit in regimes it
has been observed in, an ensemble of transferred sync profiles elsewhere:
:class:`goodput.transfer.TypeTransfer`), the GP hyperparameters and the
posterior (:mod:`goodput.gp`). Between refits it answers predictions and
conditions on new observations online.

The log step time of a configuration on GPU type t is predicted as::

    log T = m_t(x) + r(x, t),   r ~ GP posterior (mean μ, variance σ²)

and returned as the median ``exp(m_t(x) + μ)`` with the standard deviation of
its logarithm ``sqrt(f_t² u_t (σ² + noise) + d + v_fit)``: ``d`` is the ensemble's
variance (plus a structural term) in regimes the type has not been observed in,
``v_fit`` the delta-method variance of the type's own fitted parameters (its
information takes each observation conditioned between refits), and
``f_t ≥ 1`` widens the interval to a Student-t's while the type has few residual
degrees of freedom ν (observations minus identified parameter groups, plus
:data:`RESIDUAL_PRIOR_DOF`): ``f_t = t_ν(0.95) / z(0.95)``, the predictive of a
residual scale estimated from ν degrees of freedom (Gelman et al., *Bayesian
Data Analysis*, §3.2), matched at the 90% interval. ``u_t = n / (n − p)`` corrects
the GP's scale for the residuals it was fitted to: those of the type's own fit,
which spent p identified parameter groups on its n observations, so their scatter
is a new observation's × (n − p) / n (the unbiased residual variance, as in
restricted maximum likelihood; Patterson & Thompson, *Biometrika* 58, 1971).

If the GP cannot be factorised even with jitter, the state falls back to the
parametric prediction with an inflated log-std (:data:`FALLBACK_LOG_STD` or 3×
the residual RMS, whichever is larger) and records why in ``reason``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import scipy.stats

from .gp import (
    GPHyperparameters,
    GPNumericalError,
    OnlinePosterior,
    config_features,
    fit_hyperparameters,
)
from .observations import Observation, indices_by_gpu_type
from .regimes import config_regime
from .throughput import ThroughputParams, _step_time, throughput_arrays
from .transfer import GROUPS, IDENTIFIED_LOG_STD, SPLIT_BOUNDS, TypeTransfer, sensitivities

__all__ = ["BayesState", "build_state", "FALLBACK_LOG_STD"]

FALLBACK_LOG_STD = 0.5  # std of log step time when the GP is unusable: a factor 2.3 at 90%
COLD_FIT_ITERATIONS = 60  # L-BFGS iterations of a first hyperparameter fit
WARM_REFIT_ITERATIONS = 15  # ... and of a refit warm-started from the previous hyperparameters
MAX_FIT_POINTS = 256  # hyperparameters are fitted on at most this many points (random subset)
T_PREDICTIVE = True  # Student-t intervals while a type has few residual degrees of freedom (see the module docstring)
RESIDUAL_PRIOR_DOF = 2.0  # pseudo-observations of the prior residual variance (Laplace covariance, Student-t)
_G = len(GROUPS)
_COMPUTE = [GROUPS.index("alpha_c"), GROUPS.index("beta_c")]
_OWN_SYNC = [GROUPS.index("sync"), GROUPS.index("gamma")]


@functools.lru_cache(maxsize=512)
def _t_factor(dof: float) -> float:
    return float(scipy.stats.t.ppf(0.95, dof) / scipy.stats.norm.ppf(0.95))


def split_feature(transfer: TypeTransfer, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray,
                  accum: np.ndarray) -> np.ndarray:
    """Change of log step time per prior std of the compute split, for a type seen at one batch size.

    One local batch size b₀ fixes the compute time c₀ = α_c + β_c·b₀ but not its
    split f = α_c / c₀ (its prior comes from the job's other types). The GP
    carries the split as a linear part with weight ~ N(0, 1) on this feature:
    the central difference of log T over f·e^{±σ} (σ the split's log-std, f
    kept inside (0, 1)), a statistical linearisation (Särkkä, *Bayesian
    Filtering and Smoothing*, 2013, §5.3). The tangent ∂ log T / ∂ log f · σ
    that it replaces grows like b / b₀, without bound: at f near 1 (compute
    that barely grows with the batch) it predicted e^80 s at 500 b₀ after a
    few observations at 2–6 b₀. The difference stays within what a split can
    do: between c₀ and c₀·b/b₀ for b > b₀.
    """
    theta = transfer.theta
    b0, sigma = transfer.regimes.bsz0, transfer.alpha_c_log_std
    c0 = theta[0] + theta[1] * b0
    f = theta[0] / c0
    factor = transfer.shape(nodes, replicas) if transfer.shape is not None else None
    logs = []
    for sign in (1.0, -1.0):
        moved = theta.copy()
        split = min(max(f * math.exp(sign * sigma), SPLIT_BOUNDS[0]), SPLIT_BOUNDS[1])
        moved[0], moved[1] = split * c0, (1.0 - split) * c0 / b0
        logs.append(np.log(_step_time(moved, nodes, replicas, bsz, accum, factor)))
    return (logs[0] - logs[1]) / 2.0


@dataclass
class Design:
    """GP inputs of a set of configurations on one type."""

    x: np.ndarray  # (N, D) features
    t: np.ndarray  # (N,) type index
    s: np.ndarray  # (N, P) sensitivities × prior stds of the unidentified groups (the GP's linear part)
    d: np.ndarray  # (N,) structural variance
    log_mean: np.ndarray  # (N,) log Pollux step time
    s_id: np.ndarray  # (N, G) sensitivities × prior stds of the identified groups of this type


@dataclass
class BayesState:
    """One refit's mean, priors, hyperparameters and (online-updated) posterior."""

    types: list[str]
    transfers: dict[str, TypeTransfer]
    hyper: GPHyperparameters
    posterior: OnlinePosterior | None
    fallback_log_std: float = FALLBACK_LOG_STD
    reason: str | None = None
    n_fit: int = 0  # observations the refit used
    index: dict[str, int] = field(init=False)
    cov_id: dict[str, np.ndarray] = field(default_factory=dict)  # posterior covariance of identified groups (whitened)
    info_id: dict[str, np.ndarray] = field(default_factory=dict)  # ... its inverse, the information, updated online
    r2_id: dict[str, float] = field(default_factory=dict)  # ... the residual variance it was built with (log² units)
    dof: dict[str, float] = field(default_factory=dict)  # per type: residual degrees of freedom (observations - identified groups)
    # per type whose residuals the hyperparameters were fitted to: n / (n - p), the factor from their
    # in-sample scatter (its own fit spent p identified groups on them) to a new observation's
    unbias: dict[str, float] = field(default_factory=dict)
    # per type and regime index: factor on the log-std of configurations in that regime when the
    # type has not been observed in it, from the cluster's calibrations (ClusterPrior.cold_calibration
    # for cold jobs, ClusterPrior.warm_calibration for jobs that have run multi-GPU)
    regime_scale: dict[str, dict[int, float]] = field(default_factory=dict)
    _id: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        self.index = {t: i for i, t in enumerate(self.types)}
        self._id = {}
        for t in self.types:
            unidentified = self.transfers[t].regimes.unidentified()
            self._id[t] = np.array([0.0 if g in unidentified else IDENTIFIED_LOG_STD for g in GROUPS])

    @property
    def means(self) -> dict[str, ThroughputParams]:
        return {t: tr.params for t, tr in self.transfers.items()}

    @property
    def num_sens(self) -> int:
        return _G * len(self.types)

    def design(self, gpu: str, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray, accum: np.ndarray,
               variance: bool = True) -> Design:
        """GP inputs; ``variance=False`` skips what only the variance needs (the identified groups' sensitivities)."""
        nodes, replicas, bsz, accum = (np.asarray(a, dtype=float).ravel() for a in np.broadcast_arrays(nodes, replicas, bsz, accum))
        k = self.index[gpu]
        transfer = self.transfers[gpu]
        log_mean, d, covered = transfer.predict_log(nodes, replicas, bsz, accum)
        linear = transfer.regimes.one_bsz and transfer.alpha_c_log_std
        s = np.zeros((nodes.size, self.num_sens))
        if linear:
            s[:, _G * k] = split_feature(transfer, nodes, replicas, bsz, accum)
        if not variance:
            return Design(config_features(nodes, replicas, bsz, accum), np.full(nodes.size, k), s, d, log_mean, np.zeros((nodes.size, _G)))
        sens = sensitivities(transfer.theta, nodes, replicas, bsz, accum, transfer.shape)
        s_id = sens * self._id[gpu] * self._carried(transfer, nodes, replicas, covered)
        return Design(config_features(nodes, replicas, bsz, accum), np.full(nodes.size, k), s, d, log_mean, s_id)

    def design_observations(self, observations: Sequence[Observation]) -> tuple[Design, np.ndarray]:
        """Design of observations (any mix of known types) and their residuals, in input order."""
        parts: list[tuple[np.ndarray, Design]] = []
        y_all = np.empty(len(observations))
        for gpu, rows in indices_by_gpu_type(observations).items():
            cols = throughput_arrays([observations[i] for i in rows])
            design = self.design(gpu, cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"])
            y_all[rows] = np.log(cols["step_time"]) - design.log_mean
            parts.append((np.asarray(rows), design))
        order = np.concatenate([rows for rows, _ in parts])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        merged = Design(
            x=np.vstack([p.x for _, p in parts])[inverse],
            t=np.concatenate([p.t for _, p in parts])[inverse],
            s=np.vstack([p.s for _, p in parts])[inverse],
            d=np.concatenate([p.d for _, p in parts])[inverse],
            log_mean=np.concatenate([p.log_mean for _, p in parts])[inverse],
            s_id=np.vstack([p.s_id for _, p in parts])[inverse],
        )
        return merged, y_all

    def t_factor(self, gpu: str) -> float:
        """Ratio of the Student-t quantile (the type's residual degrees of freedom) to the normal one at 95%."""
        if not T_PREDICTIVE:
            return 1.0
        return _t_factor(RESIDUAL_PRIOR_DOF + self.dof.get(gpu, 0.0))

    @staticmethod
    def _carried(transfer: TypeTransfer, nodes: np.ndarray, replicas: np.ndarray, covered: np.ndarray) -> np.ndarray:
        """(N, G) weights of the own fit's identified groups in each prediction's mean (sensitivity scale).

        Observed regimes: 1 (the own fit is the mean). Unobserved ones: the compute groups
        (every member carries the own compute terms) and, with weight √w, the sync and γ groups
        where members of total weight w carry the own sync terms (``TypeTransfer.inherited``).
        """
        out = np.where(covered[:, None], 1.0, 0.0) * np.ones((1, _G))
        if covered.all():
            return out
        out[np.ix_(~covered, _COMPUTE)] = 1.0
        if transfer.inherited:
            regime = config_regime(nodes, replicas)
            for r, weight in transfer.inherited.items():
                rows = ~covered & (regime == r)
                out[np.ix_(rows, _OWN_SYNC)] = math.sqrt(weight)
        return out

    def _id_var(self, gpu: str, design: Design) -> np.ndarray:
        """Delta-method variance of the Pollux fit's identified parameters at the query points."""
        cov = self.cov_id.get(gpu)
        if cov is None:
            return np.zeros(design.log_mean.shape)
        return np.einsum("ij,jk,ik->i", design.s_id, cov, design.s_id)

    def _borrowed_var(self, gpu: str, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray, accum: np.ndarray) -> np.ndarray:
        """Delta-method variance of another type's fitted sync terms and γ where members carry them.

        A type without multi-GPU data takes its multi-node predictions partly from the job's own
        fit on another type (``TypeTransfer.borrowed``: weight w of members per such type): the
        uncertainty of that fit's sync and γ groups (its :attr:`cov_id`) carries over with weight
        √w, as :meth:`_carried` does for a type's own fit.
        """
        nodes, replicas, bsz, accum = (np.asarray(a, dtype=float).ravel() for a in np.broadcast_arrays(nodes, replicas, bsz, accum))
        out = np.zeros(nodes.size)
        transfer = self.transfers[gpu]
        if not transfer.borrowed:
            return out
        regime = config_regime(nodes, replicas)  # borrowed regimes are ones the type has not been observed in
        sens = None
        for r, weights in transfer.borrowed.items():
            rows = regime == r
            if not rows.any():
                continue
            if sens is None:
                sens = sensitivities(transfer.theta, nodes, replicas, bsz, accum, transfer.shape)[:, _OWN_SYNC]
            for ref, weight in weights.items():
                if ref not in self.cov_id:
                    continue
                cov = self.cov_id[ref][np.ix_(_OWN_SYNC, _OWN_SYNC)]
                s = sens[rows] * self._id[ref][_OWN_SYNC] * math.sqrt(weight)
                out[rows] += np.einsum("ij,jk,ik->i", s, cov, s)
        return out

    # ------------------------------------------------------------------ prediction
    def log_mean(self, gpu: str, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray, accum: np.ndarray) -> np.ndarray:
        """Posterior mean of log step time (hot path: no variance)."""
        design = self.design(gpu, nodes, replicas, bsz, accum, variance=False)
        if self.posterior is None:
            return design.log_mean
        try:
            mu = self.posterior.predict_mean(design.x, design.t, design.s)
        except (FloatingPointError, ValueError, np.linalg.LinAlgError):
            return design.log_mean
        out = design.log_mean + mu
        return np.where(np.isfinite(out), out, design.log_mean)

    def predict(
        self, gpu: str, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray, accum: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and std of log step time (of a new measurement: noise included)."""
        design = self.design(gpu, nodes, replicas, bsz, accum)
        fallback = np.full(design.log_mean.shape, self.fallback_log_std)
        if self.posterior is None:
            return design.log_mean, np.sqrt(fallback**2 + design.d)
        try:
            mu, var = self.posterior.predict(design.x, design.t, design.s, noise=True)
            # the residual scale is estimated from the type's few residual degrees of freedom:
            # marginalising it gives a Student-t, matched here at the 90% quantile
            var = var * self.t_factor(gpu) ** 2 * self.unbias.get(gpu, 1.0) + self._id_var(gpu, design) + self._borrowed_var(gpu, nodes, replicas, bsz, accum) + design.d
        except (FloatingPointError, ValueError, np.linalg.LinAlgError):
            return design.log_mean, np.sqrt(fallback**2 + design.d)
        ok = np.isfinite(mu) & np.isfinite(var)
        std = np.where(ok, np.sqrt(var), fallback)
        scales = self.regime_scale.get(gpu)
        if scales:
            n, r = (np.ravel(a) for a in np.broadcast_arrays(nodes, replicas, bsz, accum)[:2])
            regime = config_regime(n, r)
            factor = np.ones(regime.shape)
            for index, scale in scales.items():
                factor[regime == index] = scale
            std = np.where(np.isin(regime, self.transfers[gpu].regimes.covered), std, std * factor)
        return np.where(ok, design.log_mean + mu, design.log_mean), std

    # ------------------------------------------------------------------ online
    def condition(self, observations: Sequence[Observation]) -> float:
        """Condition the posterior on observations of known types; returns the largest |z| seen before each update.

        Raises :class:`GPNumericalError` when the update cannot be factorised.
        """
        if self.posterior is None:
            raise GPNumericalError("no posterior to update")
        design, y = self.design_observations(observations)
        # |z| under the GP's spread alone, narrower than predict()'s interval (no Student-t or REML
        # factor, no parameter variance): a stricter surprise, so early observations refit sooner.
        # Judged on predict()'s interval instead, Pollux's online error after 5 observations rose
        # from 7.75% to 7.93% (experiments/results/accuracy.md, round 23).
        mu, var = self.posterior.predict(design.x, design.t, design.s, noise=True, extra_noise=design.d)
        z = np.abs(y - mu) / np.sqrt(var)
        self.posterior.condition(design.x, design.t, design.s, y, design.d)
        for gpu in {o.gpu_type for o in observations}:
            self.dof[gpu] = self.dof.get(gpu, 0.0) + sum(o.gpu_type == gpu for o in observations)
            self._inform(gpu, design.s_id[design.t == self.index[gpu]])
        return float(np.max(z)) if z.size else 0.0

    def _inform(self, gpu: str, s_id: np.ndarray) -> None:
        """Add observations' information to the Laplace covariance of the type's identified groups.

        The own fit's parameter uncertainty narrows with every observation, as the GP's posterior
        does, not only at the next refit: a rank-k update of ``S_idᵀ S_id / r²`` at the refit's
        residual variance r² (the refit then re-estimates both).
        """
        info = self.info_id.get(gpu)
        if info is None or not s_id.size:
            return
        info = info + s_id.T @ s_id / self.r2_id[gpu]
        try:
            cov = np.linalg.inv(info)
        except np.linalg.LinAlgError:
            return
        self.info_id[gpu], self.cov_id[gpu] = info, cov


def _recent_window(stamps: np.ndarray, gpu_types: np.ndarray, max_points: int) -> np.ndarray:
    """Indices of the ``max_points`` most recent observations, each type keeping its most recent few.

    A type whose observations are older than the others' keeps its
    ``max_points // (2 × types)`` most recent ones (or all it has): without any,
    the GP would forget its residuals, and its predictions at configurations it
    has measured would widen to the prior's because other types' data arrived.
    """
    order = np.argsort(stamps, kind="stable")
    types = np.unique(gpu_types)
    floor = max(1, max_points // (2 * len(types)))
    chosen = np.zeros(stamps.size, dtype=bool)
    for gpu in types:
        chosen[order[gpu_types[order] == gpu][-floor:]] = True
    newest_first = order[::-1]
    rest = newest_first[~chosen[newest_first]]  # then the most recent of the others, up to max_points
    chosen[rest[: max(0, max_points - int(chosen.sum()))]] = True
    return np.flatnonzero(chosen)


def build_state(
    observations: Mapping[str, Sequence[Observation]],
    transfers: Mapping[str, TypeTransfer],
    previous: GPHyperparameters | None = None,
    *,
    max_points: int = 1024,
    fit_hyper: bool = True,
    seed: int = 0,
) -> BayesState:
    """Residuals of every observation under ``means``, GP hyperparameters fitted, posterior built."""
    types = list(observations)
    hyper = (previous or GPHyperparameters.default(num_tasks=len(types))).for_types(types)
    state = BayesState(types=types, transfers=dict(transfers), hyper=hyper, posterior=None)
    obs = [o for t in types for o in observations[t]]
    if len(obs) > max_points:  # the most recent ones (each type's list is in arrival order)
        # by timestamp only when every observation has one: one without may be the newest
        stamps = np.array([o.timestamp if o.timestamp is not None else math.nan for o in obs])
        keep = _recent_window(stamps, np.array([o.gpu_type for o in obs]), max_points) if np.isfinite(stamps).all() else None
        if keep is None:
            per = {t: observations[t][-max(1, max_points * len(observations[t]) // len(obs)):] for t in types}
            obs = [o for t in types for o in per[t]]
        else:
            obs = [obs[i] for i in keep]
    state.n_fit = len(obs)
    design, y = state.design_observations(obs)
    rms = float(np.sqrt(np.mean(y**2))) if y.size else 0.0
    state.fallback_log_std = max(FALLBACK_LOG_STD, 3.0 * rms) if np.isfinite(rms) else FALLBACK_LOG_STD
    if not np.all(np.isfinite(y)):
        state.reason = "non-finite residuals"
        return state
    # Residuals of a type whose own fit has as many identified parameter groups as it has
    # observations are zero by construction: they say nothing about the residual's scale, and
    # would drive its task variance to 0 (cutting it off from the other types). They are left out
    # of the hyperparameter fit, the type takes the task parameters of a typical type
    # (GPHyperparameters.borrowed), and they still condition the posterior.
    informative = np.ones(len(y), dtype=bool)
    for k in range(len(types)):
        rows = design.t == k
        if int(rows.sum()) <= int((np.linalg.norm(design.s_id[rows], axis=0) > 1e-9).sum()):
            informative[rows] = False
    fitted = fit_hyper and informative.sum() >= 4
    if fitted:
        idx = np.flatnonzero(informative)
        if len(idx) > MAX_FIT_POINTS:
            idx = np.sort(np.random.default_rng(seed).choice(idx, MAX_FIT_POINTS, replace=False))
        # A refit starts from the previous hyperparameters, which are close: a few L-BFGS
        # iterations suffice (15 instead of 60 cuts a scheduled refit ~4x at no measured accuracy cost).
        iterations = WARM_REFIT_ITERATIONS if previous is not None and previous.num_tasks == len(types) else COLD_FIT_ITERATIONS
        state.hyper = fit_hyperparameters(design.x[idx], design.t[idx], design.s[idx], y[idx], hyper,
                                          extra_noise=design.d[idx], max_iter=iterations)
        state.hyper = state.hyper.borrowed(np.unique(design.t[~informative]))
    # Laplace (delta-method) covariance of each type's identified parameter groups, whitened by
    # their prior stds: (S_idᵀ S_id / r² + I)⁻¹ with r² the residual variance of the fit: the
    # posterior mean of a scaled-inverse-χ² with RESIDUAL_PRIOR_DOF pseudo-observations at the
    # GP's prior variance and n − p residual degrees of freedom (→ the unbiased rss/(n − p) with
    # many observations; the prior scale when the fit interpolates few, n ≤ p).
    # A type's own fit uses all its observations, also those the GP's window left out: its parameter
    # uncertainty and degrees of freedom are counted on all of them.
    prior_var = state.hyper.task_covariance().diagonal() + state.hyper.noise
    truncated = state.n_fit < sum(len(observations[t]) for t in types)
    for k, gpu in enumerate(types):
        rows = design.t == k
        s_id, resid = design.s_id[rows], y[rows]
        if truncated and len(observations[gpu]) > int(rows.sum()):
            whole, y_whole = state.design_observations(observations[gpu])
            if np.all(np.isfinite(y_whole)):
                s_id, resid = whole.s_id, y_whole
        active = np.linalg.norm(s_id, axis=0) > 1e-9
        n, p = len(resid), int(active.sum())
        rss = float(np.sum(resid**2))
        dof = max(n - p, 0)
        state.dof[gpu] = float(dof)
        if fitted and dof > 0 and informative[rows].any():
            state.unbias[gpu] = n / dof
        r2 = max((RESIDUAL_PRIOR_DOF * prior_var[k] + rss) / (RESIDUAL_PRIOR_DOF + dof), state.hyper.noise, 1e-6)
        info = s_id.T @ s_id / r2 + np.eye(_G)
        try:
            state.cov_id[gpu] = np.linalg.inv(info)
        except np.linalg.LinAlgError:
            state.cov_id[gpu] = np.eye(_G)
            continue
        state.info_id[gpu], state.r2_id[gpu] = info, r2
    try:
        state.posterior = OnlinePosterior(state.hyper, design.x, design.t, design.s, y, extra_noise=design.d)
    except GPNumericalError as exc:
        state.reason = f"GP not positive definite: {exc}"
        state.posterior = None
    return state
