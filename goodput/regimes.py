"""Configuration regimes, and what a job's observations on one GPU type cover.

Pollux's throughput model (Qiao et al., OSDI'21, §3.2) has different sync terms
for one GPU, for several GPUs on one node (intra-node: α_r, β_r) and for several
nodes (inter-node: α_n, β_n). Which of them a type's observations identify
depends on the *regimes* they cover (:data:`REGIMES`): 1 GPU; 2 GPUs on one
node; more GPUs on one node; several nodes. :class:`Regimes` records that for
one type, and :meth:`Regimes.unidentified` names the parameter groups its data
leave to priors (:mod:`goodput.transfer`).

Example::

    >>> config_regime([1, 1, 1, 2], [1, 2, 4, 8]).tolist()
    [0, 1, 2, 3]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .observations import Observation
from .throughput import throughput_arrays

__all__ = ["REGIMES", "Regimes", "config_regime"]

# Configuration regimes: 1 GPU; 2 GPUs on one node; more GPUs on one node; several nodes.
REGIMES = ("one", "intra2", "intramany", "inter")


def config_regime(nodes: Any, replicas: Any) -> np.ndarray:
    """Regime index (into :data:`REGIMES`) of configurations."""
    nodes = np.asarray(nodes, dtype=float)
    replicas = np.asarray(replicas, dtype=float)
    return np.where(replicas <= 1, 0, np.where(nodes > 1, 3, np.where(replicas > 2, 2, 1))).astype(int)


@dataclass(frozen=True)
class Regimes:
    """What a job has been observed in on one GPU type."""

    covered: tuple[int, ...]  # regime indices (REGIMES) with at least one observation
    has_many: bool  # some observation with num_replicas > 2 (on one node or several)
    one_bsz: bool  # a single local batch size
    min_bsz: float  # smallest local batch observed (1-replica observations preferred)
    bsz0: float  # the batch size of a one_bsz type

    @classmethod
    def of(cls, observations: Iterable[Observation]) -> Regimes:
        cols = throughput_arrays(observations)
        nodes, replicas, bsz = cols["num_nodes"], cols["num_replicas"], cols["local_bsz"]
        single = replicas == 1
        return cls(
            covered=tuple(sorted({int(r) for r in config_regime(nodes, replicas)})),
            has_many=bool(np.any(replicas > 2)),
            one_bsz=len(np.unique(bsz)) == 1,
            min_bsz=float(bsz[single].min()) if single.any() else float(bsz.min()),
            bsz0=float(bsz[0]),
        )

    @property
    def has_multi(self) -> bool:
        return any(r > 0 for r in self.covered)

    @property
    def has_single_node_multi(self) -> bool:
        return 1 in self.covered or 2 in self.covered

    @property
    def has_inter(self) -> bool:
        return 3 in self.covered

    def unidentified(self) -> tuple[str, ...]:
        """Parameter groups the type's data cannot identify (mirrors :func:`goodput.throughput.fit_throughput`)."""
        out = []
        if self.one_bsz:
            out.append("alpha_c")
        if not self.has_multi:
            out += ["sync", "slope", "inter", "gamma"]
        else:
            if not self.has_many:
                out.append("slope")
            if not self.has_inter:
                out.append("inter")
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return {"covered": list(self.covered), "has_many": self.has_many, "one_bsz": self.one_bsz,
                "min_bsz": self.min_bsz, "bsz0": self.bsz0}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Regimes:
        return cls(covered=tuple(int(r) for r in data["covered"]), has_many=bool(data["has_many"]),
                   one_bsz=bool(data["one_bsz"]), min_bsz=float(data["min_bsz"]), bsz0=float(data["bsz0"]))
