"""goodput: measure, model and schedule deep-learning training jobs by goodput.

The public API (see DESIGN.md)::

    from goodput import Observation, Profile, JobModel, GoodputTable, Cluster, allocate
    from goodput import ClusterPrior   # other jobs on the cluster, a new job's prior (goodput.hierarchy)
    from goodput.throughput import ThroughputParams, predict_step_time, fit_throughput
    from goodput.efficiency import efficiency
"""

from .allocator import Allocation, JobAllocation, JobSpec, SolverInfo, allocate
from .cluster import Cluster, NodePool
from .hierarchy import ClusterPrior
from .errors import DataFormatError, UnknownGPUTypeError, ValidationError
from .model import GoodputChoice, JobModel, Prediction
from .observations import Observation, Profile, ProfileWriter
from .table import GoodputTable, load_tables, save_tables

__version__ = "0.1.0"

__all__ = [
    "allocate",
    "Allocation",
    "JobAllocation",
    "JobSpec",
    "SolverInfo",
    "Cluster",
    "NodePool",
    "ClusterPrior",
    "DataFormatError",
    "UnknownGPUTypeError",
    "ValidationError",
    "GoodputChoice",
    "JobModel",
    "Prediction",
    "Observation",
    "Profile",
    "ProfileWriter",
    "GoodputTable",
    "load_tables",
    "save_tables",
]
