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


@contextlib.contextmanager
def start_run(
    experiment: str,
    run_name: str | None = None,
    *,
    uri: str | None = None,
    nested: bool = False,
    tags: Mapping[str, str] | None = None,
) -> Iterator[Any]:
    """Open an MLflow run in ``experiment`` (created if needed) on the chosen store."""
    _quiet_mlflow()
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(uri))
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=run_name, nested=nested, tags=dict(tags or {})) as run:
        yield run


def log_params(params: Mapping[str, Any]) -> None:
    """Log parameters, turning lists and dicts into compact JSON (MLflow stores strings)."""
    import mlflow

    flat = {k: (json.dumps(v, sort_keys=True) if isinstance(v, (list, dict, tuple)) else v) for k, v in params.items()}
    mlflow.log_params({k: (str(v)[:6000]) for k, v in flat.items()})


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
    """Log a :class:`~goodput.table.GoodputTable`: a metric per configuration and the CSV."""
    import mlflow

    metrics = {}
    for row in table.frame.itertuples(index=False):
        key = f"{prefix}goodput.{row.gpu_type}.{row.num_nodes}x{row.num_gpus}"
        metrics[key] = float(row.goodput)
    mlflow.log_metrics(metrics)
    log_frame_artifact(table.frame, f"{prefix}goodput_table_{_slug(table.job)}.csv")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)
