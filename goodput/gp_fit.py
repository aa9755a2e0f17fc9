"""The residual GP's hyperparameters, fitted by maximum marginal likelihood, and gpytorch's reference posterior.

The model is :mod:`goodput.gp`'s: a Hadamard multitask Matérn-5/2 process
with a Bayesian linear part and learned noise. Here its hyperparameters are
fitted: one job's (:func:`fit_hyperparameters`, the exact marginal likelihood
of gpytorch's model in float64 with its priors, its value and analytic
gradient in numpy, by scipy's L-BFGS-B from several starts), and those a
cluster's jobs share (:func:`fit_shared_hyperparameters`, each job an
independent draw: the prior of a new job's). :func:`gpytorch_posterior` is
gpytorch's own batch prediction of the same posterior, the reference that
:class:`goodput.gp.OnlinePosterior` is tested against (and the device check
on a GPU).

Example::

    hyper = fit_hyperparameters(x, t, s, y, GPHyperparameters.default(num_tasks=1))
    post = OnlinePosterior(hyper, x, t, s, y)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import scipy.optimize
import scipy.special

from .gp import (CORRELATION_LOGIT_STD, CORRELATION_RANGE, DEFAULT_TASK_CORRELATION, LENGTHSCALE_BOUNDS, NOISE_FLOOR,
                 NOISE_PRIOR, GPHyperparameters, HyperPrior, _factor, _gaussian_nll, _matern_terms)

__all__ = ["fit_hyperparameters", "fit_hyperparameters_over_modes", "fit_shared_hyperparameters", "gpytorch_posterior"]


def _torch_model(hyper: GPHyperparameters, x: np.ndarray, t: np.ndarray, s: np.ndarray, y: np.ndarray, extra_noise: np.ndarray | None,
                 device: str | None = None, hyper_prior: HyperPrior | None = None):
    """A gpytorch ExactGP (Hadamard form) holding ``hyper``; float64, on ``device`` (default CPU)."""
    import gpytorch
    import torch
    from linear_operator.operators import RootLinearOperator, SumLinearOperator

    dtype = torch.float64
    dev = torch.device(device or "cpu")
    if hyper_prior is None:
        lengthscale_prior = gpytorch.priors.GammaPrior(2.0, 0.5)
        noise_prior = gpytorch.priors.LogNormalPrior(math.log(NOISE_PRIOR), 1.0)
    else:
        lengthscale_prior = gpytorch.priors.LogNormalPrior(torch.log(torch.as_tensor(hyper_prior.lengthscale, dtype=dtype)),
                                                           hyper_prior.log_std)
        noise_prior = gpytorch.priors.LogNormalPrior(math.log(hyper_prior.noise), hyper_prior.log_std)
    tx = torch.as_tensor(x, dtype=dtype, device=dev)
    tt = torch.as_tensor(t, dtype=torch.long, device=dev).reshape(-1, 1)
    ts = torch.as_tensor(s, dtype=dtype, device=dev).reshape(len(y), -1)
    ty = torch.as_tensor(y, dtype=dtype, device=dev)
    d = torch.as_tensor(np.zeros(len(y)) if extra_noise is None else extra_noise, dtype=dtype, device=dev)

    class HadamardResidualGP(gpytorch.models.ExactGP):
        def __init__(self, likelihood: Any) -> None:
            super().__init__((tx, tt, ts), ty, likelihood)
            self.mean_module = gpytorch.means.ZeroMean()
            self.data_kernel = gpytorch.kernels.MaternKernel(
                nu=2.5, ard_num_dims=x.shape[1], lengthscale_prior=lengthscale_prior,
                lengthscale_constraint=gpytorch.constraints.Interval(*LENGTHSCALE_BOUNDS),
            )
            self.task_kernel = gpytorch.kernels.IndexKernel(num_tasks=hyper.num_tasks, rank=1)

        def forward(self, xi: Any, ti: Any, si: Any) -> Any:
            covar = self.data_kernel(xi).mul(self.task_kernel(ti))
            if si.shape[-1]:
                # An explicit sum: `covar + RootLinearOperator(si)` would take linear_operator's low-rank update,
                # which inverts the kernel's part alone and fails where it is singular (queries at training points).
                covar = SumLinearOperator(covar, RootLinearOperator(si))
            return gpytorch.distributions.MultivariateNormal(self.mean_module(xi), covar)

    constraint = gpytorch.constraints.GreaterThan(NOISE_FLOOR)
    # A prior on the noise variance (without a hyper_prior: weak, centred on a 3% spread of step
    # times): with a handful of observations the Pollux mean fits them almost exactly, and the
    # maximum-likelihood noise would collapse to the floor (overconfident intervals); with many, the data decide.
    if float(d.max() if d.numel() else 0.0) > 0:
        # learned homoscedastic noise on top of the fixed per-point variance d
        likelihood = gpytorch.likelihoods.FixedNoiseGaussianLikelihood(noise=d, learn_additional_noise=True, noise_constraint=constraint,
                                                                       noise_prior=noise_prior)
    else:
        likelihood = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=constraint, noise_prior=noise_prior)
    model = HadamardResidualGP(likelihood).to(dev, dtype)
    likelihood = likelihood.to(dev, dtype)
    model.data_kernel.lengthscale = torch.as_tensor(np.clip(hyper.lengthscale, 0.051, 49.9), dtype=dtype, device=dev).reshape(1, -1)
    model.task_kernel.covar_factor.data = torch.as_tensor(hyper.task_factor, dtype=dtype, device=dev).reshape(-1, 1)
    model.task_kernel.var = torch.as_tensor(np.maximum(hyper.task_var, 1e-9), dtype=dtype, device=dev)
    _set_noise(likelihood, max(hyper.noise, NOISE_FLOOR * 1.0001))
    return model, likelihood, (tx, tt, ts), ty


def _set_noise(likelihood: Any, value: float) -> None:
    import torch

    device = next(likelihood.parameters()).device
    if getattr(likelihood, "second_noise_covar", None) is not None:
        likelihood.second_noise_covar.noise = torch.as_tensor([value], dtype=torch.float64, device=device)
    else:
        likelihood.noise = torch.as_tensor([value], dtype=torch.float64, device=device)


@dataclass(frozen=True)
class _FitData:
    """A job's residuals and what the objective reuses across evaluations."""

    sq_diff: np.ndarray  # (n, n, D) squared differences of the features
    one_hot: np.ndarray  # (n, T) each point's task
    linear: np.ndarray  # (n, n) s sᵀ, the fixed kernel of the linear part
    fixed_noise: np.ndarray  # (n,) per-point variance d
    noise_scale: np.ndarray  # (n,) each point's multiple of the noise σ² (a Student-t noise's scale mixture)
    y: np.ndarray
    present: np.ndarray  # tasks with data (the signal prior's terms)


def _raw_from_hyper(hyper: GPHyperparameters) -> np.ndarray:
    """The hyperparameters in gpytorch's raw (unconstrained) coordinates of :func:`_torch_model`, one vector
    (noise, length scales, task factor, task variances): length scales ``0.05 + 49.95·sigmoid(r)``
    (``Interval``), task variances ``softplus(r)`` (``Positive``), noise ``NOISE_FLOOR + softplus(r)``
    (``GreaterThan``), the task factor as is."""
    low, high = LENGTHSCALE_BOUNDS
    share = (np.clip(np.asarray(hyper.lengthscale, dtype=float), 0.051, 49.9) - low) / (high - low)
    var = np.maximum(np.asarray(hyper.task_var, dtype=float), 1e-9)
    noise = max(hyper.noise, NOISE_FLOOR * 1.0001) - NOISE_FLOOR
    return np.concatenate([[noise + math.log(-math.expm1(-noise))], np.log(share) - np.log1p(-share),
                           np.asarray(hyper.task_factor, dtype=float), var + np.log(-np.expm1(-var))])


def _hyper_from_raw(raw: np.ndarray, num_features: int, task_names: tuple[str, ...]) -> tuple[GPHyperparameters, np.ndarray]:
    """(hyperparameters, d value / d raw) of a raw vector (:func:`_raw_from_hyper`)."""
    low, high = LENGTHSCALE_BOUNDS
    num_tasks = (raw.size - 1 - num_features) // 2
    parts = np.split(raw, [1, 1 + num_features, 1 + num_features + num_tasks])
    noise_raw, ls_raw, factor, var_raw = parts
    ls_share = scipy.special.expit(ls_raw)
    noise = NOISE_FLOOR + np.logaddexp(0.0, noise_raw)
    var = np.logaddexp(0.0, var_raw)
    slope = np.concatenate([scipy.special.expit(noise_raw), (high - low) * ls_share * (1.0 - ls_share), np.ones(num_tasks),
                            scipy.special.expit(var_raw)])
    hyper = GPHyperparameters(task_names=task_names, lengthscale=tuple(low + (high - low) * ls_share), task_factor=tuple(factor),
                              task_var=tuple(var), noise=float(noise[0]))
    return hyper, slope


def _negative_log_posterior(raw: np.ndarray, data: _FitData, hyper_prior: HyperPrior | None) -> tuple[float, np.ndarray]:
    """−(log p(y | θ) + log p(θ)) / n of the Hadamard model (:func:`_torch_model`) and its gradient in raw coordinates.

    The same objective as gpytorch's ``ExactMarginalLogLikelihood`` of that model (the log likelihood and
    the priors registered on its modules, divided by n) plus the per-type signal prior of ``hyper_prior`` and,
    with several types, the prior of each type's shared fraction around its ``correlation``; those two are
    normal in the log of the variance and in the logit of the fraction, densities in those coordinates, so
    alone they pull to their medians (gpytorch's log-normal priors on the length scales and the noise are
    densities of the values themselves, with the Jacobian, and pull to median·e^(−σ²));
    ``tests/test_gp.py`` checks value and gradient against gpytorch's autograd. The gradient of the log
    likelihood is ``½ tr((K⁻¹ − ααᵀ) ∂K/∂θ)`` (Rasmussen & Williams, 2006, eq. 5.9; :func:`_gaussian_nll`).
    """
    n, dims = data.y.size, data.sq_diff.shape[2]
    hyper, slope = _hyper_from_raw(raw, dims, ())
    ls = np.asarray(hyper.lengthscale)
    w, v = np.asarray(hyper.task_factor), np.asarray(hyper.task_var)
    r, decay, matern = _matern_terms(data.sq_diff, ls)
    task = np.outer(w, w) + np.diag(v)
    task_full = data.one_hot @ task @ data.one_hot.T
    k = matern * task_full + data.linear
    k[np.diag_indices(n)] += data.fixed_noise + hyper.noise * data.noise_scale
    # gpytorch's psd_safe_cholesky with cholesky_jitter 1e-8 and 4 tries
    loss, weight = _gaussian_nll(k, data.y, (0.0, 1e-8, 1e-7, 1e-6, 1e-5))
    loss += 0.5 * n * math.log(2.0 * math.pi)
    grad_noise = float(np.diagonal(weight) @ data.noise_scale)
    grad_ls = (5.0 / 3.0) * np.tensordot(weight * task_full * (1.0 + r) * decay, data.sq_diff, axes=([0, 1], [0, 1])) / ls**3
    grad_task = data.one_hot.T @ (weight * matern) @ data.one_hot  # ∂loss/∂B
    grad_w, grad_v = 2.0 * grad_task @ w, np.diag(grad_task).copy()
    # the priors: Gamma(2, rate ½) or log-normal on the length scales, log-normal on the noise
    if hyper_prior is None:
        loss -= np.sum(np.log(ls) - 0.5 * ls) + 2.0 * math.log(0.5) * dims
        grad_ls -= 1.0 / ls - 0.5
        noise_median, noise_std = NOISE_PRIOR, 1.0
    else:
        z = (np.log(ls) - np.log(hyper_prior.lengthscale)) / hyper_prior.log_std
        loss += np.sum(0.5 * z * z + np.log(ls)) + dims * (math.log(hyper_prior.log_std) + 0.5 * math.log(2.0 * math.pi))
        grad_ls += (z / hyper_prior.log_std + 1.0) / ls
        noise_median, noise_std = hyper_prior.noise, hyper_prior.log_std
    z = (math.log(hyper.noise) - math.log(noise_median)) / noise_std
    loss += 0.5 * z * z + math.log(hyper.noise) + math.log(noise_std) + 0.5 * math.log(2.0 * math.pi)
    grad_noise += (z / noise_std + 1.0) / hyper.noise
    grad = np.concatenate([[grad_noise], grad_ls, grad_w, grad_v]) / n
    loss /= n
    if hyper_prior is not None:  # the per-type signal prior, per data point as gpytorch's terms are
        diagonal = np.diag(task)[data.present]
        z = (np.log(diagonal) - math.log(hyper_prior.signal_var)) / hyper_prior.log_std
        loss += 0.5 * np.sum(z * z) / n
        pull = np.zeros(w.size)
        pull[data.present] = z / (hyper_prior.log_std * diagonal) / n
        grad[1 + dims:1 + dims + w.size] += 2.0 * w * pull
        grad[1 + dims + w.size:] += pull
        if w.size > 1:  # each type's shared fraction w²/(w² + v): logit-normal around the cluster's correlation
            wp, vp = w[data.present], v[data.present]
            z = (np.log(wp * wp + 1e-300) - np.log(vp) - math.log(hyper_prior.correlation / (1.0 - hyper_prior.correlation))) \
                / CORRELATION_LOGIT_STD
            loss += 0.5 * np.sum(z * z) / n
            pull = z / (CORRELATION_LOGIT_STD * n)
            grad[1 + dims + data.present] += pull * 2.0 * wp / (wp * wp + 1e-300)
            grad[1 + dims + w.size + data.present] -= pull / vp
    return float(loss), grad * slope


def fit_hyperparameters(
    x: np.ndarray,
    t: np.ndarray,
    s: np.ndarray,
    y: np.ndarray,
    init: GPHyperparameters,
    *,
    extra_noise: np.ndarray | None = None,
    noise_scale: np.ndarray | None = None,
    max_iter: int = 60,
    hyper_prior: HyperPrior | None = None,
    restarts: Sequence[tuple[GPHyperparameters, int]] = (),
) -> GPHyperparameters:
    """Maximise the exact marginal likelihood plus the hyperparameters' log prior by L-BFGS, from ``init``
    (at most ``max_iter`` iterations) and from each further ``(start, max_iter)`` of ``restarts``; the best
    optimum wins.

    The objective is gpytorch's ``ExactMarginalLogLikelihood`` of the Hadamard model
    (:func:`_torch_model`) with its priors, in gpytorch's raw coordinates, with its analytic gradient
    (:func:`_negative_log_posterior`; the test suite checks both against gpytorch).
    ``hyper_prior`` (e.g. the cluster's, :func:`fit_shared_hyperparameters`): log-normal priors on the
    length scales, the noise and each GPU type's residual variance; with a handful of points the
    marginal likelihood alone overfits (short length scales, noise at the floor, overconfident
    intervals), with many the data decide. Without one: a Gamma(2, ½) prior on the length scales and a
    weak one on the noise. L-BFGS-B (scipy; Byrd et al., 1995) walks the raw coordinates, at most
    ``max_iter`` iterations. Returns ``init`` unchanged when the optimisation fails numerically from every start.
    ``extra_noise`` adds a fixed variance to each point's noise; ``noise_scale`` multiplies each point's noise
    variance σ² (an E-step's ``1 / w`` of Student-t noise: :func:`goodput.posterior.build_posterior`).
    """
    return _fit_scored(x, t, s, y, init, extra_noise, max_iter, hyper_prior, restarts, noise_scale)[0]


def fit_hyperparameters_over_modes(
    x: np.ndarray,
    t: np.ndarray,
    s: np.ndarray,
    y: np.ndarray,
    init: GPHyperparameters,
    hyper_prior: HyperPrior,
    *,
    max_iter: int = 60,
    restarts: Sequence[tuple[GPHyperparameters, int]] = (),
    noise_scale: np.ndarray | None = None,
) -> tuple[GPHyperparameters, int]:
    """:func:`fit_hyperparameters` under each of the cluster's modes (:meth:`HyperPrior.modes`), and the one whose
    optimum has the highest log posterior plus its mode's log weight: a prior that mixes the modes by their
    evidence, each job's hyperparameters at the maximum a posteriori mode of it. Under the first mode from
    ``init`` and ``restarts``, under the others from their medians. Returns the hyperparameters and the mode's
    index (0: ``hyper_prior``'s own). ``noise_scale``: as :func:`fit_hyperparameters`'."""
    best, best_value, best_mode = init, math.inf, 0
    for mode, (prior, log_weight) in enumerate(hyper_prior.modes()):
        start = init if mode == 0 else replace(prior.initial(init.num_tasks), task_names=init.task_names)
        found, value = _fit_scored(x, t, s, y, start, None, max_iter, prior, restarts if mode == 0 else (), noise_scale)
        if value - log_weight < best_value:
            best, best_value, best_mode = found, value - log_weight, mode
    return best, best_mode


def _fit_scored(x: np.ndarray, t: np.ndarray, s: np.ndarray, y: np.ndarray, init: GPHyperparameters,
                extra_noise: np.ndarray | None, max_iter: int, hyper_prior: HyperPrior | None,
                restarts: Sequence[tuple[GPHyperparameters, int]], noise_scale: np.ndarray | None = None
                ) -> tuple[GPHyperparameters, float]:
    """:func:`fit_hyperparameters` and −log posterior at its optimum (the sum over points; ``inf`` when every start failed)."""
    y = np.asarray(y, dtype=float).ravel()
    x = np.asarray(x, dtype=float).reshape(y.size, -1)
    t = np.asarray(t, dtype=int).ravel()
    s = np.asarray(s, dtype=float).reshape(y.size, -1)
    data = _FitData((x[:, None, :] - x[None, :, :]) ** 2, np.eye(init.num_tasks)[t], s @ s.T,
                    np.zeros(y.size) if extra_noise is None else np.asarray(extra_noise, dtype=float).ravel(),
                    np.ones(y.size) if noise_scale is None else np.asarray(noise_scale, dtype=float).ravel(), y, np.unique(t))
    best, best_value = init, math.inf
    for start, iterations in ((init, max_iter), *restarts):
        try:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                found = scipy.optimize.minimize(_negative_log_posterior, _raw_from_hyper(start), args=(data, hyper_prior),
                                                jac=True, method="L-BFGS-B", options={"maxiter": iterations})
            result, _ = _hyper_from_raw(found.x, x.shape[1], init.task_names)
        except Exception:  # noqa: BLE001 - a numerical failure from this start: the others may do
            continue
        values = np.concatenate([result.lengthscale, result.task_factor, result.task_var, [result.noise]])
        if np.all(np.isfinite(values)) and np.isfinite(found.fun) and found.fun < best_value:
            best, best_value = result, float(found.fun)
    return best, best_value * y.size


SHARED_FIT_SIGNAL_SHARES = (0.7, 0.99, 0.05)  # the starts' share of the residuals' variance in the signal (the rest: noise)


def fit_shared_hyperparameters(groups: Iterable[tuple[np.ndarray, ...]], *, max_points: int = 128, max_iter: int = 60,
                               seed: int = 0) -> HyperPrior | None:
    """Hyperparameters shared by independent residual processes (one per group), by maximum marginal likelihood.

    ``groups``: ``(features (N, D), residuals (N,))`` or ``(features, residuals, types (N,))`` of each job
    of a cluster, each an independent draw of the Hadamard residual process of :func:`fit_hyperparameters`
    with the same length scales, variance and noise, and the task covariance ``σ²(ρ 11ᵀ + (1 − ρ) I)``
    over its GPU types, each type's mean free (the restricted likelihood, :func:`_restricted_nll`). The cluster's typical residual structure, ``ρ``
    included (the correlation of a job's residuals across types, learned from the jobs with several; else
    :data:`DEFAULT_TASK_CORRELATION`): the prior of a new job's (:func:`fit_hyperparameters`). At most
    ``max_points`` observations of a one-type group are kept, twice that of a group with several types
    (a random subset of whole configurations, so that the types' residuals meet). ``None`` without enough
    points (fewer than 8 in all) or when the fit fails.

    L-BFGS starts from three splits of the residuals' variance between signal and noise
    (:data:`SHARED_FIT_SIGNAL_SHARES`): where each configuration was measured once, noise and a residual
    that varies on a short scale explain the same data, and the likelihood has a mode for each (Gavel's
    clusters: noise ≈ 0 with a length scale of 0.6 doublings in the GPU count, or noise 0.008–0.018,
    9–43 apart in log evidence, which one is higher turning on one job). The best is returned, the
    others as its :attr:`~goodput.gp.HyperPrior.alternatives` (optima whose noise or signal variance differs
    by 2× or more), each with its log evidence relative to the best (the objective at the optimum).
    """
    rng = np.random.default_rng(seed)
    kept = []
    for group in groups:
        x, y = np.asarray(group[0], dtype=float), np.array(group[1], dtype=float).ravel()  # a copy: centred below
        t = np.zeros(y.size, dtype=int) if len(group) < 3 else np.unique(np.asarray(group[2]).ravel(), return_inverse=True)[1]
        if y.size < 3 or not np.all(np.isfinite(y)):
            continue
        num_types = int(t.max()) + 1
        budget = max_points * min(num_types, 2)
        if y.size > budget:  # whole configurations, so that the types' residuals meet
            configs, which = np.unique(x, axis=0, return_inverse=True)
            rank = rng.permutation(len(configs))[which.ravel()]
            order = np.lexsort((rng.random(y.size), rank))
            idx = np.sort(order[:budget])
            x, y, t = x[idx], y[idx], t[idx]
        for k in np.unique(t):
            y[t == k] -= y[t == k].mean()
        kept.append(((x[:, None, :] - x[None, :, :]) ** 2, t[:, None] == t[None, :], y))
    total = sum(y.size for _, _, y in kept)
    if total < 8:
        return None
    dims = kept[0][0].shape[2]
    several = any(not same.all() for _, same, _ in kept)
    variance = float(np.mean([float((y**2).mean()) for _, _, y in kept]))
    start = np.concatenate([np.full(dims, math.log(2.0)), np.zeros(3)])  # length scales of 2 doublings, ρ ½
    found_at: list[tuple[float, HyperPrior]] = []  # −log p(y) at each start's optimum, the optimum
    for share in SHARED_FIT_SIGNAL_SHARES:
        start[dims], start[dims + 1] = math.log(max(share * variance, 1e-6)), math.log(max((1 - share) * variance, NOISE_FLOOR))
        try:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                found = scipy.optimize.minimize(_shared_negative_log_likelihood, start, args=(kept, total), jac=True,
                                                method="L-BFGS-B", options={"maxiter": max_iter})
            ls = np.clip(np.exp(found.x[:dims]), *LENGTHSCALE_BOUNDS)
            sig, noise = math.exp(found.x[dims]), math.exp(found.x[dims + 1]) + NOISE_FLOOR
            rho = float(np.clip(scipy.special.expit(found.x[dims + 2]), *CORRELATION_RANGE)) if several else DEFAULT_TASK_CORRELATION
        except Exception:  # noqa: BLE001 - a numerical failure from this start: the others may do
            continue
        if not (np.all(np.isfinite(ls)) and math.isfinite(sig) and math.isfinite(noise) and math.isfinite(rho) and np.isfinite(found.fun)):
            continue
        found_at.append((float(found.fun) * total, HyperPrior(tuple(float(v) for v in ls), max(sig, 1e-6), noise, correlation=rho)))
    modes: list[tuple[float, HyperPrior]] = []  # the distinct optima, best first
    for value, prior in sorted(found_at, key=lambda item: item[0]):
        if not any(abs(math.log(prior.noise / p.noise)) < math.log(2) and abs(math.log(prior.signal_var / p.signal_var)) < math.log(2)
                   for _, p in modes):
            modes.append((value, prior))
    if not modes:
        return None
    (best_value, best), others = modes[0], modes[1:]
    return replace(best, alternatives=tuple((prior, best_value - value) for value, prior in others))


def _restricted_nll(k: np.ndarray, y: np.ndarray, same: np.ndarray) -> tuple[float, np.ndarray]:
    """The restricted likelihood (REML: Patterson & Thompson, *Biometrika* 58, 1971) of residuals ``y`` with a free
    mean per GPU type (``same``: the same-type mask), ``½ yᵀΠy + ½ log|K| + ½ log|XᵀK⁻¹X|`` with ``X`` the types'
    indicators and ``Π = K⁻¹ − K⁻¹X (XᵀK⁻¹X)⁻¹ XᵀK⁻¹`` (no 2π term), and its gradient in K, ``½ (Π − Πy yᵀΠ)``.
    Invariant to each type's mean: the likelihood of residuals whose means were taken out, which the plain one
    scores as if they had not been (it read their long-range variance as missing)."""
    labels = np.argmax(same, axis=1)  # each point's type, named by its first point
    x = (labels[:, None] == np.unique(labels)[None, :]).astype(float)  # (n, T) one-hot
    chol, inverse = _factor(k)
    kx = inverse @ x
    m = x.T @ kx
    m_chol = scipy.linalg.cholesky(m, lower=True, check_finite=False)
    proj = inverse - kx @ scipy.linalg.cho_solve((m_chol, True), kx.T, check_finite=False)
    py = proj @ y
    nll = 0.5 * y @ py + np.log(np.diag(chol)).sum() + np.log(np.diag(m_chol)).sum()
    return float(nll), 0.5 * (proj - np.outer(py, py))


def _shared_negative_log_likelihood(params: np.ndarray, groups: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                                    total: int) -> tuple[float, np.ndarray]:
    """The objective of :func:`fit_shared_hyperparameters` and its gradient in ``params`` = (log length scales,
    log signal variance, log noise, logit ρ): Σ over groups ``(squared feature differences, same-type mask,
    residuals)`` of the restricted −log p(y_g) (:func:`_restricted_nll`, without its constant) with the length
    scales' Gamma(2, ½) prior, per point.
    Length scales are clamped to :data:`LENGTHSCALE_BOUNDS` (no gradient beyond them)."""
    dims = params.size - 3
    raw_ls = np.exp(params[:dims])
    ls = np.clip(raw_ls, *LENGTHSCALE_BOUNDS)
    inside = (raw_ls >= LENGTHSCALE_BOUNDS[0]) & (raw_ls <= LENGTHSCALE_BOUNDS[1])
    sig, noise, rho = math.exp(params[dims]), math.exp(params[dims + 1]), float(scipy.special.expit(params[dims + 2]))
    loss, grad_ls, grad_sig, grad_noise, grad_rho = 0.0, np.zeros(dims), 0.0, 0.0, 0.0
    for sq_diff, same, y in groups:
        r, decay, matern = _matern_terms(sq_diff, ls)
        task = np.where(same, 1.0, rho)
        k = sig * matern * task
        k[np.diag_indices(y.size)] += noise + NOISE_FLOOR
        nll, weight = _restricted_nll(k, y, same)
        loss += nll
        grad_sig += np.sum(weight * matern * task) * sig
        grad_noise += np.trace(weight) * noise
        grad_rho += sig * np.sum(np.where(same, 0.0, weight * matern)) * rho * (1.0 - rho)
        grad_ls += (5.0 / 3.0) * sig * np.tensordot(weight * task * (1.0 + r) * decay, sq_diff, axes=([0, 1], [0, 1])) / ls**3
    loss -= np.sum(np.log(ls) - 0.5 * ls)  # the single-job fit's Gamma(2, ½) prior on the length scales
    grad_ls -= 1.0 / ls - 0.5
    grad = np.concatenate([np.where(inside, grad_ls * ls, 0.0), [grad_sig, grad_noise, grad_rho]]) / total
    return float(loss / total), grad


def gpytorch_posterior(
    hyper: GPHyperparameters,
    x: np.ndarray,
    t: np.ndarray,
    s: np.ndarray,
    y: np.ndarray,
    xq: np.ndarray,
    tq: np.ndarray,
    sq: np.ndarray,
    *,
    extra_noise: np.ndarray | None = None,
    device: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Posterior mean and latent variance at query points by gpytorch's batch ExactGP prediction (the reference)."""
    import gpytorch
    import torch

    if extra_noise is not None and np.any(np.asarray(extra_noise) > 0):
        raise ValueError("the gpytorch reference supports homoscedastic noise only")
    model, likelihood, _, _ = _torch_model(hyper, x, t, s, y, None, device)
    model.eval()
    likelihood.eval()
    dev = torch.device(device or "cpu")
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False), gpytorch.settings.max_cholesky_size(100_000), \
            gpytorch.settings.cholesky_jitter(double_value=1e-300), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(
            torch.as_tensor(xq, dtype=torch.float64, device=dev),
            torch.as_tensor(tq, dtype=torch.long, device=dev).reshape(-1, 1),
            torch.as_tensor(sq, dtype=torch.float64, device=dev).reshape(len(tq), -1),
        )
        return out.mean.cpu().numpy().copy(), out.variance.cpu().numpy().copy()
