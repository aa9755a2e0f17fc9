"""The library's errors survive pickling, so a worker process's error reaches its parent as itself."""

from __future__ import annotations

import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest

from experiments.accuracy import ResumeMismatchError
from goodput.errors import DataFormatError, UnknownGPUTypeError, ValidationError
from profilers.errors import ModelFailureError

EXAMPLES = [
    ValidationError("round_s", 0.0, "must be > 0"),
    UnknownGPUTypeError("h900", ["a100", "t4"]),
    UnknownGPUTypeError("h900", (), field="cluster"),
    DataFormatError("/tmp/x.jsonl", 3, "step_time", -1.0, "must be > 0"),
    DataFormatError("/tmp/x.csv", None, "placement", "", "empty"),
    ModelFailureError("cpu", 16, "RuntimeError: boom", num_replicas=2),
    ResumeMismatchError("settings", {"seeds": 2}, "differs"),
]


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_errors_round_trip_through_pickle(error: ValidationError) -> None:
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is type(error)
    assert str(clone) == str(error)
    assert (clone.field, clone.value, clone.reason) == (error.field, error.value, error.reason)
    assert vars(clone) == vars(error)


def _refuse(value: float) -> None:
    raise ValidationError("round_s", value, "must be > 0")


def test_a_worker_process_error_reaches_the_parent_as_itself() -> None:
    with ProcessPoolExecutor(max_workers=1) as pool:
        future = pool.submit(_refuse, 0.0)
        with pytest.raises(ValidationError, match=r"round_s=0\.0: must be > 0"):
            future.result(timeout=60)
