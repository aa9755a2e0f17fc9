"""How well two forms of one GPU's compute time predict a batch size they did not see.

Pollux's throughput model (Qiao et al., OSDI'21, §3.2) prices a step's compute
as a per-step overhead plus per-sample work, ``T(b) = α + β·b`` (seconds, local
batch ``b``). At small batches a GPU is latency-bound and its step time flattens
below that line; at large ones it is throughput-bound. The **soft maximum**

    T(b) = (α^p + (β·b)^p)^(1/p),      p > 0 (p = 1: Pollux's sum; p → ∞: max(α, β·b))

is the form Pollux itself uses to combine compute and synchronisation (its γ),
here applied to the two parts of compute. A third form lets the per-sample
work grow as a power of the batch, ``β·b^q`` (q > 1: a step that slows more
than in proportion at large batches, memory-bound; Zeus's deepspeech2 on V100
takes 2.60 s at 128 samples and 4.22 s at 192). This module fits the forms to
each (model, GPU type)'s single-GPU steps (median per batch size, no
accumulation), leaving out one batch size at a time, and reports the median,
mean and 90th percentile APE of the step time predicted at the left-out size
(interpolation and extrapolation at both ends alike). The forms are fitted by
least squares in log step time; ``log p`` and ``log q`` have a weak N(0, 1)
prior (each pseudo-residual is weighted as one observation at a 5% noise), so
a cell whose points cannot tell them stays near Pollux's sum.

Run: ``python -m experiments.compute_form DIR [DIR ...]`` (``--out FILE``
writes the figures as JSON). Measured on the shared data (2-core VM): Pollux's
traces 3.8% → 2.1% median APE (57 held-out sizes), Gavel 8.3% → 6.1% (60),
Zeus 5.4% → 3.3% (204; 90th percentile 20.4% → 10.8%); this project's CPU
profiles 3.9% → 3.4% (27). With the growth power as well: Zeus 2.4% (90th
percentile 8.2%), the CPU profiles 1.9%, but Pollux's traces 2.5% (90th
percentile 15.9% → 13.1%) and Gavel 7.1% (its mean 12.7% → 24.2%: its
non-monotone curves). The Bayesian model (:mod:`goodput.parametric`) has
the soft maximum's power as an eighth coordinate of every job and type
(``experiments/results/accuracy.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import scipy.optimize

from experiments.folder_check import run
from goodput.observations import Observation

__all__ = ["FormErrors", "FORMS", "compute_curves", "soft_max_step_time", "fit_form", "held_out_errors", "main", "MIN_SIZES"]

MIN_SIZES = 5  # batch sizes a cell needs: four left to fit three parameters when one is held out
_LOG_P_WEIGHT = 0.05  # the prior's pseudo-residual log p × this, against residuals of log step time


@dataclass(frozen=True)
class FormErrors:
    """Held-out APE of step time (percent) of one form over a folder's cells."""

    median_ape: float
    mean_ape: float
    p90_ape: float
    points: int
    cells: int


def soft_max_step_time(params: np.ndarray, bsz: np.ndarray) -> np.ndarray:
    """``(α^p + (β·b^q)^p)^(1/p)`` in seconds for ``params = (log α, log β, log p, log q)``; without ``log q``,
    q = 1; ``(log α, log β)``: ``α + β·b``."""
    log_alpha, log_beta = params[0], params[1]
    log_work = log_beta + (np.exp(params[3]) if len(params) > 3 else 1.0) * np.log(bsz)
    if len(params) == 2:
        return np.exp(np.logaddexp(log_alpha, log_work))
    power = np.exp(params[2])
    return np.exp(np.logaddexp(power * log_alpha, power * log_work) / power)


FORMS = {"pollux": 0, "soft_max": 1, "soft_max_growth": 2}  # each form's parameters beyond (log α, log β)


def fit_form(bsz: np.ndarray, step_time: np.ndarray, form: str) -> np.ndarray:
    """Least-squares parameters of one of :data:`FORMS` (:func:`soft_max_step_time`) in log step time; ``log p`` and
    ``log q`` have the weak prior of the module docstring."""
    y = np.log(step_time)
    extra = FORMS[form]

    def residuals(params: np.ndarray) -> np.ndarray:
        return np.append(np.log(soft_max_step_time(params, bsz)) - y, _LOG_P_WEIGHT * params[2:])

    start = [y[0] - 1.0, y[-1] - np.log(bsz[-1])] + [0.0] * extra
    return scipy.optimize.least_squares(residuals, start).x


def compute_curves(models: Mapping[str, Sequence[Observation]]) -> list[tuple[str, str, np.ndarray, np.ndarray]]:
    """Each (model, type)'s single-GPU curve with :data:`MIN_SIZES`\\ + batch sizes: ``(model, type, b, median T)``."""
    out = []
    for job, observations in sorted(models.items()):
        by_type: dict[str, dict[int, list[float]]] = {}
        for o in observations:
            if o.num_replicas == 1 and o.accum_steps == 0:
                by_type.setdefault(o.gpu_type, {}).setdefault(o.local_bsz, []).append(o.step_time)
        for gpu, times in sorted(by_type.items()):
            if len(times) >= MIN_SIZES:
                sizes = sorted(times)
                out.append((job, gpu, np.array(sizes, dtype=float), np.array([np.median(times[b]) for b in sizes])))
    return out


def held_out_errors(models: Mapping[str, Sequence[Observation]]) -> dict[str, FormErrors]:
    """``{"pollux": ..., "soft_max": ..., "soft_max_growth": ...}``: each form's error at every batch size left out in turn."""
    curves = compute_curves(models)
    errors: dict[str, list[float]] = {name: [] for name in FORMS}
    for _, _, bsz, step_time in curves:
        for i in range(bsz.size):
            keep = np.arange(bsz.size) != i
            for name in FORMS:
                params = fit_form(bsz[keep], step_time[keep], name)
                errors[name].append(100.0 * abs(float(soft_max_step_time(params, bsz[i:i + 1])[0]) / step_time[i] - 1.0))
    out = {}
    for name, values in errors.items():
        e = np.array(values)
        nan = float("nan")
        out[name] = FormErrors(float(np.median(e)) if e.size else nan, float(np.mean(e)) if e.size else nan,
                               float(np.percentile(e, 90)) if e.size else nan, int(e.size), len(curves))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    def line(found: dict[str, Any]) -> str:
        forms = "; ".join(f"{name} median {e['median_ape']:.1f}%, mean {e['mean_ape']:.1f}%, p90 {e['p90_ape']:.1f}%"
                          for name, e in found.items())
        return f"{forms} ({found['pollux']['points']} held-out sizes, {found['pollux']['cells']} cells)"

    return run(argv, "python -m experiments.compute_form", __doc__.split("\n\n")[0],
               lambda models: {name: asdict(e) for name, e in held_out_errors(models).items()}, line)


if __name__ == "__main__":
    raise SystemExit(main())
