"""``goodput serve``: one process that holds every job's :class:`~goodput.JobModel` behind a REST API.

Training jobs post observations as they train (:class:`profilers.reporter.GoodputReporter`),
schedulers ask for goodput, tables and allocations (:class:`goodput.client.Client`, the
Kubernetes scheduler extender, ``goodput table --server``). Modules, one job each:

- :mod:`.store` — the durable store (SQLAlchemy; observations are the source of truth);
- :mod:`.registry` — the published per-job models and the background worker that
  rebuilds and refits them;
- :mod:`.learner` — learning the cluster prior in a child process beside the worker;
- :mod:`.schemas` — the request and response bodies (pydantic);
- :mod:`.app` — the FastAPI application and its endpoints;
- :mod:`.k8s` — the Kubernetes scheduler-extender protocol;
- :mod:`.auth` — bearer tokens, body-size limit;
- :mod:`.metrics` — Prometheus metrics;
- :mod:`.server` — running it under uvicorn on a bound socket.

Example::

    from service import create_app
    app = create_app("sqlite:///goodput.db", cluster="t4:6x4,a100:2x8")
    # uvicorn.run(app, host="127.0.0.1", port=8470)
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def create_app(*args: Any, **kwargs: Any) -> Any:
    """The FastAPI application (:func:`service.app.create_app`)."""
    from .app import create_app as _create_app

    return _create_app(*args, **kwargs)
