"""Derive a multi-type measurement folder from Pollux's T4 traces, for exercising the accuracy harness.

The held-out data that issue 4's targets are stated on has 6 models on 5 GPU
types, with multi-GPU and multi-node placements; the shared data has that
layout only on one type (Pollux's T4 traces). This writes, for each model of
a Pollux trace folder and each derived type with compute factor ``c`` and
sync factor ``s`` (``s_n`` on placements over several nodes, when given;
else ``s`` there too)::

    step_time' = (step_time − sync_time) · c + sync_time · s
    sync_time' = sync_time · s

as ``<model>/placements-<type>.csv`` and ``<model>/scalability-<type>.csv``
(the layout ``goodput accuracy`` reads), so that every protocol, P2's
rotation of the warm type included, runs at the held-out data's size.

The result is **derived, not measured**: every type shares T4's placement
effects and noise, scaled. Its figures say which way a change moves the
error on that layout, not how large the error on real hardware would be
(issue 4's rounds 4 and 5, in the git history of ``experiments/results/accuracy.md``). It is written outside
the repository: the shared data is never copied into it.

Run: ``python -m experiments.derive_types OUT [--data DIR] [--type NAME=C,S ...]``,
then ``goodput accuracy OUT``. ``--type`` replaces the default types, e.g.
``--type t4=1,1 --type half=0.5,0.5`` for types that scale compute and sync
alike (on which every prediction should scale too: issue 4's round 13).
A third factor sets the sync over several nodes apart from the sync within
one: ``--type a100=0.3,0.25,0.8`` (NVLink within a node, the cluster's
network between them), so the types' placement effects differ, as on real
hardware (:data:`SPLIT_SYNC_TYPES`). ``--interactions C,S,S_N`` gives each
model its own factors on each type but the first, the type's times a
log-normal of those standard deviations (seed ``--seed``): jobs that differ
from type to type in more than the type's scale, as real jobs do (a model
whose kernels suit one architecture; ``accuracy.md``), where the plain sets
have none: Gavel's models' 1-GPU speedups between two of its types spread
0.47–0.87 in log, which ``--interactions 0.5,0.4,0.3`` matches (``accuracy.md``'s
strong-interaction set). ``--uneven`` measures the types unevenly, as a real
cluster's are (:data:`UNEVEN_COVERAGE`): the larger local batches left out on a
type with less memory, a type on one node only, a type without the scalability runs.
``--batch-sizes N`` keeps each model's rows on each type at N of its local batches
alone, drawn at random (seed ``--seed``): profiles taken at a few batch sizes, as
a real cluster's are, where the traces sweep 5-21 of them.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.datasets import default_data_dir, read_csv_rows
from goodput.errors import DataFormatError, ValidationError
from goodput.io import atomic_write_text, check_out_path

__all__ = ["DERIVED_TYPES", "SPLIT_SYNC_TYPES", "UNEVEN_COVERAGE", "Coverage", "derive", "main"]

# (compute factor, sync factor) per derived type, relative to T4: faster compute, and a sync
# that improves less than compute does (so sync weighs more on the faster types). Chosen once
# for round 4, not fitted to anything.
DERIVED_TYPES: dict[str, tuple[float, float]] = {
    "t4": (1.0, 1.0),
    "v100": (0.45, 0.7),
    "a100": (0.3, 0.5),
    "rtx6000": (0.7, 1.2),
    "2080ti": (0.8, 1.4),
}
# (compute, sync within a node, sync over several nodes): the same compute, intra-node sync that differs more
# across types than the network does (NVLink on V100/A100 nodes, PCIe on the others). Chosen once, to probe
# whether one type's single-node data mislead the others' multi-node predictions; not fitted to anything.
SPLIT_SYNC_TYPES: dict[str, tuple[float, float, float]] = {
    "t4": (1.0, 1.0, 1.0),
    "v100": (0.45, 0.5, 0.9),
    "a100": (0.3, 0.25, 0.8),
    "rtx6000": (0.7, 1.2, 1.0),
    "2080ti": (0.8, 1.6, 1.2),
}


@dataclass(frozen=True)
class Coverage:
    """Which of a model's measurements a type keeps: local batches up to ``max_bsz_fraction`` of the model's
    largest (GPU memory), placements over at most ``max_nodes`` nodes, and the scalability runs or not."""

    max_bsz_fraction: float = 1.0
    max_nodes: int | None = None
    scalability: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_bsz_fraction, bool) or not (isinstance(self.max_bsz_fraction, (int, float)) and 0 < self.max_bsz_fraction <= 1):
            raise ValidationError("max_bsz_fraction", self.max_bsz_fraction, "expected a fraction in (0, 1]")
        if self.max_nodes is not None and (isinstance(self.max_nodes, bool) or not (isinstance(self.max_nodes, int) and self.max_nodes >= 1)):
            raise ValidationError("max_nodes", self.max_nodes, "expected an integer >= 1, or None")


# --uneven: what a real cluster's types leave out, chosen once (not fitted): a 2080 Ti holds 11 GB against a T4's
# 16 (the larger local batches do not fit), the RTX 6000s sit in one node, the V100s ran no scalability job.
UNEVEN_COVERAGE: dict[str, Coverage] = {
    "2080ti": Coverage(max_bsz_fraction=11 / 16),
    "rtx6000": Coverage(max_nodes=1),
    "v100": Coverage(scalability=False),
}
_PLACEMENTS = {"placement": "placement", "local_bsz": "int+", "step_time": "float+", "sync_time": "float0"}
_SCALABILITY = {"num_nodes": "int+", "num_replicas": "int+", "local_bsz": "int+", "step_time": "float+", "sync_time": "float0"}
_REPOSITORY = Path(__file__).resolve().parents[1]


def _scaled(step: float, sync: float, compute_factor: float, sync_factor: float) -> tuple[float, float]:
    return (step - sync) * compute_factor + sync * sync_factor, sync * sync_factor


def _nodes(row: Mapping[str, object]) -> int:
    """Nodes a placements row (its digit string) or a scalability row (``num_nodes``) spans."""
    return int(row["num_nodes"]) if "num_nodes" in row else len(row["placement"])


def _derive_file(source: Path, schema: Mapping[str, str], factors: tuple[float, ...],
                 coverage: Coverage = Coverage(), max_bsz: int | None = None, batches: frozenset[int] | None = None) -> str | None:
    """The CSV text of ``source`` (validated row by row) with its times scaled by ``factors``
    (compute, sync[, sync over several nodes]), the rows ``coverage`` keeps alone (local batches relative to
    ``max_bsz``, the model's largest) and, given ``batches``, those at these local batches alone; ``None`` when
    it keeps none."""
    columns = list(schema)
    lines = [",".join(columns)]
    for line_no, row in read_csv_rows(source, schema):
        if row["sync_time"] > row["step_time"]:
            raise DataFormatError(source, line_no, "sync_time", row["sync_time"], f"must be <= step_time ({row['step_time']})")
        if ((max_bsz is not None and row["local_bsz"] > coverage.max_bsz_fraction * max_bsz)
                or (coverage.max_nodes is not None and _nodes(row) > coverage.max_nodes)
                or (batches is not None and row["local_bsz"] not in batches)):
            continue
        sync = factors[2] if len(factors) == 3 and _nodes(row) > 1 else factors[1]
        row["step_time"], row["sync_time"] = _scaled(row["step_time"], row["sync_time"], factors[0], sync)
        if "placement" in row:  # read as GPUs per node: written back as its digit string
            row["placement"] = "".join(map(str, row["placement"]))
        lines.append(",".join(repr(row[c]) if isinstance(row[c], float) else str(row[c]) for c in columns))
    return "\n".join(lines) + "\n" if len(lines) > 1 else None


def derive(trace_dir: str | Path, out_dir: str | Path, types: Mapping[str, tuple[float, ...]] = DERIVED_TYPES,
           interactions: tuple[float, float, float] | None = None, seed: int = 0,
           coverage: Mapping[str, Coverage] | None = None, batch_sizes: int | None = None) -> list[Path]:
    """Write the derived folder; returns the files written.

    Args:
        trace_dir: Pollux's ``traces`` folder (``<model>/placements.csv``, optional ``scalability.csv``).
        out_dir: where to write; refused inside this repository.
        types: per GPU type name, ``(compute factor, sync factor)`` or ``(compute, sync within a node,
            sync over several nodes)``, all > 0.
        interactions: standard deviations (in log, each >= 0) of each model's own factor on its compute,
            sync within a node and sync over several nodes, drawn per (model, type) for every type but the
            first (the reference, left as measured) and multiplied into the type's factors; ``None``: none.
        seed: the draws' seed (numpy's default generator; models in name order, types in ``types``'s order).
        coverage: per type name, the rows it keeps (:class:`Coverage`; a type not named keeps all, a file
            left empty is not written), e.g. :data:`UNEVEN_COVERAGE`.
        batch_sizes: each (model, type) keeps its rows at this many of the model's local batches (those its
            coverage keeps) alone, drawn without replacement (seeded by ``seed``, apart from the interactions'
            draws, so a set with and without it has the same factors); ``None``: every batch.
    """
    trace_dir, out_dir = Path(trace_dir), Path(out_dir)
    if not trace_dir.is_dir():
        raise ValidationError("trace_dir", str(trace_dir), "not a directory")
    if out_dir.resolve().is_relative_to(_REPOSITORY):
        raise ValidationError("out_dir", str(out_dir), "derived data stays outside the repository")
    if not types:
        raise ValidationError("types", dict(types), "need at least one derived type")
    for name, factors in types.items():
        if len(factors) not in (2, 3) or not all(isinstance(f, (int, float)) and math.isfinite(f) and f > 0 for f in factors):
            raise ValidationError(f"types[{name!r}]", factors, "expected (compute factor, sync factor[, inter-node sync factor]), "
                                  "all finite and > 0")
    if interactions is not None and (len(interactions) != 3 or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                                                                       for v in interactions)):
        raise ValidationError("interactions", interactions, "expected (compute, sync, inter-node sync) standard deviations, finite and >= 0")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValidationError("seed", seed, "expected an integer >= 0")
    if batch_sizes is not None and (isinstance(batch_sizes, bool) or not isinstance(batch_sizes, int) or batch_sizes < 1):
        raise ValidationError("batch_sizes", batch_sizes, "expected an integer >= 1, or None")
    coverage = dict(coverage or {})
    for name, kept in coverage.items():
        if not isinstance(kept, Coverage):
            raise ValidationError(f"coverage[{name!r}]", kept, "expected a Coverage")
    check_out_path("out_dir", out_dir, "folder")
    models = sorted(p for p in trace_dir.iterdir() if (p / "placements.csv").is_file())
    if not models:
        raise ValidationError("trace_dir", str(trace_dir), "no <model>/placements.csv below it")
    # written beside it, then swapped in whole: the folder holds this run's types alone (an earlier run's stayed
    # before, and a failed run left half a folder)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        written = _derive_all(models, building, types, interactions, seed, coverage, batch_sizes)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old."))
            out_dir.rename(old / "x")
            building.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            building.rename(out_dir)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return [out_dir / p.relative_to(building) for p in written]


def _derive_all(models: list[Path], out_dir: Path, types: Mapping[str, tuple[float, ...]],
                interactions: tuple[float, float, float] | None, seed: int, coverage: Mapping[str, Coverage],
                batch_sizes: int | None = None) -> list[Path]:
    rng = np.random.default_rng(seed)
    batch_rng = np.random.default_rng([seed, 1])  # a stream of its own: the interactions' draws stay as they are
    written = []
    reads_bsz = batch_sizes is not None or any(kept.max_bsz_fraction < 1 for kept in coverage.values())
    for model in models:
        # the model's local batches, read only where a type keeps a fraction or a few of them
        sizes = sorted({row["local_bsz"] for _, row in read_csv_rows(model / "placements.csv", _PLACEMENTS)}) if reads_bsz else []
        max_bsz = sizes[-1] if sizes else None
        for k, (gpu, factors) in enumerate(types.items()):
            kept = coverage.get(gpu, Coverage())
            batches = None
            if batch_sizes is not None:
                allowed = [b for b in sizes if b <= kept.max_bsz_fraction * sizes[-1]]
                batches = frozenset(int(b) for b in batch_rng.choice(allowed, min(batch_sizes, len(allowed)), replace=False))
            if interactions is not None and k > 0:
                full = (factors[0], factors[1], factors[-1])  # (compute, intra, inter)
                factors = tuple(float(f * np.exp(rng.normal(0.0, sd))) for f, sd in zip(full, interactions))
            for name, schema in (("placements", _PLACEMENTS), ("scalability", _SCALABILITY)):
                source = model / f"{name}.csv"
                if source.is_file() and (name == "placements" or kept.scalability):
                    text = _derive_file(source, schema, factors, kept, max_bsz, batches)
                    if text is not None:
                        written.append(atomic_write_text(out_dir / model.name / f"{name}-{gpu}.csv", text))
    return written


def _parse_type(text: str) -> tuple[str, tuple[float, ...]]:
    """``NAME=C,S[,S_N]`` (compute factor, sync factor[, inter-node sync factor]) of ``--type``."""
    name, sep, factors = text.partition("=")
    parts = factors.split(",")
    if sep and name and len(parts) in (2, 3):
        try:
            return name, tuple(float(p) for p in parts)
        except ValueError:
            pass
    raise ValidationError("--type", text, "expected NAME=COMPUTE,SYNC[,INTER_NODE_SYNC], e.g. v100=0.45,0.7")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.derive_types", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder to write (outside the repository)")
    parser.add_argument("--data", default=None, help="shared data folder (default: ../shared/data or $GOODPUT_DATA_DIR)")
    parser.add_argument("--type", action="append", default=None, metavar="NAME=C,S[,S_N]",
                        help="a derived type and its compute and sync factors relative to T4 (a third: the sync over "
                             "several nodes), repeatable "
                             f"(default: {' '.join(f'{n}={c},{s}' for n, (c, s) in DERIVED_TYPES.items())})")
    parser.add_argument("--split-sync", action="store_true",
                        help="the types of SPLIT_SYNC_TYPES, whose sync within a node and over several differ: "
                             f"{' '.join(f'{n}=' + ','.join(map(str, f)) for n, f in SPLIT_SYNC_TYPES.items())}")
    parser.add_argument("--interactions", default=None, metavar="C,S,S_N",
                        help="each model's own log-normal factors per type (all types but the first): standard deviations "
                             "of its compute, sync within a node and sync over several nodes, e.g. 0.1,0.25,0.2")
    parser.add_argument("--uneven", action="store_true",
                        help="measure the types unevenly (UNEVEN_COVERAGE): "
                             + "; ".join(f"{n}: {c}" for n, c in UNEVEN_COVERAGE.items()))
    parser.add_argument("--batch-sizes", type=int, default=None, metavar="N",
                        help="each model keeps its rows on each type at N of its local batches alone, drawn at random")
    parser.add_argument("--seed", type=int, default=0, help="seed of --interactions' and --batch-sizes' draws (default 0)")
    args = parser.parse_args(argv)
    data = Path(args.data) if args.data else default_data_dir()
    if data is None:
        print("no shared data folder found: pass --data DIR", file=sys.stderr)
        return 2
    try:
        types: Mapping[str, tuple[float, ...]] = SPLIT_SYNC_TYPES if args.split_sync else DERIVED_TYPES
        if args.type and args.split_sync:
            raise ValidationError("--split-sync", True, "pass --type or --split-sync, not both")
        if args.type:
            parsed = [_parse_type(t) for t in args.type]
            types = dict(parsed)
            if len(types) < len(parsed):
                raise ValidationError("--type", args.type, "a type is named more than once")
        interactions = None
        if args.interactions is not None:
            try:
                interactions = tuple(float(v) for v in args.interactions.split(","))
            except ValueError:
                raise ValidationError("--interactions", args.interactions, "expected C,S,S_N, e.g. 0.1,0.25,0.2") from None
        written = derive(data / "pollux" / "traces", args.out, types, interactions, args.seed,
                         UNEVEN_COVERAGE if args.uneven else None, args.batch_sizes)
    except (ValidationError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    models = len({p.parent for p in written})
    print(f"wrote {len(written)} files: {models} models × {len(types)} types ({', '.join(types)}) in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
