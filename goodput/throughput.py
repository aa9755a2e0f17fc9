"""Pollux's parametric throughput model: prediction and fitting.

The model (Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for
Goodput-Optimized Deep Learning", OSDI'21, §3.2 and AdaptDL's implementation)
predicts the seconds of one optimizer step from the allocation and batch size::

    T_accum  = α_c + β_c · local_bsz                         compute of one micro-batch
    T_sync   = 0                                      if num_replicas == 1
             = α_r + β_r · max(num_replicas − 2, 0)   if num_nodes == 1
             = α_n + β_n · max(num_replicas − 2, 0)   otherwise
    T_step   = (T_accum^γ + T_sync^γ)^(1/γ)                  overlap, γ ≥ 1
    T_iter   = accum_steps · T_accum + T_step                one optimizer step

:func:`fit_throughput` fits θ = (α_c, β_c, α_n, β_n, α_r, β_r, γ) by minimising
the RMSE of log step time (plus that of log compute time where ``sync_time`` was
measured) with L-BFGS-B and an analytic gradient. Parameters the data cannot
identify are fixed by Pollux's priors (or a caller-supplied prior):

* one local batch size only: α_c = half the mean compute time;
* no multi-node data: the inter-node premium (α_n − α_r, β_n − β_r) is 0,
  i.e. inter-node costs equal intra-node ones;
* no multi-replica data: α_r, β_r ≈ 0 (optimistic, as Pollux: the scheduler
  explores and corrects once it sees real synchronisation);
* at most 2 replicas: β_r, β_n ≈ 0.

The inter-node terms are parameterised as intra-node terms plus a non-negative
premium, so a fit never predicts inter-node synchronisation cheaper than
intra-node synchronisation for configurations it has not seen.

Example::

    >>> params = ThroughputParams(0.02, 0.001, 0.2, 0.01, 0.05, 0.005, 1.5)
    >>> float(predict_step_time(params, num_nodes=1, num_replicas=4, local_bsz=64))  # doctest: +ELLIPSIS
    0.115...
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.optimize

from .errors import ValidationError
from .observations import Observation
from .threads import single_threaded
from .validation import check_allocations, check_float, is_collection

__all__ = [
    "PARAM_NAMES",
    "ThroughputParams",
    "predict_compute_time",
    "predict_sync_time",
    "predict_step_time",
    "fit_throughput",
    "throughput_arrays",
    "config_arrays",
]

PARAM_NAMES = ("alpha_c", "beta_c", "alpha_n", "beta_n", "alpha_r", "beta_r", "gamma")

_TINY = 1e-8  # lower bound of every α/β, seconds (Pollux uses the same slack)
_HUGE = 1e4  # upper bound of every α/β, seconds
_GAMMA_MAX = 10.0  # Pollux's bound: γ = 10 is close enough to max(T_accum, T_sync)


@dataclass(frozen=True)
class ThroughputParams:
    """θ of Pollux's throughput model; times in seconds.

    Attributes:
        alpha_c: constant compute time of one micro-batch, s.
        beta_c: compute time per sample of the micro-batch, s/sample.
        alpha_n: inter-node synchronisation time at 2 replicas, s.
        beta_n: inter-node synchronisation growth per replica beyond 2, s.
        alpha_r: intra-node synchronisation time at 2 replicas, s.
        beta_r: intra-node synchronisation growth per replica beyond 2, s.
        gamma: overlap of compute and synchronisation, 1 (none) to 10 (full).
        fixed: names of parameters set by a prior rather than fitted.
    """

    alpha_c: float
    beta_c: float
    alpha_n: float
    beta_n: float
    alpha_r: float
    beta_r: float
    gamma: float
    fixed: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in PARAM_NAMES[:-1]:
            object.__setattr__(self, name, check_float(name, getattr(self, name), nonnegative=True))
        gamma = check_float("gamma", self.gamma)
        if gamma < 1.0:
            raise ValidationError("gamma", gamma, "must be >= 1 (1 = no overlap of compute and sync)")
        object.__setattr__(self, "gamma", gamma)
        if self.alpha_c + self.beta_c <= 0.0:
            raise ValidationError("alpha_c", self.alpha_c, "alpha_c + beta_c must be > 0 (a step takes compute time)")
        if not is_collection(self.fixed):
            raise ValidationError("fixed", self.fixed, "expected a sequence of parameter names")
        unknown = set(self.fixed) - set(PARAM_NAMES)
        if unknown:
            raise ValidationError("fixed", self.fixed, f"unknown parameter names {sorted(unknown)}")
        object.__setattr__(self, "fixed", tuple(self.fixed))

    def as_array(self) -> np.ndarray:
        """θ in :data:`PARAM_NAMES` order."""
        return np.array([getattr(self, n) for n in PARAM_NAMES], dtype=float)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {n: getattr(self, n) for n in PARAM_NAMES}
        if self.fixed:
            out["fixed"] = list(self.fixed)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ThroughputParams:
        if not isinstance(data, Mapping):
            raise ValidationError("params", data, "expected a mapping of throughput parameters")
        missing = [n for n in PARAM_NAMES if n not in data]
        if missing:
            raise ValidationError(missing[0], None, "missing throughput parameter")
        unknown = set(data) - set(PARAM_NAMES) - {"fixed"}
        if unknown:
            name = sorted(unknown)[0]
            raise ValidationError(name, data[name], "unknown throughput parameter")
        return cls(**{n: data[n] for n in PARAM_NAMES}, fixed=tuple(data.get("fixed", ())))


# ====================================================================== prediction


def config_arrays(num_nodes: Any, num_replicas: Any, local_bsz: Any, accum_steps: Any,
                  num_stages: int = 1) -> tuple[np.ndarray, ...]:
    """Validate and broadcast configuration arrays (floats, so candidates may be fractional).

    Numbers only: booleans and strings are refused (``True`` is not a replica count).
    ``num_stages``: GPUs per replica (:mod:`goodput.hybrid`); every node holds a GPU, so
    ``num_replicas · num_stages >= num_nodes`` (a pipeline may span nodes).
    """
    arrays = []
    for name, value in (
        ("num_nodes", num_nodes),
        ("num_replicas", num_replicas),
        ("local_bsz", local_bsz),
        ("accum_steps", accum_steps),
    ):
        raw = np.asarray(value)
        if raw.dtype.kind not in "iuf":
            raise ValidationError(name, value, "expected numbers")
        arr = raw.astype(float)
        if not np.all(np.isfinite(arr)):
            raise ValidationError(name, value, "must be finite")
        arrays.append(arr)
    try:
        nodes, replicas, bsz, accum = np.broadcast_arrays(*arrays)
    except ValueError:
        shapes = ", ".join(f"{n} {a.shape}" for n, a in zip(("num_nodes", "num_replicas", "local_bsz", "accum_steps"), arrays))
        raise ValidationError("num_nodes, num_replicas, local_bsz, accum_steps", shapes, "shapes do not broadcast together") from None
    check_allocations(nodes, replicas, num_stages, num_nodes, num_replicas)
    if np.any(bsz <= 0):
        raise ValidationError("local_bsz", local_bsz, "must be > 0")
    if np.any(accum < 0):
        raise ValidationError("accum_steps", accum_steps, "must be >= 0")
    return nodes, replicas, bsz, accum


def _check_params(params: Any) -> ThroughputParams:
    if not isinstance(params, ThroughputParams):
        raise ValidationError("params", params, "expected ThroughputParams")
    return params


def predict_compute_time(params: ThroughputParams, local_bsz: Any) -> np.ndarray:
    """Seconds of one micro-batch of compute, ``α_c + β_c · local_bsz``."""
    params = _check_params(params)
    bsz = np.asarray(local_bsz, dtype=float)
    if np.any(~np.isfinite(bsz)) or np.any(bsz <= 0):
        raise ValidationError("local_bsz", local_bsz, "must be finite and > 0")
    return params.alpha_c + params.beta_c * bsz


SyncShapeFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _sync_time(theta: np.ndarray, nodes: np.ndarray, replicas: np.ndarray, shape: SyncShapeFn | np.ndarray | None = None) -> np.ndarray:
    """``shape``: a sync shape, or its factors already evaluated at these configurations (an array)."""
    _, _, alpha_n, beta_n, alpha_r, beta_r, _ = theta
    extra = np.maximum(replicas - 2.0, 0.0)
    inter = alpha_n + beta_n * extra
    if shape is not None:
        inter = inter * (shape if isinstance(shape, np.ndarray) else shape(nodes, replicas))
    sync = np.where(nodes > 1, inter, alpha_r + beta_r * extra)
    return np.where(replicas > 1, sync, 0.0)


def predict_sync_time(params: ThroughputParams, num_nodes: Any, num_replicas: Any, sync_shape: SyncShapeFn | None = None,
                      num_stages: int = 1) -> np.ndarray:
    """Seconds of gradient synchronisation ``T_sync`` (0 for a single replica).

    ``sync_shape``: the cluster's factor on inter-node sync per configuration
    (:class:`goodput.sync_shape.SyncShape`); ``None``: Pollux's form as it is.
    ``num_stages``: GPUs per replica (a pipeline may span nodes), as :func:`predict_step_time`.
    """
    params = _check_params(params)
    nodes, replicas, _, _ = config_arrays(num_nodes, num_replicas, 1.0, 0.0, num_stages)
    return _sync_time(params.as_array(), nodes, replicas, sync_shape)


@dataclass(frozen=True)
class SoftMax:
    """Pollux's overlap of compute and sync, ``(C^γ + S^γ)^{1/γ}`` (Qiao et al., OSDI'21, Eq. 4), computed as
    ``top · q^{1/γ}`` with ``top = max(C, S)`` so that no power overflows; ``x = C/top``, ``y = S/top``,
    ``xg = x^γ``, ``yg = y^γ`` and ``q = xg + yg`` are kept for the gradients of the fits."""

    overlap: np.ndarray
    x: np.ndarray
    y: np.ndarray
    xg: np.ndarray
    yg: np.ndarray
    q: np.ndarray

    @classmethod
    def of(cls, compute: np.ndarray, sync: np.ndarray, gamma: Any) -> SoftMax:
        top = np.maximum(compute, sync)
        x, y = compute / top, sync / top
        xg, yg = x**gamma, y**gamma
        q = xg + yg
        return cls(top * q ** (1.0 / gamma), x, y, xg, yg, q)


def _step_time(theta: np.ndarray, nodes: np.ndarray, replicas: np.ndarray, bsz: np.ndarray, accum: np.ndarray,
               shape: SyncShapeFn | np.ndarray | None = None) -> np.ndarray:
    """Unvalidated ``T_iter`` for the hot paths (goodput optimisation, fitting)."""
    compute = theta[0] + theta[1] * bsz
    sync = _sync_time(theta, nodes, replicas, shape)
    return accum * compute + SoftMax.of(compute, sync, theta[6]).overlap


def predict_step_time(
    params: ThroughputParams,
    num_nodes: Any,
    num_replicas: Any,
    local_bsz: Any,
    accum_steps: Any = 0,
    sync_shape: SyncShapeFn | None = None,
    num_stages: int = 1,
) -> np.ndarray:
    """Seconds of one optimizer step, ``T_iter`` (the quantity ``Observation.step_time`` measures).

    Broadcasts over numpy arrays; returns an array (0-d for scalar inputs).
    ``sync_shape`` multiplies the inter-node sync per configuration (see
    :func:`predict_sync_time`); ``num_stages``: GPUs per replica (a pipeline may span nodes).
    """
    params = _check_params(params)
    nodes, replicas, bsz, accum = config_arrays(num_nodes, num_replicas, local_bsz, accum_steps, num_stages)
    return _step_time(params.as_array(), nodes, replicas, bsz, accum, sync_shape)


# ====================================================================== fitting


def throughput_arrays(observations: Iterable[Observation]) -> dict[str, np.ndarray]:
    """Columns of the observations that the fit uses, as float arrays."""
    obs = list(observations)
    return {
        "num_nodes": np.array([o.num_nodes for o in obs], dtype=float),
        "num_replicas": np.array([o.num_replicas for o in obs], dtype=float),
        "local_bsz": np.array([o.local_bsz for o in obs], dtype=float),
        "accum_steps": np.array([o.accum_steps for o in obs], dtype=float),
        "step_time": np.array([o.step_time for o in obs], dtype=float),
        "compute_time": np.array([np.nan if o.compute_time is None else o.compute_time for o in obs], dtype=float),
    }


# Internal parameter order: the inter-node terms are premiums over intra-node ones.
_A_C, _B_C, _A_R, _B_R, _DA_N, _DB_N, _G = range(7)
_INTERNAL = ("alpha_c", "beta_c", "alpha_r", "beta_r", "premium_alpha_n", "premium_beta_n", "gamma")


def _to_public(z: np.ndarray) -> np.ndarray:
    """Internal vector → θ in PARAM_NAMES order."""
    return np.array([z[_A_C], z[_B_C], z[_A_R] + z[_DA_N], z[_B_R] + z[_DB_N], z[_A_R], z[_B_R], z[_G]])


@dataclass
class _Problem:
    nodes: np.ndarray
    replicas: np.ndarray
    bsz: np.ndarray
    accum: np.ndarray
    log_step: np.ndarray
    compute_mask: np.ndarray
    log_compute: np.ndarray
    free: np.ndarray  # indices into the internal vector
    base: np.ndarray  # internal vector holding the fixed values
    reg_r: bool
    reg_n: bool
    reg_gamma: bool
    scale: np.ndarray  # per observation: the sync shape's factor on inter-node sync (1 elsewhere)

    def unpack(self, u: np.ndarray) -> np.ndarray:
        z = self.base.copy()
        values = u.copy()
        is_log = self.free != _G
        values[is_log] = np.exp(values[is_log])
        z[self.free] = values
        return z

    def objective(self, u: np.ndarray) -> tuple[float, np.ndarray]:
        """Loss and its gradient with respect to the free (log-)parameters."""
        z = self.unpack(u)
        a_c, b_c, a_r, b_r, da_n, db_n, g = z
        multi = self.replicas > 1
        inter = self.nodes > 1
        extra = np.maximum(self.replicas - 2.0, 0.0)

        compute = a_c + b_c * self.bsz
        sync = np.where(multi, (a_r + b_r * extra + np.where(inter, da_n + db_n * extra, 0.0)) * self.scale, 0.0)
        soft = SoftMax.of(compute, sync, g)
        overlap, x, y, xg, yg, q = soft.overlap, soft.x, soft.y, soft.xg, soft.yg, soft.q
        step = self.accum * compute + overlap

        d_over_dc = (compute / overlap) ** (g - 1.0)
        d_over_ds = np.where(multi, (sync / overlap) ** (g - 1.0), 0.0) * self.scale
        with np.errstate(divide="ignore", invalid="ignore"):
            ylogy = np.where(yg > 0, yg * np.log(np.where(y > 0, y, 1.0)), 0.0)
        d_over_dg = overlap * (-np.log(q) / g**2 + (xg * np.log(x) + ylogy) / (g * q))

        # d step / d internal parameters, one column per parameter
        d_step_dc = self.accum + d_over_dc
        jac = np.empty((step.size, 7))
        jac[:, _A_C] = d_step_dc
        jac[:, _B_C] = d_step_dc * self.bsz
        jac[:, _A_R] = d_over_ds
        jac[:, _B_R] = d_over_ds * extra
        jac[:, _DA_N] = d_over_ds * inter
        jac[:, _DB_N] = d_over_ds * inter * extra
        jac[:, _G] = d_over_dg
        jac /= step[:, None]

        loss = 0.0
        grad = np.zeros(7)
        resid = np.log(step) - self.log_step
        rmse = math.sqrt(float(np.mean(resid**2)) + 1e-12)
        loss += rmse
        grad += jac.T @ resid / (resid.size * rmse)

        if self.compute_mask.any():
            c = compute[self.compute_mask]
            r2 = np.log(c) - self.log_compute
            rmse2 = math.sqrt(float(np.mean(r2**2)) + 1e-12)
            loss += rmse2
            jc = np.zeros((c.size, 7))
            jc[:, _A_C] = 1.0 / c
            jc[:, _B_C] = self.bsz[self.compute_mask] / c
            grad += jc.T @ r2 / (r2.size * rmse2)

        # Pollux's regularisers: γ towards 1, and small retrogression terms
        # relative to the constant ones (an optimistic model).
        if self.reg_gamma:
            loss += 1e-3 * (g - 1.0) ** 2
            grad[_G] += 2e-3 * (g - 1.0)
        if self.reg_r:
            ratio = b_r / a_r
            loss += 1e-2 * ratio**2
            grad[_B_R] += 2e-2 * ratio / a_r
            grad[_A_R] -= 2e-2 * ratio**2 / a_r
        if self.reg_n:
            a_n, b_n = a_r + da_n, b_r + db_n
            ratio = b_n / a_n
            loss += 1e-2 * ratio**2
            d_b, d_a = 2e-2 * ratio / a_n, -2e-2 * ratio**2 / a_n
            grad[_B_R] += d_b
            grad[_DB_N] += d_b
            grad[_A_R] += d_a
            grad[_DA_N] += d_a

        # chain rule to the free, log-transformed coordinates
        grad_free = grad[self.free]
        is_log = self.free != _G
        grad_free[is_log] *= z[self.free][is_log]
        return loss, grad_free


def _prior_values(prior: ThroughputParams | Mapping[str, float] | None) -> dict[str, float]:
    if prior is None:
        return {}
    if isinstance(prior, ThroughputParams):
        return {n: getattr(prior, n) for n in PARAM_NAMES}
    if not isinstance(prior, Mapping):
        raise ValidationError("prior", prior, "expected ThroughputParams or a mapping of parameter values")
    unknown = set(prior) - set(PARAM_NAMES)
    if unknown:
        name = sorted(unknown)[0]
        raise ValidationError(f"prior[{name!r}]", prior[name], "unknown throughput parameter")
    return {k: check_float(f"prior[{k!r}]", v, nonnegative=True) for k, v in prior.items()}


@single_threaded  # small matrices: BLAS threads only contend (goodput.threads; 7-30x slower on a busy host)
def fit_throughput(
    observations: Iterable[Observation],
    *,
    prior: ThroughputParams | Mapping[str, float] | None = None,
    gamma: float | None = None,
    initial: ThroughputParams | None = None,
    sync_shape: SyncShapeFn | None = None,
) -> ThroughputParams:
    """Fit Pollux's throughput model to one job's observations on one GPU type.

    Args:
        observations: at least one :class:`Observation`, all of the same job
            and GPU type.
        prior: values for parameters the observations cannot identify (for
            example the synchronisation costs learned from other jobs on the
            same GPU type). Without one, Pollux's optimistic defaults apply
            (see the module docstring).
        gamma: hold γ at this value instead of fitting it (sync costs of
            fits that share γ are comparable across jobs and GPU types).
        initial: a previous fit of (most of) the same data: L-BFGS-B also
            starts from it (an online refit after a few new observations);
            the best optimum of all starts wins.
        sync_shape: the cluster's factor on inter-node sync per
            configuration (:class:`goodput.sync_shape.SyncShape`, learned
            from other jobs): α_n, β_n are then the sync before that factor.

    Returns:
        The fitted :class:`ThroughputParams`; ``fixed`` names the parameters
        set by a prior rather than by the data.
    """
    if not is_collection(observations, mappings=False):
        raise ValidationError("observations", observations, "expected a sequence of Observations")
    obs = list(observations)
    if not obs:
        raise ValidationError("observations", obs, "need at least one observation to fit")
    for i, o in enumerate(obs):
        if not isinstance(o, Observation):
            raise ValidationError(f"observations[{i}]", o, "expected an Observation")
    for key in ("job", "gpu_type"):
        values = sorted({getattr(o, key) for o in obs})
        if len(values) > 1:
            raise ValidationError(key, values, f"fit_throughput fits one {key} at a time")
    prior_values = _prior_values(prior)
    cols = throughput_arrays(obs)
    nodes, replicas, bsz, accum = cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"]
    step, compute_time = cols["step_time"], cols["compute_time"]
    compute_mask = np.isfinite(compute_time) & (compute_time > 0)

    # Compute-time samples for the initial guess: measured, or implied by single-replica steps.
    single = replicas == 1
    compute_guess = np.where(compute_mask, compute_time, np.where(single, step / (accum + 1.0), np.nan))
    known = np.isfinite(compute_guess)
    if not known.any():  # only multi-replica steps without sync_time: an upper bound on compute
        compute_guess = step / (accum + 1.0)
        known = np.ones_like(step, dtype=bool)

    has_multi = bool(np.any(replicas > 1))
    has_single_node_multi = bool(np.any((replicas > 1) & (nodes == 1)))
    has_inter = bool(np.any(nodes > 1))
    has_many = bool(np.any(replicas > 2))
    one_bsz = len(np.unique(bsz)) == 1

    z0 = _initial_guess(bsz[known], compute_guess[known], nodes, replicas, bsz, step, accum)
    fixed: dict[int, float] = {}
    if one_bsz:
        fixed[_A_C] = prior_values.get("alpha_c", float(np.mean(compute_guess[known])) / 2.0)
    if not has_multi:
        fixed[_A_R] = prior_values.get("alpha_r", _TINY)
        fixed[_B_R] = prior_values.get("beta_r", _TINY)
        fixed[_G] = prior_values.get("gamma", 1.0)
    if gamma is not None:
        fixed[_G] = check_float("gamma", gamma)
        if not 1.0 <= fixed[_G] <= _GAMMA_MAX:
            raise ValidationError("gamma", gamma, f"must be in [1, {_GAMMA_MAX}]")
    tied: set[int] = set()  # premiums held at 0 to tie an intra-node term to the fitted inter-node one
    if not has_inter:
        # The inter-node premium over intra-node costs: from the prior (over the intra-node
        # value fixed or in the prior), else 0.
        fixed[_DA_N] = _premium(prior_values, "alpha_n", fixed.get(_A_R, prior_values.get("alpha_r")))
        fixed[_DB_N] = _premium(prior_values, "beta_n", fixed.get(_B_R, prior_values.get("beta_r")))
    if not has_single_node_multi and has_inter:
        # Multi-node data only: the intra-node terms are not identifiable
        # separately; tie them to the inter-node ones (premium 0), or a prior.
        if "alpha_r" in prior_values:
            fixed[_A_R] = prior_values["alpha_r"]
        else:
            fixed[_DA_N] = _TINY
            tied.add(_DA_N)
        if "beta_r" in prior_values:
            fixed[_B_R] = prior_values["beta_r"]
        else:
            fixed[_DB_N] = _TINY
            tied.add(_DB_N)
    if not has_many:
        fixed.setdefault(_B_R, prior_values.get("beta_r", _TINY))
        fixed.setdefault(_DB_N, _premium(prior_values, "beta_n", fixed[_B_R]))

    for index, value in fixed.items():
        z0[index] = max(value, _TINY) if index != _G else min(max(value, 1.0), _GAMMA_MAX)
    free = np.array([i for i in range(7) if i not in fixed], dtype=int)
    problem = _Problem(
        nodes=nodes,
        replicas=replicas,
        bsz=bsz,
        accum=accum,
        log_step=np.log(step),
        compute_mask=compute_mask,
        log_compute=np.log(compute_time[compute_mask]),
        free=free,
        base=z0.copy(),
        reg_r=_A_R not in fixed or _B_R not in fixed,
        reg_n=has_inter,
        reg_gamma=_G not in fixed,
        # the shape bends inter-node sync alone, as in _sync_time (a SyncShape is 1 on one node; any callable is held to it)
        scale=np.ones_like(step) if sync_shape is None else np.where(nodes > 1, np.asarray(sync_shape(nodes, replicas), dtype=float), 1.0),
    )
    if free.size:
        warm = None
        if initial is not None:
            if not isinstance(initial, ThroughputParams):
                raise ValidationError("initial", initial, "expected ThroughputParams")
            warm = _to_internal(initial.as_array())
            warm[list(fixed)] = z0[list(fixed)]
        z = _minimize(problem, z0, warm)
    else:
        z = z0
    theta = _to_public(z)
    fixed_names = _fixed_public_names(fixed, tied)
    return ThroughputParams(*theta.tolist(), fixed=fixed_names)


def _premium(prior_values: Mapping[str, float], inter: str, intra_value: float | None) -> float:
    """The inter-node premium a prior implies: its ``inter`` value over the intra-node one (0 without both)."""
    if inter in prior_values and intra_value is not None:
        return max(prior_values[inter] - intra_value, _TINY)
    return _TINY


def _fixed_public_names(fixed: Mapping[int, float], tied: set[int] = frozenset()) -> tuple[str, ...]:
    """Public names of the parameters not fitted; a premium in ``tied`` (held at 0) names the intra-node term it ties."""
    mapping = {_A_C: "alpha_c", _B_C: "beta_c", _A_R: "alpha_r", _B_R: "beta_r", _DA_N: "alpha_n", _DB_N: "beta_n", _G: "gamma"}
    names = {mapping[_A_R if index == _DA_N else _B_R] if index in tied else mapping[index] for index in fixed}
    return tuple(n for n in PARAM_NAMES if n in names)


def _initial_guess(
    fit_bsz: np.ndarray,
    fit_compute: np.ndarray,
    nodes: np.ndarray,
    replicas: np.ndarray,
    bsz: np.ndarray,
    step: np.ndarray,
    accum: np.ndarray,
) -> np.ndarray:
    """A data-driven starting point: a non-negative line through compute times, median sync costs."""
    design = np.column_stack([np.ones_like(fit_bsz), fit_bsz])
    (a_c, b_c), _ = scipy.optimize.nnls(design, fit_compute)
    mean_compute = float(np.mean(fit_compute))
    a_c = max(a_c, 0.05 * mean_compute, _TINY)
    b_c = max(b_c, 1e-3 * mean_compute / max(float(np.mean(fit_bsz)), 1.0), _TINY)
    sync_guess = np.maximum(step - (accum + 1.0) * (a_c + b_c * bsz), 0.0)
    intra = (replicas > 1) & (nodes == 1)
    inter = nodes > 1
    if intra.any():
        a_r = float(np.median(sync_guess[intra]))
    elif inter.any():
        a_r = float(np.median(sync_guess[inter]))
    else:
        a_r = 0.0
    a_r = max(a_r, 0.05 * mean_compute, _TINY)
    a_n = float(np.median(sync_guess[inter])) if inter.any() else a_r
    return np.array([a_c, b_c, a_r, 0.05 * a_r, max(a_n - a_r, 0.1 * a_r), 0.05 * a_r, 1.5])


def _to_internal(theta: np.ndarray) -> np.ndarray:
    """θ in PARAM_NAMES order → the internal vector (inter-node terms as premiums over intra-node ones)."""
    a_c, b_c, a_n, b_n, a_r, b_r, g = theta
    return np.array([a_c, b_c, a_r, b_r, max(a_n - a_r, _TINY), max(b_n - b_r, _TINY), g])


def _minimize(problem: _Problem, z0: np.ndarray, warm: np.ndarray | None = None) -> np.ndarray:
    """L-BFGS-B from the data-driven guess at a few overlaps γ, and from a warm start when given; keep the best
    (the cold starts always run: a warm start alone kept a refit in the optimum of the fewer points fitted
    first, so the fit depended on when it had been asked for)."""
    free = problem.free
    is_log = free != _G
    lower = np.where(is_log, math.log(_TINY), 1.0)
    upper = np.where(is_log, math.log(_HUGE), _GAMMA_MAX)
    bounds = list(zip(lower, upper))
    starts = [z0]
    if _G in free:
        for gamma in (1.05, 4.0):
            alt = z0.copy()
            alt[_G] = gamma
            starts.append(alt)
    if warm is not None:
        starts.append(warm)
    best_u, best_loss = None, math.inf
    for start in starts:
        u0 = start[free].copy()
        u0[is_log] = np.log(np.clip(u0[is_log], _TINY, _HUGE))
        u0 = np.clip(u0, lower, upper)
        result = scipy.optimize.minimize(
            problem.objective, u0, jac=True, method="L-BFGS-B", bounds=bounds, options={"maxiter": 500}
        )
        if np.isfinite(result.fun) and result.fun < best_loss:
            best_u, best_loss = result.x, float(result.fun)
    if best_u is None:  # every start failed numerically: keep the data-driven guess
        return z0
    return problem.unpack(best_u)
