"""What a few stalled steps among a job's observations do to its model: Student-t noise against Gaussian.

Real training loops have steps far slower than their configuration's typical one (a checkpoint, a
garbage collection, a data loader that stalls). For each model of a measurement folder and each seed,
``--train`` of its observations (at most half of them), chosen at random, are given to a :class:`~goodput.JobModel` with the
cluster prior of the folder's other models (leave-one-model-out, as ``goodput accuracy`` builds it),
and the model predicts up to ``--test`` of the others: once as they are (*clean*), once with a
``--fraction`` of the training steps (at least one) made ``--factor`` times slower (*stalled*). Each
twice: with the step noise the model takes by default (*default*) (the cluster's Student-t tails,
:attr:`goodput.gp.HyperPrior.noise_dof`, else :data:`goodput.tails.DEFAULT_NOISE_DOF`) and
with Gaussian noise (*gaussian*: ``noise_dof=inf``, what the model did before its fit read the tails). Figures:
the median APE of the predicted step time (percent) and the share of held-out steps inside the
90% interval, over every prediction of the folder.

Run: ``python -m experiments.outliers DIR [DIR ...] [--train 40] [--fraction 0.05] [--factor 5] [--seeds 3]
[--out FILE]``; one line per folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from experiments.folder_check import run
from goodput import JobModel
from goodput.hierarchy import ClusterPrior
from goodput.observations import Observation

__all__ = ["stall_figures", "draws", "main", "VARIANTS"]

VARIANTS = {"default": None, "gaussian": math.inf}  # JobModel(noise_dof=...): the model's default, and Gaussian noise


def _number(kind: type, low: float, high: float = math.inf) -> Any:
    """An argparse type: a ``kind`` in [low, high], else argparse's error naming the value."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is outside [{low}, {high}]")
        return value
    return parse


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train", type=_number(int, 4), default=40, help="training observations per model and seed (default 40)")
    parser.add_argument("--test", type=_number(int, 1), default=200, help="held-out observations predicted per model and seed (default 200)")
    parser.add_argument("--fraction", type=_number(float, 0.0, 1.0), default=0.05,
                        help="share of the training steps stalled (default 0.05, at least one)")
    parser.add_argument("--factor", type=_number(float, 1.0), default=5.0, help="how many times slower a stalled step is (default 5)")
    parser.add_argument("--seeds", type=_number(int, 1), default=3, help="random draws per model (default 3)")


def _scores(model: JobModel, test: Sequence[Observation]) -> tuple[np.ndarray, np.ndarray, float]:
    """APE (percent) of each held-out step's predicted step time, whether its 90% interval holds it, and the
    noise's degrees of freedom the model predicted with."""
    ape, inside, dof = [], [], math.nan
    for o in test:
        p = model.predict(o.gpu_type, o.num_nodes, o.num_replicas, o.local_bsz, o.accum_steps)
        low, high = p.interval(0.9)
        ape.append(100.0 * abs(float(p.step_time) / o.step_time - 1.0))
        inside.append(float(low) <= o.step_time <= float(high))
        dof = p.noise_dof
    return np.array(ape), np.array(inside), dof


def draws(models: Mapping[str, Sequence[Observation]], train_n: int, test_n: int,
          seeds: int) -> Iterator[tuple[str, ClusterPrior | None, int, np.random.Generator, list[Observation], list[Observation]]]:
    """Each model's random draws: ``(job, its leave-one-model-out cluster prior, its smallest batch, the draw's
    generator, train, test)``, ``train_n`` observations (at most half of a model's, none under 4) in a random
    order and up to ``test_n`` of the others, one draw per seed."""
    for job, observations in sorted(models.items()):
        n_train = min(train_n, len(observations) // 2)  # a small model: half its observations
        if n_train < 4:
            continue
        others = {k: v for k, v in models.items() if k != job}
        prior = ClusterPrior.from_observations(others) if len(others) >= 2 else None
        init = min(o.batch_size for o in observations)
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            order = rng.permutation(len(observations))
            yield (job, prior, init, rng, [observations[i] for i in order[:n_train]],
                   [observations[i] for i in order[n_train:n_train + test_n]])


def stall_figures(models: Mapping[str, Sequence[Observation]], sizes: Mapping[str, float] | None = None,
                  args: Any = None) -> dict[str, Any]:
    """The figures of one folder (module docstring): for each variant and each of clean / stalled, the median APE
    and the 90% coverage, and how many predictions they are over."""
    train_n, test_n = getattr(args, "train", 40), getattr(args, "test", 200)
    fraction, factor, seeds = getattr(args, "fraction", 0.05), getattr(args, "factor", 5.0), getattr(args, "seeds", 3)
    ape: dict[tuple[str, str], list[np.ndarray]] = {}
    inside: dict[tuple[str, str], list[np.ndarray]] = {}
    dofs: dict[str, float] = {}
    for job, prior, init, rng, train, test in draws(models, train_n, test_n, seeds):
        stalled = list(train)
        for i in rng.choice(len(train), max(1, round(fraction * len(train))), replace=False):
            stalled[i] = dataclasses.replace(stalled[i], step_time=stalled[i].step_time * factor)
        for name, dof in VARIANTS.items():
            for kind, data in (("clean", train), ("stalled", stalled)):
                model = JobModel(job, init, cluster_prior=prior, noise_dof=dof).observe(data)
                a, c, dof_used = _scores(model, test)
                if name == "default":
                    dofs[job] = dof_used
                ape.setdefault((name, kind), []).append(a)
                inside.setdefault((name, kind), []).append(c)
    out: dict[str, Any] = {"noise_dof": dofs}
    for (name, kind), parts in ape.items():
        values = np.concatenate(parts)
        out[f"{name}_{kind}_median_ape"] = float(np.median(values))
        out[f"{name}_{kind}_coverage90"] = float(100.0 * np.mean(np.concatenate(inside[(name, kind)])))
        out["predictions"] = int(values.size)
    return out


def _line(f: Mapping[str, Any]) -> str:
    if "predictions" not in f:
        return "no model with enough observations"
    parts = [f"{name}: clean {f[f'{name}_clean_median_ape']:.1f}% (cov {f[f'{name}_clean_coverage90']:.0f}) -> stalled "
             f"{f[f'{name}_stalled_median_ape']:.1f}% (cov {f[f'{name}_stalled_coverage90']:.0f})" for name in VARIANTS]
    dofs = sorted({round(v, 1) for v in f["noise_dof"].values()})
    return "; ".join(parts) + f" [{f['predictions']} predictions each; the default's noise dof: {', '.join(map(str, dofs))}]"


def main(argv: Sequence[str] | None = None) -> int:
    return run(argv, "python -m experiments.outliers", __doc__.split("\n\n")[0], stall_figures, _line, _options)


if __name__ == "__main__":
    raise SystemExit(main())
