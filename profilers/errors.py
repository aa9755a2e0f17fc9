"""Errors the profilers raise.

A model that cannot run (a shape error, a non-finite loss, a loss function that
returns the wrong thing) is a :class:`ModelFailureError`: a
:class:`~goodput.errors.ValidationError` (so a ``ValueError``) that names the
device type and the local batch size it failed at. Running out of device memory
is not an error: it ends the batch-size sweep (see :mod:`profilers.memory`).

Example::

    >>> err = ModelFailureError("cpu", 16, "RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    >>> str(err)
    "model failed on device type 'cpu' at local batch size 16: RuntimeError: mat1 and mat2 shapes cannot be multiplied"
"""

from __future__ import annotations

from typing import Any

from goodput.errors import ValidationError

__all__ = ["ModelFailureError", "ClusterProfileError"]


class ModelFailureError(ValidationError):
    """The job's model failed on a device type at a local batch size.

    Attributes:
        gpu_type: the device type (``"cpu"``, ``"h100"``).
        local_bsz: the per-replica batch size, samples.
        num_replicas: data-parallel replicas of the failing run (1 for the sweep).
        reason: what went wrong.
    """

    def __init__(self, gpu_type: str, local_bsz: int, reason: str, num_replicas: int = 1) -> None:
        super().__init__("local_bsz", local_bsz, reason)
        self.gpu_type = gpu_type
        self.local_bsz = local_bsz
        self.num_replicas = num_replicas
        replicas = "" if num_replicas == 1 else f" with {num_replicas} replicas"
        self.args = (f"model failed on device type {gpu_type!r} at local batch size {local_bsz}{replicas}: {reason}",)

    def __reduce__(self):  # picklable across processes
        return (type(self), (self.gpu_type, self.local_bsz, self.reason, self.num_replicas))


class ClusterProfileError(RuntimeError):
    """:func:`profilers.profile_cluster` finished, but the tasks of some device types failed.

    The other types' observations are kept (in ``out`` and in ``profile``); a rerun with the
    same ``out`` redoes only the failed and missing types.

    Attributes:
        failures: per failed device type, what went wrong (the task's error, one line).
        profile: the profile of everything measured, the failed types' partial observations included.
    """

    def __init__(self, failures: dict[str, str], profile: Any) -> None:
        self.failures = dict(failures)
        self.profile = profile
        listed = "; ".join(f"{gpu_type}: {error}" for gpu_type, error in self.failures.items())
        kept = ", ".join(profile.gpu_types) if profile is not None and len(profile) else "none"
        super().__init__(f"profiling failed on {len(self.failures)} device type(s) ({listed}); observations kept of: {kept}")

    def __reduce__(self):  # picklable across processes
        return (type(self), (self.failures, self.profile))
