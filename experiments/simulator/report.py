"""Simulation outputs: files, plots and MLflow runs.

``write_outputs`` writes ``summary.json`` (the metrics, settings and per-job
completion times), ``jobs.csv`` and ``rounds.csv`` atomically; ``plot_result``
draws the JCT distribution, utilisation over time and the allocation timeline
by GPU type; ``log_result`` records all of it as one MLflow run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from goodput.io import atomic_write_text

from .engine import SimResult

__all__ = ["write_outputs", "plot_result", "log_result", "summary_payload", "with_idle_rounds"]


def summary_payload(result: SimResult, workload: str) -> dict[str, Any]:
    jcts = {row.name: row.jct_s for row in result.jobs.itertuples() if row.jct_s == row.jct_s and row.jct_s is not None}
    return {"workload": workload, "settings": result.settings, "metrics": _finite(result.summary), "jcts": jcts}


def _finite(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if not (isinstance(v, float) and not math.isfinite(v))}


def write_outputs(result: SimResult, out_dir: str | Path, workload: str) -> list[Path]:
    """``summary.json``, ``jobs.csv``, ``rounds.csv`` and the plots, written atomically into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        atomic_write_text(out / "summary.json", json.dumps(summary_payload(result, workload), indent=2) + "\n"),
        atomic_write_text(out / "jobs.csv", result.jobs.to_csv(index=False)),
        atomic_write_text(out / "rounds.csv", result.rounds.to_csv(index=False)),
    ]
    paths += plot_result(result, out)
    return paths


def plot_result(result: SimResult, out_dir: str | Path) -> list[Path]:
    """Three PNGs: JCT distribution, utilisation over time, allocation timeline by GPU type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = Path(out_dir)
    policy = result.settings.get("policy", "")
    paths = []
    jct = np.sort(result.jobs["jct_s"].dropna().to_numpy(dtype=float)) / 3600.0
    fig, ax = plt.subplots(figsize=(6, 4))
    if len(jct):
        ax.step(jct, np.arange(1, len(jct) + 1) / len(jct), where="post")
        ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(f"JCT distribution — {policy}")
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "jct_cdf.png"))

    rounds = with_idle_rounds(result.rounds, float(result.settings.get("round_s", 0.0)))
    hours = rounds["time_s"].to_numpy(dtype=float) / 3600.0 if len(rounds) else np.array([])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if len(rounds):
        ax.step(hours, rounds["utilization"], where="post", lw=1)
        ax.step(hours, rounds["queued"] / max(rounds["active"].max(), 1), where="post", lw=1, alpha=0.6,
                label="queued / max active")
        ax.legend(loc="upper right")
    ax.set_xlabel("time (hours)")
    ax.set_ylabel("GPU utilisation")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"utilisation — {policy}")
    paths.append(_save(fig, out / "utilization.png"))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    columns = [c for c in rounds.columns if c.startswith("gpus_") and c != "gpus_used"]
    if len(rounds) and columns:
        ax.stackplot(hours, *[rounds[c] for c in columns], labels=[c.removeprefix("gpus_") for c in columns], step="post")
        ax.legend(loc="upper right")
    ax.set_xlabel("time (hours)")
    ax.set_ylabel("GPUs allocated")
    ax.set_title(f"allocation by GPU type — {policy}")
    paths.append(_save(fig, out / "allocation_timeline.png"))
    return paths


def with_idle_rounds(rounds: Any, round_s: float) -> Any:
    """``rounds`` with one all-zero row at the start of each stretch the engine skipped while no job was
    active (it records no round then), so a step plot drops to zero across the gap instead of holding the
    last round's value or drawing a line to the next one. ``round_s``: the round length in seconds."""
    import pandas as pd

    if len(rounds) < 2 or round_s <= 0:
        return rounds
    times = rounds["time_s"].to_numpy(dtype=float)
    gap_starts = times[:-1][times[1:] - times[:-1] > round_s * 1.5] + round_s
    if not len(gap_starts):
        return rounds
    idle = pd.DataFrame({column: 0 for column in rounds.columns}, index=range(len(gap_starts)))
    idle["time_s"] = gap_starts
    idle = idle.astype(rounds.dtypes.to_dict())
    return pd.concat([rounds, idle], ignore_index=True).sort_values("time_s", kind="stable").reset_index(drop=True)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def log_result(result: SimResult, workload: str, out_dir: str | Path, *, experiment: str,
               params: dict[str, Any] | None = None, parent_run_id: str | None = None) -> str:
    """Log one simulation as an MLflow run (a child run when ``parent_run_id`` is given); returns its id."""
    import mlflow

    from goodput import tracking

    tags = {"mlflow.parentRunId": parent_run_id} if parent_run_id else None
    with tracking.start_run(experiment, run_name=f"{result.settings['policy']}:{workload}", tags=tags) as run:
        tracking.log_params({**result.settings, "workload": workload, **(params or {})})
        metrics = {k: float(v) for k, v in _finite(result.summary).items() if isinstance(v, (int, float))}
        mlflow.log_metrics(metrics)
        for path in sorted(Path(out_dir).iterdir()):
            if path.is_file() and not path.name.startswith("."):
                mlflow.log_artifact(str(path))
        return run.info.run_id
