"""The accuracy harness's train/test splits: protocols P1, P2, P3 and P5 on one model's observations.

Each function takes every observation of one model (all GPU types) and returns
the :class:`Split` objects of its protocol, or none where the data cannot form
one (a protocol needs both training and test rows). P4, the online protocol,
reveals a type's observations in random order and lives in
:mod:`experiments.accuracy`.

* **P1 cold**: every 1-GPU observation on every type → every multi-GPU
  configuration of those types.
* **P2 one type warm**: P1's training rows plus one type's single-node
  multi-GPU rows → the other types' multi-GPU configurations (one split per
  warm type; Sia's ratio estimator takes the warm type as its reference).
* **P3 multi-node**: a type's single-node rows (with some multi-GPU ones) → its
  multi-node configurations (one split per type).
* **P5 batch sweep**: every other type's 1-GPU rows plus this type's at its
  median batch size → this type's other 1-GPU batch sizes (one split per type
  with at least 3 batch sizes; the reference type is the other type with most rows).

>>> from goodput.observations import Observation
>>> obs = [Observation("j", gpu, 1, r, 32, step_time=0.1 * r) for gpu in ("t4", "v100") for r in (1, 2)]
>>> obs.append(Observation("j", "t4", 2, 4, 32, step_time=0.5))
>>> [(s.stage, len(s.train), len(s.test)) for s in splits_p1(obs)]
[('all', 2, 3)]
>>> [(s.stage, [(o.gpu_type, o.num_replicas) for o in s.test]) for s in splits_p2(obs)]
[('warm=t4', [('v100', 2)]), ('warm=v100', [('t4', 2), ('t4', 4)])]
>>> [(s.stage, len(s.train), len(s.test)) for s in splits_p3(obs)]
[('t4', 2, 1)]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from goodput.observations import Observation, by_gpu_type

__all__ = ["Split", "splits_p1", "splits_p2", "splits_p3", "splits_p5", "SPLITTERS"]


@dataclass
class Split:
    """One train/test split of a protocol.

    ``stage`` names the split within its protocol (``"all"``, ``"warm=<type>"``,
    a GPU type, or P4's ``"order=<seed>"``); ``reference`` is the profiled type
    Sia's ratio estimator scales from (P2, P5), ``None`` elsewhere.
    """

    protocol: str
    stage: str
    train: list[Observation]
    test: list[Observation]
    reference: str | None = None


def splits_p1(obs: Sequence[Observation]) -> list[Split]:
    """P1: 1-GPU observations of every type → the multi-GPU configurations of the types that have them."""
    train = [o for o in obs if o.num_replicas == 1]
    types = {o.gpu_type for o in train}
    test = [o for o in obs if o.num_replicas > 1 and o.gpu_type in types]
    return [Split("P1", "all", train, test)] if train and test else []


def splits_p2(obs: Sequence[Observation]) -> list[Split]:
    """P2: P1 plus one type's single-node multi-GPU observations → the other types' multi-GPU ones (each type warm in turn)."""
    single = [o for o in obs if o.num_replicas == 1]
    types = {o.gpu_type for o in single}
    out = []
    for warm, items in sorted(by_gpu_type(obs).items()):
        multi = [o for o in items if o.num_replicas > 1 and o.num_nodes == 1]
        if not multi or warm not in types:
            continue
        test = [o for o in obs if o.num_replicas > 1 and o.gpu_type != warm and o.gpu_type in types]
        if test:
            out.append(Split("P2", f"warm={warm}", single + multi, test, reference=warm))
    return out


def splits_p3(obs: Sequence[Observation]) -> list[Split]:
    """P3: a type's single-node observations (some multi-GPU) → its multi-node configurations, per type."""
    out = []
    for gpu, items in sorted(by_gpu_type(obs).items()):
        train = [o for o in items if o.num_nodes == 1]
        test = [o for o in items if o.num_nodes > 1]
        if train and test and any(o.num_replicas > 1 for o in train):
            out.append(Split("P3", gpu, train, test))
    return out


def splits_p5(obs: Sequence[Observation]) -> list[Split]:
    """P5: the other types' 1-GPU sweeps plus one batch size on this type → its other 1-GPU batch sizes, per type."""
    single = [o for o in obs if o.num_replicas == 1 and o.accum_steps == 0]
    by_type = by_gpu_type(single)
    out = []
    for gpu, items in sorted(by_type.items()):
        sizes = sorted({o.local_bsz for o in items})
        others = [o for t, rows in by_type.items() if t != gpu for o in rows]
        if len(sizes) < 3 or not others:
            continue
        b0 = sizes[len(sizes) // 2]
        train = others + [o for o in items if o.local_bsz == b0]
        test = [o for o in items if o.local_bsz != b0]
        reference = max((t for t in by_type if t != gpu), key=lambda t: (len(by_type[t]), t))
        out.append(Split("P5", gpu, train, test, reference=reference))
    return out


P4_MIN_OBS = 15  # P4 runs on a type with at least this many observations of the model

# What each protocol tests of a type's rows, and what it needs to test them (for the report's notes)
_TESTS: dict[str, tuple[Callable[[Observation], bool], str, str]] = {
    "P1": (lambda o: o.num_replicas > 1, "multi-GPU", "1-GPU rows on that type"),
    "P2": (lambda o: o.num_replicas > 1, "multi-GPU",
           "1-GPU rows on that type and another type with 1-GPU and single-node multi-GPU rows"),
    "P3": (lambda o: o.num_nodes > 1, "multi-node", "single-node multi-GPU rows on that type"),
    "P4": (lambda o: True, "", f"at least {P4_MIN_OBS} rows on that type"),
    "P5": (lambda o: o.num_replicas == 1 and o.accum_steps == 0, "1-GPU",
           "3 or more 1-GPU batch sizes on that type, and another type's 1-GPU rows"),
}


def untested(models: Mapping[str, Sequence[Observation]], tested: Mapping[str, set[tuple[str, str]]]) -> list[str]:
    """One note per protocol run, model and GPU type whose rows that protocol could have tested but did not
    (``tested``: protocol → the (model, type) pairs its rows hold), with what the protocol needs; a type
    had disappeared from every static protocol without a word."""
    notes = []
    for protocol, pairs in tested.items():
        testable, kind, needs = _TESTS[protocol]
        for model, observations in sorted(models.items()):
            for gpu, items in sorted(by_gpu_type(observations).items()):
                count = sum(1 for o in items if testable(o))
                if count and (model, gpu) not in pairs:
                    rows = f"{count} {kind} row(s)".replace("  ", " ")
                    notes.append(f"{protocol}: {model}/{gpu}: {rows} not tested (it needs {needs})")
    return notes


SPLITTERS: dict[str, Callable[[Sequence[Observation]], list[Split]]] = {
    "P1": splits_p1, "P2": splits_p2, "P3": splits_p3, "P5": splits_p5,
}
