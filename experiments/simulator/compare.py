"""Compare simulation runs of an MLflow experiment: mean ± std over workloads per policy.

Example::

    frame = compare_runs("goodput-sim")           # one row per policy
    save_comparison_plots(frame, "out/compare")    # bar charts with error bars
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_METRICS", "compare_runs", "save_comparison_plots", "runs_frame", "sqlite_path"]

DEFAULT_METRICS = ("avg_jct_s", "median_jct_s", "p99_jct_s", "makespan_s", "gpu_hours_per_job",
                   "restarts_per_job", "contention_mean", "unfair_fraction", "utilization_mean")


def runs_frame(experiment: str, uri: str | None = None) -> Any:
    """Every simulation run (those with a ``policy`` parameter) of ``experiment`` as a DataFrame.

    Only reads: a ``sqlite:///`` store that does not exist is a :class:`FileNotFoundError` (not a new,
    empty database); a store MLflow cannot read is a :class:`~goodput.errors.ValidationError`.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    from goodput import tracking
    from goodput.errors import ValidationError

    tracking._quiet_mlflow()
    uri = tracking.tracking_uri(uri)
    store = sqlite_path(uri)
    if store is not None and not store.is_file():  # reading only: MLflow would create an empty store there
        raise FileNotFoundError(f"no MLflow experiment named {experiment!r}: no tracking store at {store.absolute()} ({uri})")
    if store is not None:
        _check_mlflow_sqlite(store, uri)
    mlflow.set_tracking_uri(uri)
    try:
        if mlflow.get_experiment_by_name(experiment) is None:
            raise FileNotFoundError(f"no MLflow experiment named {experiment!r} in {uri}")
        runs = mlflow.search_runs(experiment_names=[experiment], max_results=100_000)
    except MlflowException as exc:
        reason = " ".join(str(exc).split()).split(". ")[0]
        raise ValidationError("tracking_uri", uri, f"cannot read the MLflow store: {reason}") from None
    if runs.empty or "params.policy" not in runs:
        return runs.iloc[0:0]
    return runs[runs["params.policy"].notna()].reset_index(drop=True)


def _check_mlflow_sqlite(path: Path, uri: str) -> None:
    """Refuse a SQLite file that is not an MLflow store, opened read-only: MLflow would run its migrations on
    any database it is given (the service's goodput.db had gained 65 tables) and a file that is no database
    reached the user as SQLAlchemy's traceback."""
    import sqlite3

    from goodput.errors import ValidationError

    try:
        with contextlib.closing(sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)) as connection:
            tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as exc:
        raise ValidationError("tracking_uri", uri, f"cannot read the MLflow store: {exc}") from None
    if not tables:  # reading only: MLflow would set up its tables in an empty file
        raise FileNotFoundError(f"no MLflow experiment: the tracking store at {path.absolute()} is empty ({uri})")
    if not {"experiments", "runs"} <= tables:
        raise ValidationError("tracking_uri", uri, "is not an MLflow store (no experiments and runs tables); "
                                                   "goodput serve's store is another database")


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///PATH`` tracking URI (relative to the working directory unless
    ``sqlite:////absolute``); ``None`` for other stores and in-memory databases."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


# runs differing in these are not pooled
SETTINGS = ("cluster", "truth", "truth_gpu_type", "round_s", "step_noise", "grad_noise", "report_every", "max_hours",
            "bootstrap_batches", "table_refresh", "restart_cost_s", "observation_bias", "arrival_hours")


def compare_runs(experiment: str, metrics: tuple[str, ...] = DEFAULT_METRICS, uri: str | None = None) -> Any:
    """Per policy: number of runs and mean ± std of each metric over them.

    One run per workload counts (its latest, where a workload was simulated again with the same
    policy and settings). Runs of one policy are pooled only when they share their settings (:data:`SETTINGS`):
    where the experiment holds runs on several clusters, truths, round lengths, noise
    levels, time limits (``max_hours``), ..., those become columns and each combination
    its own row.
    """
    import pandas as pd

    runs = runs_frame(experiment, uri)
    if runs.empty:
        return pd.DataFrame(columns=["policy", "runs"])
    if "params.workload" in runs:
        # a workload run again (a sweep rerun after Ctrl-C logs the finished ones again) counts once, its
        # latest run: each run had been one more workload in the mean ± std
        same = ["params.policy", "params.workload"] + [f"params.{name}" for name in SETTINGS if f"params.{name}" in runs]
        order = runs.sort_values("start_time", kind="stable") if "start_time" in runs else runs
        runs = order.drop_duplicates(subset=same, keep="last")
    varying = [name for name in SETTINGS if f"params.{name}" in runs and runs[f"params.{name}"].nunique(dropna=False) > 1]
    keys = ["params.policy"] + [f"params.{name}" for name in varying]
    rows = []
    for values, group in runs.groupby(keys, sort=True, dropna=False):
        values = values if isinstance(values, tuple) else (values,)
        row: dict[str, Any] = {"policy": values[0], **dict(zip(varying, values[1:])), "runs": len(group)}
        for metric in metrics:
            column = f"metrics.{metric}"
            if column in group:
                values = group[column].dropna()
                row[f"{metric}_mean"] = float(values.mean()) if len(values) else float("nan")
                row[f"{metric}_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
        rows.append(row)
    return pd.DataFrame(rows)


def save_comparison_plots(frame: Any, out_dir: str | Path, metrics: tuple[str, ...] = ("avg_jct_s", "makespan_s",
                          "unfair_fraction", "restarts_per_job")) -> list[Path]:
    """A bar chart with error bars per metric; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric in metrics:
        if f"{metric}_mean" not in frame:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        settings = [c for c in SETTINGS if c in frame]
        labels = [" ".join(str(v) for v in row) for row in frame[["policy", *settings]].itertuples(index=False)]
        ax.bar(labels, frame[f"{metric}_mean"], yerr=frame[f"{metric}_std"], capsize=4, color="#4c72b0")
        ax.set_ylabel(metric)
        ax.set_title(f"{metric}: mean ± std over workloads")
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = out / f"compare_{metric}.png"
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        tmp.replace(path)
        paths.append(path)
    return paths
