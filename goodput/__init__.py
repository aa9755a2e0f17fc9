"""goodput: measure, model and schedule deep-learning training jobs by goodput.

The public API (see DESIGN.md)::

    from goodput import Observation, Profile, JobModel, GoodputTable, Cluster, allocate
    from goodput import ClusterPrior   # other jobs on the cluster, a new job's prior (goodput.hierarchy)
    from goodput.throughput import ThroughputParams, predict_step_time, fit_throughput
    from goodput.efficiency import efficiency

The names are imported lazily (PEP 562), each from its module on first use:
``import goodput.errors`` or ``goodput.observations`` (what a profiling process,
a Ray worker or a spawned DDP replica needs) does not load the model, the
allocator, scipy and pandas (about 2 s on a 2-core host).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports them on first use
    from .allocator import Allocation, JobAllocation, JobSpec, SolverInfo, allocate  # noqa: F401
    from .cluster import Cluster, NodePool  # noqa: F401
    from .hierarchy import ClusterPrior  # noqa: F401
    from .errors import DataFormatError, UnknownGPUTypeError, ValidationError  # noqa: F401
    from .model import GoodputChoice, JobModel, Prediction  # noqa: F401
    from .observations import Observation, Profile, ProfileWriter  # noqa: F401
    from .table import GoodputTable, load_tables, save_tables  # noqa: F401

__version__ = "0.1.0"

# each public name -> the module that defines it
_LAZY = {
    "allocate": "goodput.allocator",
    "Allocation": "goodput.allocator",
    "JobAllocation": "goodput.allocator",
    "JobSpec": "goodput.allocator",
    "SolverInfo": "goodput.allocator",
    "Cluster": "goodput.cluster",
    "NodePool": "goodput.cluster",
    "ClusterPrior": "goodput.hierarchy",
    "DataFormatError": "goodput.errors",
    "UnknownGPUTypeError": "goodput.errors",
    "ValidationError": "goodput.errors",
    "GoodputChoice": "goodput.model",
    "JobModel": "goodput.model",
    "Prediction": "goodput.model",
    "Observation": "goodput.observations",
    "Profile": "goodput.observations",
    "ProfileWriter": "goodput.observations",
    "GoodputTable": "goodput.table",
    "load_tables": "goodput.table",
    "save_tables": "goodput.table",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module 'goodput' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
