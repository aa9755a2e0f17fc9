"""Small, strict validators shared by every public constructor.

They accept numpy scalars as well as Python numbers, reject ``bool`` where a
number is meant (``True`` is an ``int`` in Python, never a batch size), and
raise :class:`~goodput.errors.ValidationError` naming the field and value.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .errors import ValidationError

MAX_GPU_TYPE_LENGTH = 64  # characters: what the service's goodput query takes (a longer type had been stored, never queryable)
_GPU_TYPE_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.\-]{0,%d}$" % (MAX_GPU_TYPE_LENGTH - 1))
JOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # the service's job names: safe in URLs, file names, labels


MAX_BATCH = 2**53  # the largest batch size (samples) a job may name: tables hold counts as exact float64s


def is_collection(value: Any, *, mappings: bool = True) -> bool:
    """Whether ``value`` holds items to check one by one: iterable, and not a string or bytes (``"t4"`` is one
    name, not two), nor a 0-d numpy array (iterable by type, it raises when iterated), nor, with
    ``mappings=False``, a mapping (its keys are not the items)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or getattr(value, "ndim", None) == 0:
        return False
    return mappings or not isinstance(value, Mapping)


def check_int(field: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` as an ``int``; it must be integral, at least ``minimum`` and at most ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer():
            value = int(value)
        else:
            raise ValidationError(field, value, "expected an integer")
    value = int(value)
    if not -_INT64_LIMIT <= value < _INT64_LIMIT:  # counts go through numpy's int64 and float arithmetic
        raise ValidationError(field, value, "too large (must fit a 64-bit integer)")
    if minimum is not None and value < minimum:
        raise ValidationError(field, value, f"must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValidationError(field, value, f"must be <= {maximum}" + (" (2**53)" if maximum == MAX_BATCH else ""))
    return value


_INT64_LIMIT = 2**63


def check_float(
    field: str,
    value: Any,
    *,
    positive: bool = False,
    nonnegative: bool = False,
) -> float:
    """Return ``value`` as a finite ``float`` (optionally > 0 or >= 0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValidationError(field, value, "expected a real number")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float's range
        raise ValidationError(field, value, "must be finite") from None
    if not math.isfinite(value):
        raise ValidationError(field, value, "must be finite")
    if positive and value <= 0.0:
        raise ValidationError(field, value, "must be > 0")
    if nonnegative and value < 0.0:
        raise ValidationError(field, value, "must be >= 0")
    return value


def check_optional_float(field: str, value: Any, **kwargs: bool) -> float | None:
    """Like :func:`check_float`, but ``None`` passes through."""
    return None if value is None else check_float(field, value, **kwargs)


def check_quantile(field: str, value: Any) -> float:
    """Return ``value`` as a float strictly between 0 and 1 (a quantile or probability)."""
    value = check_float(field, value)
    if not 0.0 < value < 1.0:
        raise ValidationError(field, value, "must be in (0, 1)")
    return value


def check_str(field: str, value: Any) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(field, value, "expected a non-empty string")
    return value


def normalize_gpu_type(value: Any, field: str = "gpu_type") -> str:
    """Lower-case a GPU type name and check it is a plain slug (``"a100"``, ``"rtx2080ti"``)."""
    if not isinstance(value, str):
        raise ValidationError(field, value, "expected a GPU type name such as 't4' or 'cpu'")
    name = value.strip().lower()
    if not _GPU_TYPE_PATTERN.match(name):
        raise ValidationError(
            field, value, "GPU type names are lower-case letters, digits, '_', '-' or '.' (e.g. 'a100'), "
                          f"at most {MAX_GPU_TYPE_LENGTH} characters"
        )
    return name


def check_bounds(field: str, value: Any) -> tuple[int, int] | None:
    """A ``(low, high)`` pair of positive integers with ``low <= high``, or ``None``."""
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValidationError(field, value, "expected a (low, high) pair")
    low = check_int(f"{field}[0]", value[0], minimum=1, maximum=MAX_BATCH)
    high = check_int(f"{field}[1]", value[1], minimum=1, maximum=MAX_BATCH)
    if low > high:
        raise ValidationError(field, value, "low must be <= high")
    return low, high


def check_sizes(field: str, sizes: Any, *, allow_unknown: bool = False) -> dict[str, float]:
    """``{job or model: trainable parameters}`` (``None``: none known), each a positive number.

    ``allow_unknown`` leaves out entries whose value is ``None`` (a size not known).
    """
    if sizes is None:
        return {}
    if not isinstance(sizes, Mapping):
        raise ValidationError(field, sizes, "expected a mapping {job: trainable parameters}")
    return {str(k): check_float(f"{field}[{k!r}]", v, positive=True) for k, v in sizes.items() if not (allow_unknown and v is None)}


def check_job_name(value: Any, field: str = "job") -> str:
    """A job name the service takes (:data:`JOB_NAME_PATTERN`: a letter or digit, then letters, digits,
    '.', '_' or '-', 128 at most), so it reaches the service as one path segment."""
    if not isinstance(value, str) or not re.match(JOB_NAME_PATTERN, value):
        raise ValidationError(field, value, "job names are a letter or digit, then letters, digits, '.', '_' or '-' "
                                            "(128 at most)")
    return value


def check_allocations(nodes: np.ndarray, replicas: np.ndarray, num_stages: int, given_nodes: Any, given_replicas: Any) -> None:
    """Every node holds a GPU: ``num_nodes >= 1``, ``num_replicas >= 1`` and ``num_replicas × num_stages >= num_nodes``
    (``num_stages``: GPUs per replica, :mod:`goodput.hybrid`; a pipeline may span nodes), over arrays of
    allocations; the errors name the values as given."""
    if np.any(nodes < 1):
        raise ValidationError("num_nodes", given_nodes, "must be >= 1")
    if np.any(replicas < 1):
        raise ValidationError("num_replicas", given_replicas, "must be >= 1")
    if np.any(replicas * num_stages < nodes):
        raise ValidationError("num_replicas", given_replicas, "must be >= num_nodes: every node holds a replica"
                              if num_stages == 1 else f"x {num_stages} stages must be >= num_nodes: every node holds a GPU")
