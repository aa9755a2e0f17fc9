"""What a change of a job's speed while it trains does to its model: with and without reading level shifts.

A job's speed can change while it trains (cold data in its first epoch, a neighbour on its node, a
training phase that unfreezes layers). For each model of a measurement folder and each seed, ``--train``
of its observations (at most half of them), chosen at random and timestamped in that order, are given to
a :class:`~goodput.JobModel` with the cluster prior of the folder's other models (leave-one-model-out, as
``goodput accuracy`` builds it); then ``--after`` more steps at configurations among those (drawn with
replacement), each ``factor`` times its measured step time and timestamped after them. The model then
predicts up to ``--test`` of the other observations at ``factor`` times their measured step time: the job's
current speed. Each with the level shifts the model reads by default (*shifts*, :mod:`goodput.shifts`) and
without (*plain*: ``level_shifts=False``, every step exchangeable). A factor of 1 (no change) measures what
reading shifts costs where there is none, and *stalls* what stalled steps at the end cost (a factor of 1,
the last ``--stalls`` steps after it 5× slower: the moment a checkpoint or a stalled loader could pass for a
change). Figures per scenario: the median APE of the predicted step time (percent), the share of held-out
steps inside the 90% interval, and the share of fits that found a change. With ``--online``, the largest
factor's steps after the change are also observed one at a time, a question after each (as a scheduler's
come): the share of fits whose median prediction came within 10% of the new speed within the ``--after``
steps, and how many steps that took (the median over those fits).

Run: ``python -m experiments.level_shift DIR [DIR ...] [--factors 1,1.25,1.5] [--stalls 2] [--train 40]
[--after 10] [--seeds 3] [--online] [--out FILE]``; one line per folder.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from experiments.folder_check import run
from experiments.outliers import _number, _scores, draws
from goodput import JobModel
from goodput.observations import Observation

__all__ = ["shift_figures", "main", "VARIANTS"]

VARIANTS = {"shifts": True, "plain": False}  # JobModel(level_shifts=...)


def _factors(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or not all(0.1 <= v <= 10.0 for v in values):
        raise argparse.ArgumentTypeError(f"{text}: each factor must lie in [0.1, 10]")
    return values


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--factors", type=_factors, default=(1.0, 1.25, 1.5),
                        help="how many times slower every step becomes, comma-separated (default 1,1.25,1.5; 1: no change)")
    parser.add_argument("--stalls", type=_number(int, 0), default=2,
                        help="stalled steps (5x slower) ending the stalls scenario (default 2; 0: no such scenario)")
    parser.add_argument("--train", type=_number(int, 4), default=40, help="observations before the change per model and seed (default 40)")
    parser.add_argument("--after", type=_number(int, 1), default=10, help="steps after the change (default 10)")
    parser.add_argument("--test", type=_number(int, 1), default=200, help="held-out observations predicted per model and seed (default 200)")
    parser.add_argument("--seeds", type=_number(int, 1), default=3, help="random draws per model (default 3)")
    parser.add_argument("--online", action="store_true",
                        help="also observe the largest factor's steps one at a time: how many until the model follows")


FOLLOWED = 0.1  # online: the median prediction within 10% of the new speed


def _median_ratio(model: JobModel, now: Sequence[Observation]) -> float:
    """The median over ``now`` of the predicted over the actual step time (one vectorised question per type)."""
    ratios = []
    for gpu in dict.fromkeys(o.gpu_type for o in now):
        rows = [o for o in now if o.gpu_type == gpu]
        predicted = model.predict(gpu, np.array([o.num_nodes for o in rows]), np.array([o.num_replicas for o in rows]),
                                  np.array([o.local_bsz for o in rows]), np.array([o.accum_steps for o in rows])).step_time
        ratios.append(np.asarray(predicted, dtype=float) / np.array([o.step_time for o in rows]))
    return float(np.median(np.concatenate(ratios)))


def _steps_to_follow(model: JobModel, after: Sequence[Observation], now: Sequence[Observation]) -> int | None:
    """Observe ``after`` one at a time, asking after each: the first count at which the model follows (``None``: never)."""
    for count, step in enumerate(after, 1):
        if abs(_median_ratio(model.observe(step), now) - 1.0) < FOLLOWED:
            return count
    return None


def shift_figures(models: Mapping[str, Sequence[Observation]], sizes: Mapping[str, float] | None = None,
                  args: Any = None) -> dict[str, Any]:
    """The figures of one folder (module docstring): per factor and variant, the median APE, the 90% coverage and
    the share of fits that found a change; and how many predictions each is over."""
    factors = getattr(args, "factors", (1.0, 1.25, 1.5))
    stalls = getattr(args, "stalls", 2)
    # (label, factor of every step after the change, stalled steps ending them)
    scenarios = [(f"x{factor:g}", factor, 0) for factor in factors] + ([("stalls", 1.0, stalls)] if stalls else [])
    train_n, after_n = getattr(args, "train", 40), getattr(args, "after", 10)
    test_n, seeds = getattr(args, "test", 200), getattr(args, "seeds", 3)
    ape: dict[tuple[str, str], list[np.ndarray]] = {}
    inside: dict[tuple[str, str], list[np.ndarray]] = {}
    found: dict[tuple[str, str], list[bool]] = {}
    follow: dict[str, list[int | None]] = {}
    online = getattr(args, "online", False) and max(factors) != 1.0
    for job, prior, init, rng, untimed, test in draws(models, train_n, test_n, seeds):
        train = [dataclasses.replace(o, timestamp=float(k)) for k, o in enumerate(untimed)]
        repeated = rng.choice(len(train), after_n)
        for label, factor, stalled in scenarios:
            slower = [factor * (5.0 if k >= after_n - stalled else 1.0) for k in range(after_n)]
            after = [dataclasses.replace(train[i], step_time=train[i].step_time * f, timestamp=float(len(train) + k),
                                         sync_time=None if train[i].sync_time is None else train[i].sync_time * f)
                     for k, (i, f) in enumerate(zip(repeated, slower))]
            now = [dataclasses.replace(o, step_time=o.step_time * factor) for o in test]
            for name, shifts in VARIANTS.items():
                model = JobModel(job, init, cluster_prior=prior, level_shifts=shifts).observe(train + after)
                a, c, _ = _scores(model, now)
                ape.setdefault((label, name), []).append(a)
                inside.setdefault((label, name), []).append(c)
                found.setdefault((label, name), []).append(bool(model.level_shifts_found))
                if online and stalled == 0 and factor == max(factors):
                    before = JobModel(job, init, cluster_prior=prior, level_shifts=shifts).observe(train)
                    _median_ratio(before, now)  # its refit, before the change's steps come
                    follow.setdefault(name, []).append(_steps_to_follow(before, after, now))
    out: dict[str, Any] = {}
    for (label, name), parts in ape.items():
        values = np.concatenate(parts)
        out[f"{label}_{name}_median_ape"] = float(np.median(values))
        out[f"{label}_{name}_coverage90"] = float(100.0 * np.mean(np.concatenate(inside[(label, name)])))
        out[f"{label}_{name}_found"] = float(100.0 * np.mean(found[(label, name)]))
        out["predictions"] = int(values.size)
        out["fits"] = len(found[(label, name)])
    for name, counts in follow.items():
        done = [c for c in counts if c is not None]
        out[f"online_{name}_followed"] = float(100.0 * len(done) / len(counts))
        out[f"online_{name}_median_steps"] = float(np.median(done)) if done else None
    return out


def _line(f: Mapping[str, Any]) -> str:
    if "predictions" not in f:
        return "no model with enough observations"
    labels = list(dict.fromkeys(k.split("_")[0] for k in f if k.endswith("_median_ape")))
    parts = []
    for label in labels:
        cells = [f"{name} {f[f'{label}_{name}_median_ape']:.1f}% (cov {f[f'{label}_{name}_coverage90']:.0f}, "
                 f"change found {f[f'{label}_{name}_found']:.0f}%)" for name in VARIANTS]
        parts.append(f"{label}: " + ", ".join(cells))
    for name in VARIANTS:
        if f"online_{name}_followed" in f:
            steps = f[f"online_{name}_median_steps"]
            parts.append(f"online {name}: followed in {f[f'online_{name}_followed']:.0f}% of fits"
                         + (f", after {steps:g} steps (median)" if steps is not None else ""))
    return "; ".join(parts) + f" [{f['predictions']} predictions, {f['fits']} fits each]"


def main(argv: Sequence[str] | None = None) -> int:
    return run(argv, "python -m experiments.level_shift", __doc__.split("\n\n")[0], shift_figures, _line, _options)


if __name__ == "__main__":
    raise SystemExit(main())
