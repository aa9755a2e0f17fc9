"""How close any model can come to a measurement folder's step times: two floors of the median APE.

``goodput accuracy`` scores predictions against single measurements, which
carry their own noise. Two floors put its figures in scale:

* **repeats**: the median APE of each measurement against the geometric mean
  of the *other* measurements of the same (model, GPU type, configuration),
  over configurations measured at least :data:`MIN_REPEATS` times: what even
  the exact mean step time could not beat (slightly above it: the mean of a
  few others is itself noisy);
* **own fit**: the median APE of each (model, type)'s parametric fit to all
  of its own data (``goodput.cells.summarize_cell``: Pollux's form with
  compute's power, and the placement shapes the cluster shares), in sample:
  what the parametric form leaves when nothing is held out.

Run: ``python -m experiments.noise_floor DIR [DIR ...]``: one line per folder
(``--out FILE`` also writes the figures as JSON).

Example (Pollux's traces, 2-core VM): repeats 3.5% over 562 configurations,
own fit 4.8% over 7103 measurements (4.9% with Pollux's sum, before compute's power).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from experiments.folder_check import run
from goodput.cells import step_rows
from goodput.hierarchy import ClusterPrior
from goodput.observations import Observation, by_gpu_type
from goodput.parametric import log_step_time, reference_bsz

__all__ = ["Floors", "noise_floors", "main", "MIN_REPEATS"]

MIN_REPEATS = 4  # measurements of one configuration for it to count (each against the mean of 3+ others)


@dataclass(frozen=True)
class Floors:
    """Median APE floors of a folder, percent (NaN where the folder has none), and what they are over."""

    repeats_median_ape: float
    repeated_configurations: int
    own_fit_median_ape: float
    measurements: int


def _ape(log_error: np.ndarray) -> np.ndarray:
    return 100.0 * np.abs(np.expm1(log_error))


def noise_floors(models: Mapping[str, Sequence[Observation]]) -> Floors:
    """:class:`Floors` of ``{model: observations}`` (module docstring)."""
    repeats, own, configurations = [], [], 0
    prior = ClusterPrior.from_observations(models, gp_prior=False)  # every cell's fit, with the shared shapes
    fits = {(c.job, c.gpu_type): c.u for c in prior.summaries}
    for job, obs in models.items():
        groups: dict[tuple, list[float]] = defaultdict(list)
        for o in obs:
            groups[(o.gpu_type, o.num_nodes, o.num_replicas, o.local_bsz, o.accum_steps)].append(np.log(o.step_time))
        for values in groups.values():
            if len(values) >= MIN_REPEATS:
                v = np.array(values)
                configurations += 1
                repeats.append(_ape(v - (v.sum() - v) / (v.size - 1)))
        ref = reference_bsz(obs)
        for gpu, items in by_gpu_type(obs).items():
            rows, y = step_rows(items, ref, prior.sync_shape(gpu))
            own.append(_ape(y - log_step_time(fits[(job, gpu)], rows, jacobian=False)[0]))
    own_all = np.concatenate(own) if own else np.zeros(0)
    return Floors(float(np.median(np.concatenate(repeats))) if repeats else float("nan"), configurations,
                  float(np.median(own_all)) if own_all.size else float("nan"), int(own_all.size))


def main(argv: Sequence[str] | None = None) -> int:
    return run(argv, "python -m experiments.noise_floor", __doc__.split("\n\n")[0],
               lambda models: asdict(noise_floors(models)),
               lambda f: (f"repeats {f['repeats_median_ape']:.1f}% over {f['repeated_configurations']} configurations; "
                          f"own fit {f['own_fit_median_ape']:.1f}% over {f['measurements']} measurements"))


if __name__ == "__main__":
    raise SystemExit(main())
