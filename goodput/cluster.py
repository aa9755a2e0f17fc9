"""A heterogeneous GPU cluster and Sia's configuration set.

A cluster is a set of node pools, one per GPU type, each of ``nodes`` identical
nodes with ``gpus_per_node`` GPUs. On the command line it is written
``t4:6x4,a100:2x8`` (type:nodes x GPUs per node).

Sia (Jayaram Subramanya et al., "Sia: Heterogeneity-aware, goodput-optimized
ML-cluster scheduling", SOSP'23, §3.2) restricts each job to a small set of
configurations per GPU type: 1, 2, 4, … GPUs within one node up to a full
node, then whole nodes (2, 3, … nodes × GPUs per node).

Example::

    >>> cluster = Cluster.parse("t4:6x4,a100:2x8,rtx2080ti:3x8")
    >>> len(cluster.configurations())
    19
    >>> cluster.configurations()[:4]
    [('t4', 1, 1), ('t4', 1, 2), ('t4', 1, 4), ('t4', 2, 8)]
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import UnknownGPUTypeError, ValidationError
from .validation import check_int, normalize_gpu_type

__all__ = ["NodePool", "Cluster", "Configuration", "MAX_NODES", "MAX_GPUS_PER_NODE"]

Configuration = tuple[str, int, int]  # (gpu_type, num_nodes, num_gpus)

# counts are ASCII digits only: ``\d`` would also match '٤' or '４', which int() reads as 4
_SPEC_ITEM = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9_.\-]*)\s*:\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*$")


# Bounds of a pool: Sia's set holds one configuration per whole-node count, so a mistyped count (1e9 nodes)
# would fill memory building it. The largest clusters run about 10⁴ nodes and rack-scale "nodes" (NVLink
# domains) hold up to a few hundred GPUs.
MAX_NODES = 100_000
MAX_GPUS_PER_NODE = 1024


@dataclass(frozen=True)
class NodePool:
    """``nodes`` identical nodes of ``gpus_per_node`` GPUs of one type (at most :data:`MAX_NODES` and
    :data:`MAX_GPUS_PER_NODE`)."""

    gpu_type: str
    nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu_type", normalize_gpu_type(self.gpu_type))
        for name, limit in (("nodes", MAX_NODES), ("gpus_per_node", MAX_GPUS_PER_NODE)):
            object.__setattr__(self, name, check_int(f"{self.gpu_type}.{name}", getattr(self, name), minimum=1, maximum=limit))

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_ids(self) -> list[str]:
        """Stable node names: ``"<type>-0"``, ``"<type>-1"``, …"""
        return [f"{self.gpu_type}-{i}" for i in range(self.nodes)]

    def configurations(self, num_stages: int = 1, min_replicas: int = 1) -> list[Configuration]:
        """Sia's set on this pool: 1, 2, 4, … GPUs in one node, then whole nodes.

        For a hybrid-parallel job of ``num_stages`` GPUs per replica
        (:mod:`goodput.hybrid`) the set holds whole pipelines only: 1, 2, 4, …
        pipelines within one node, and the most that fit one node, then the
        whole-node allocations whose GPUs are whole pipelines; all with at
        least ``min_replicas`` pipelines. So a pipeline never spans nodes
        unless it is longer than a node (``num_stages > gpus_per_node``) or a
        node does not hold a whole number of them (a whole-node allocation of
        3-stage pipelines on 4-GPU nodes). ``num_stages=1`` gives Sia's set.
        """
        stages = check_int(f"{self.gpu_type}.num_stages", num_stages, minimum=1)
        least = check_int("min_replicas", min_replicas, minimum=1) * stages
        gpn = self.gpus_per_node
        configs: list[Configuration] = []
        pipelines = 1
        while pipelines * stages < gpn:
            configs.append((self.gpu_type, 1, pipelines * stages))
            pipelines *= 2
        if gpn // stages >= 1:
            configs.append((self.gpu_type, 1, gpn // stages * stages))
        configs.extend((self.gpu_type, n, n * gpn) for n in range(2, self.nodes + 1) if n * gpn % stages == 0)
        return list(dict.fromkeys(c for c in configs if c[2] >= least))


@dataclass(frozen=True)
class Cluster:
    """Node pools by GPU type; build with :meth:`from_dict` or :meth:`parse`."""

    pools: tuple[NodePool, ...]

    def __post_init__(self) -> None:
        pools = tuple(self.pools)
        if not pools:
            raise ValidationError("cluster", pools, "needs at least one node pool")
        for pool in pools:
            if not isinstance(pool, NodePool):
                raise ValidationError("pools", pool, "expected NodePool")
        types = [p.gpu_type for p in pools]
        duplicates = sorted({t for t in types if types.count(t) > 1})
        if duplicates:
            raise ValidationError("gpu_type", duplicates[0], "appears more than once in the cluster")
        object.__setattr__(self, "pools", pools)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, spec: Mapping[str, Mapping[str, Any]]) -> Cluster:
        """``{"t4": {"nodes": 6, "gpus_per_node": 4}, ...}``"""
        if not isinstance(spec, Mapping) or not spec:
            raise ValidationError("cluster", spec, "expected {gpu_type: {'nodes': N, 'gpus_per_node': G}}")
        pools = []
        for gpu_type, entry in spec.items():
            if not isinstance(entry, Mapping):
                raise ValidationError(str(gpu_type), entry, "expected {'nodes': N, 'gpus_per_node': G}")
            unknown = set(entry) - {"nodes", "gpus_per_node"}
            if unknown:
                key = sorted(unknown)[0]
                raise ValidationError(f"{gpu_type}.{key}", entry[key], "unknown key (expected nodes, gpus_per_node)")
            for key in ("nodes", "gpus_per_node"):
                if key not in entry:
                    raise ValidationError(f"{gpu_type}.{key}", None, "missing")
            pools.append(NodePool(gpu_type, entry["nodes"], entry["gpus_per_node"]))
        return cls(tuple(pools))

    @classmethod
    def parse(cls, spec: str) -> Cluster:
        """``"t4:6x4,a100:2x8"`` — type:nodes x GPUs per node, comma-separated."""
        if not isinstance(spec, str) or not spec.strip():
            raise ValidationError("cluster", spec, "expected a spec such as 't4:6x4,a100:2x8'")
        pools = []
        for item in spec.split(","):
            match = _SPEC_ITEM.match(item)
            if not match:
                raise ValidationError("cluster", item.strip(), "expected type:NODESxGPUS in ASCII digits, e.g. 't4:6x4'")
            gpu_type, nodes, gpus = match.groups()
            pools.append(NodePool(gpu_type, int(nodes), int(gpus)))
        return cls(tuple(pools))

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {p.gpu_type: {"nodes": p.nodes, "gpus_per_node": p.gpus_per_node} for p in self.pools}

    def __str__(self) -> str:
        return ",".join(f"{p.gpu_type}:{p.nodes}x{p.gpus_per_node}" for p in self.pools)

    # ------------------------------------------------------------------ queries
    def __iter__(self) -> Iterator[NodePool]:
        return iter(self.pools)

    @property
    def gpu_types(self) -> list[str]:
        return [p.gpu_type for p in self.pools]

    def pool(self, gpu_type: str) -> NodePool:
        name = normalize_gpu_type(gpu_type)
        for pool in self.pools:
            if pool.gpu_type == name:
                return pool
        raise UnknownGPUTypeError(gpu_type, self.gpu_types)

    def capacity(self, gpu_type: str) -> int:
        """GPUs of this type in the cluster."""
        return self.pool(gpu_type).gpus

    @property
    def total_gpus(self) -> int:
        return sum(p.gpus for p in self.pools)

    def configurations(self, num_stages: Any = 1, min_replicas: int = 1) -> list[Configuration]:
        """Sia's configuration set, pool by pool: ``(gpu_type, num_nodes, num_gpus)``.

        ``num_stages`` (an ``int`` or ``{gpu_type: int}``, :mod:`goodput.hybrid`) and ``min_replicas``
        give a hybrid-parallel job's set of whole pipelines (:meth:`NodePool.configurations`).
        """
        from .hybrid import Stages

        stages = Stages.parse(num_stages)
        return [c for pool in self.pools for c in pool.configurations(stages.of(pool.gpu_type), min_replicas)]
