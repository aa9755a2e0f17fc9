"""Shared fixtures: the real measurements beside the checkout, skipped cleanly when absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from experiments.datasets import default_data_dir
from tests.service_helpers import postgres_server, store_url  # noqa: F401  (fixtures: a real PostgreSQL server, both stores)

# CI (CI=true) draws the property tests' examples from a fixed seed: a commit that passed stays green and a
# failure replays. Local runs draw anew each time and so keep exploring (both of 2026-11-26's finds came so).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    path = default_data_dir()
    if path is None:
        pytest.skip("../shared/data is absent (set GOODPUT_DATA_DIR to point at it)")
    return path


@pytest.fixture(scope="session")
def pollux_traces(data_dir: Path) -> Path:
    path = data_dir / "pollux" / "traces"
    if not path.is_dir():
        pytest.skip("pollux traces are absent")
    return path


@pytest.fixture(autouse=True)
def _isolated_mlflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs in its own directory with its own MLflow store (``mlflow.db`` and ``mlruns/`` there)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("GIT_PYTHON_REFRESH", "quiet")
    os.environ.setdefault("MPLBACKEND", "Agg")
