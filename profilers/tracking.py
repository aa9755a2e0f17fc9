"""Logging a profile to MLflow: parameters, a throughput metric per observation, the file and a plot.

Uses :mod:`goodput.tracking` (default store ``sqlite:///mlflow.db``,
``$MLFLOW_TRACKING_URI`` overrides).

Example::

    run_id = log_profile(profile, path="mlp.jsonl")        # experiment "profiles"
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

from goodput.observations import Profile

__all__ = ["log_profile", "plot_throughput", "metric_key"]


def metric_key(obs: Any) -> str:
    """``throughput.<type>.r<replicas>.b<local_bsz>`` (MLflow metric names)."""
    return f"throughput.{obs.gpu_type}.r{obs.num_replicas}.b{obs.local_bsz}"


def plot_throughput(profile: Profile, path: str | os.PathLike[str]) -> Path:
    """Save a plot of throughput (samples/s) against local batch size, a line per device type and replica count."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    groups: dict[tuple[str, int], list[Any]] = {}
    for obs in profile.observations:
        groups.setdefault((obs.gpu_type, obs.num_replicas), []).append(obs)
    for (gpu, replicas), obs in sorted(groups.items()):
        obs = sorted(obs, key=lambda o: o.local_bsz)
        label = gpu if replicas == 1 else f"{gpu} × {replicas} replicas"
        ax.plot([o.local_bsz for o in obs], [o.throughput for o in obs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("local batch size (samples per replica)")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(f"{profile.job or 'job'}: measured throughput")
    ax.grid(True, which="both", alpha=0.3)
    if groups:
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def log_profile(
    profile: Profile,
    path: str | os.PathLike[str] | None = None,
    *,
    experiment: str = "profiles",
    run_name: str | None = None,
    uri: str | None = None,
    nested: bool = False,
) -> str:
    """Log ``profile`` as an MLflow run; return the run id.

    Parameters: job, M0, largest batch, device types, the batch-size grid and
    budget. Metrics: throughput (samples/s) and step time (s) per observation,
    sync time where measured, seconds spent per type. Artifacts: the JSON Lines
    file (``path``, or the profile saved to one) and ``throughput.png``.
    Inside an active MLflow run (and ``nested=False``) it logs into that run, unless the run holds one of
    these parameters with another value (a profile logged there already, say ``profile_job`` called twice
    under it, or the caller's own ``replicas``): MLflow's parameters cannot change, so the profile goes
    into a run nested in it.
    """
    import mlflow

    from goodput import tracking

    settings = profile.metadata.get("profiler", {})
    params = {
        "job": profile.job,
        "init_batch_size": profile.init_batch_size,
        "max_batch_size": profile.max_batch_size,
        "device_types": profile.gpu_types,
        "max_local_bsz": profile.max_local_bsz,
        "grid": settings.get("grid"),
        "time_budget_s": settings.get("time_budget_s"),
        "replicas": settings.get("replicas"),
        "observations": len(profile.observations),
    }
    active = mlflow.active_run()
    if active is not None and not nested:
        held = mlflow.get_run(active.info.run_id).data.params
        flat = tracking.flat_params(params)
        # MLflow's parameters cannot change: a run that holds one of these with another value (a profile
        # logged there already, or the caller's own "replicas") gets the profile in a run nested in it
        nested = any(key in held and held[key] != value for key, value in flat.items())
    if active is not None and not nested:
        opened: Any = contextlib.nullcontext(active)  # log into the caller's run
    else:
        opened = tracking.start_run(experiment, run_name=run_name or profile.job, uri=uri, nested=nested)
    with opened as run:
        tracking.log_params(params)
        metrics: dict[str, float] = {}
        for obs in profile.observations:
            key = metric_key(obs)
            metrics[key] = obs.throughput
            metrics[key.replace("throughput.", "step_time.", 1)] = obs.step_time
            if obs.sync_time is not None:
                metrics[key.replace("throughput.", "sync_time.", 1)] = obs.sync_time
        for gpu in profile.gpu_types:
            seconds = profile.metadata.get(f"profiler.{gpu}", {}).get("seconds")
            if seconds is not None:
                metrics[f"seconds.{gpu}"] = float(seconds)
        if metrics:
            mlflow.log_metrics(metrics)
        with tempfile.TemporaryDirectory() as tmp:
            if path is not None and Path(path).exists():
                mlflow.log_artifact(str(path))
            else:
                saved = profile.save(Path(tmp) / f"{_slug(profile.job or 'profile')}.jsonl")
                mlflow.log_artifact(str(saved))
            mlflow.log_artifact(str(plot_throughput(profile, Path(tmp) / "throughput.png")))
        return run.info.run_id


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)
