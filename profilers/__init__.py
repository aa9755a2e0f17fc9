"""profilers: measure real training jobs with torch, on every device type the machine has.

The public entry points are :func:`profile_job` (DESIGN.md) and, across the
GPU types of a Ray cluster, :func:`profile_cluster`::

    from profilers import profile_cluster, profile_job, zoo
    work = zoo.get("resnet")
    profile = profile_job(**work.profile_args(), out="resnet.jsonl")
    profile = profile_cluster(**work.profile_args(), address="auto", out="resnet-cluster.jsonl")

Modules: :mod:`~profilers.devices` (device types and their names),
:mod:`~profilers.timing` (timing steps), :mod:`~profilers.memory` (peak memory
and out-of-memory), :mod:`~profilers.noise` (gradient statistics),
:mod:`~profilers.sync` (DDP replicas), :mod:`~profilers.zoo` (built-in jobs),
:mod:`~profilers.profile` (the orchestration), :mod:`~profilers.tracking`
(MLflow), :mod:`~profilers.cluster` (one node of every type of a Ray cluster),
:mod:`~profilers.rayutil` (connecting to Ray, a cluster's types, Ray tasks). Names are imported lazily, so spawned replicas and ``goodput --help``
don't pay for what they don't use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "profile_job",
    "profile_cluster",
    "default_grid",
    "ModelFailureError",
    "ClusterProfileError",
    "DeviceType",
    "normalize_device_name",
    "resolve_devices",
    "log_profile",
    "trainable_parameters",
    "Workload",
    "zoo",
]

_LAZY = {
    "profile_job": "profilers.profile",
    "profile_cluster": "profilers.cluster",
    "default_grid": "profilers.profile",
    "ModelFailureError": "profilers.errors",
    "ClusterProfileError": "profilers.errors",
    "DeviceType": "profilers.devices",
    "normalize_device_name": "profilers.devices",
    "resolve_devices": "profilers.devices",
    "log_profile": "profilers.tracking",
    "trainable_parameters": "profilers.profile",
    "Workload": "profilers.zoo",
}


def __getattr__(name: str) -> Any:
    if name == "zoo":
        return importlib.import_module("profilers.zoo")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'profilers' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
