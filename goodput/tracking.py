"""MLflow at the edges: one place that knows the default store and how runs are opened.

The default tracking store is ``sqlite:///mlflow.db`` in the working
directory (DESIGN.md); ``$MLFLOW_TRACKING_URI`` or an explicit ``tracking_uri``
overrides it. Nothing in the model core imports MLflow.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .errors import ValidationError

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def tracking_uri(uri: str | None = None) -> str:
    """The store to use: ``uri``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def _quiet_mlflow() -> None:
    # MLflow's alembic migrations log at INFO on every new sqlite store.
    import logging

    for name in ("alembic", "mlflow.store.db.utils", "mlflow.tracking", "mlflow.store"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


class TrackingError(ValidationError):
    """The MLflow store refused a run or could not be reached (the field is ``tracking_uri``)."""


# MLflow's codes for a request the caller got wrong (a parameter logged twice with two values, a bad name):
# inside a run these pass unchanged; the store's own refusals (locked, unreachable, ...) do not
CALLER_ERRORS = ("INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST",
                 "INVALID_STATE")


@contextlib.contextmanager
def _refusals_as_errors(uri: str, passing: tuple[str, ...] = ()) -> Iterator[None]:
    """MLflow's refusals (a file store in maintenance mode, a deleted experiment, a server that does not
    answer, a locked database) as a :class:`TrackingError` naming the store, not a traceback; those whose
    ``error_code`` is in ``passing`` go on unchanged."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        if getattr(exc, "error_code", None) in passing:
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise TrackingError("tracking_uri", uri, f"MLflow refused: {first[:300]} "
                            "(set MLFLOW_TRACKING_URI or the command's tracking option)") from None


@contextlib.contextmanager
def start_run(
    experiment: str,
    run_name: str | None = None,
    *,
    uri: str | None = None,
    nested: bool = False,
    tags: Mapping[str, str] | None = None,
) -> Iterator[Any]:
    """Open an MLflow run in ``experiment`` (created if needed) on the chosen store; a store that refuses it
    (a file store in maintenance mode, a deleted experiment, a server that does not answer) is a
    :class:`TrackingError`, there, inside the run (a locked or unreachable store) and at its end; the caller's
    own mistakes inside it (:data:`CALLER_ERRORS`: a parameter changed) pass unchanged."""
    _quiet_mlflow()
    import mlflow

    store = tracking_uri(uri)
    with _refusals_as_errors(store):  # the store's refusals; what the caller logs into the run is the caller's
        mlflow.set_tracking_uri(store)
        mlflow.set_experiment(experiment)
        opened = mlflow.start_run(run_name=run_name, nested=nested, tags=dict(tags or {}))
    with _refusals_as_errors(store, CALLER_ERRORS), opened as run:  # the store's refusals in the run and at its end
        yield run


@contextlib.contextmanager
def parent_run(experiment: str, run_name: str, params: Mapping[str, Any], *, uri: str | None = None) -> Iterator[str]:
    """A run that stays RUNNING while the caller logs child runs under it (``start_run(...,
    tags={"mlflow.parentRunId": id})``); yields its id and ends it FINISHED, KILLED on Ctrl-C, FAILED
    on any other error, so an interrupted sweep does not read as a finished one."""
    _quiet_mlflow()
    import mlflow
    from mlflow.entities import Param

    store = tracking_uri(uri)
    with _refusals_as_errors(store):
        mlflow.set_tracking_uri(store)
        client = mlflow.MlflowClient(store)
        run_id = client.create_run(mlflow.set_experiment(experiment).experiment_id, run_name=run_name).info.run_id
        client.log_batch(run_id, params=[Param(k, v) for k, v in flat_params(params).items()])
    status = "FAILED"
    try:
        yield run_id
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        with _refusals_as_errors(store):
            client.set_terminated(run_id, status)


def flat_params(params: Mapping[str, Any]) -> dict[str, str]:
    """Parameters as MLflow stores them: strings, lists and dicts as compact JSON, at most 6000 characters."""
    flat = {k: (json.dumps(v, sort_keys=True) if isinstance(v, (list, dict, tuple)) else v) for k, v in params.items()}
    return {k: str(v)[:6000] for k, v in flat.items()}


def log_params(params: Mapping[str, Any]) -> None:
    """Log parameters, turning lists and dicts into compact JSON (MLflow stores strings)."""
    import mlflow

    mlflow.log_params(flat_params(params))


def log_json_artifact(data: Any, name: str, artifact_path: str | None = None) -> None:
    """Log ``data`` as a JSON file artifact called ``name``."""
    import mlflow

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(json.dumps(data, indent=2, default=str), encoding="utf-8")
        mlflow.log_artifact(str(path), artifact_path=artifact_path)


def log_frame_artifact(frame: Any, name: str, artifact_path: str | None = None) -> None:
    """Log a pandas DataFrame as a CSV artifact called ``name``."""
    import mlflow

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        frame.to_csv(path, index=False)
        mlflow.log_artifact(str(path), artifact_path=artifact_path)


def log_table(table: Any, prefix: str = "") -> None:
    """Log a :class:`~goodput.table.GoodputTable`: a metric per configuration and the CSV.

    Metric names: ``<prefix>goodput.<gpu_type>.n<nodes>.g<gpus>``, the allocation's nodes and its
    GPUs in all (``cpu.n2.g4``: 2 nodes, 4 GPUs; not a cluster spec's nodes × GPUs per node)."""
    import mlflow

    metrics = {}
    for row in table.frame.itertuples(index=False):
        key = f"{prefix}goodput.{row.gpu_type}.n{row.num_nodes}.g{row.num_gpus}"
        metrics[key] = float(row.goodput)
    mlflow.log_metrics(metrics)
    log_frame_artifact(table.frame, f"{prefix}goodput_table_{_slug(table.job)}.csv")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)
