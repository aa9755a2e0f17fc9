"""Prometheus metrics of the service (``GET /metrics``, text format).

One :class:`Metrics` per application, each with its own registry (several
applications in one process, as in the tests, do not collide):

- ``goodput_requests_total{method, route, status}`` and
  ``goodput_request_seconds{method, route}`` (a histogram) — every request, by
  route template (``/v1/jobs/{job}/goodput``), so job names do not multiply series;
- ``goodput_observations_stored_total`` / ``goodput_observations_duplicate_total``
  — records stored, and records skipped because their id was stored already;
- ``goodput_model_publishes_total`` — models published by the background worker;
  ``goodput_refits_total`` — refits those models made (their ``JobModel.refits``);
  ``goodput_model_failures_total`` — rebuilds or updates that failed (the last good
  model kept answering); ``goodput_model_update_seconds`` — worker time per update;
- ``goodput_jobs`` and ``goodput_jobs_rebuilding`` — registered jobs, and those
  still without a model after start-up or a settings change.

:class:`MetricsMiddleware` is a plain ASGI middleware (no per-request task or
body copy), so it costs a few microseconds per request.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

disable_created_metrics()  # no `_created` series beside every counter: half the text, nothing a dashboard reads

__all__ = ["Metrics", "MetricsMiddleware", "CONTENT_TYPE_LATEST"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """The service's metrics in their own :class:`prometheus_client.CollectorRegistry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("goodput_requests", "HTTP requests by route and status", ["method", "route", "status"],
                                registry=r)
        self.latency = Histogram("goodput_request_seconds", "HTTP request latency (seconds) by route",
                                 ["method", "route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.stored = Counter("goodput_observations_stored", "observations stored (durable)", registry=r)
        self.duplicates = Counter("goodput_observations_duplicate",
                                  "observations received again (same id) and not stored twice", registry=r)
        self.publishes = Counter("goodput_model_publishes", "models published by the background worker", registry=r)
        self.refits = Counter("goodput_refits", "refits made by the published models (JobModel.refits)", registry=r)
        self.failures = Counter("goodput_model_failures", "model rebuilds, updates or cluster-prior learnings that failed", registry=r)
        self.update_seconds = Histogram("goodput_model_update_seconds", "background worker seconds per model update",
                                        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=r)
        self.prior_updates = Counter("goodput_cluster_prior_updates", "cluster priors learned from the jobs' observations",
                                     registry=r)
        self.prior_seconds = Histogram("goodput_cluster_prior_seconds", "seconds per cluster prior learned (its child process, start to result)",
                                       buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600), registry=r)
        self.jobs = Gauge("goodput_jobs", "registered jobs", registry=r)
        self.rebuilding = Gauge("goodput_jobs_rebuilding", "jobs without a published model yet", registry=r)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class MetricsMiddleware:
    """ASGI middleware: count and time every HTTP request by its route template.

    A request answered before routing (a 401 from the token check, a 413 from the body limit) is
    labelled with the template its path matches among ``routes`` (the app's), ``unmatched`` only
    when none does (a 404)."""

    def __init__(self, app: Any, metrics: Metrics, routes: Any = ()) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def send_with_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = scope.get("route") or self._match(scope)
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            self.metrics.requests.labels(method, template, str(status["code"])).inc()
            self.metrics.latency.labels(method, template).observe(time.perf_counter() - started)

    def _match(self, scope: dict[str, Any]) -> Any:
        """The route whose path (and method, preferably) the request matches, or ``None``."""
        from starlette.routing import Match

        partial = None
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route
            if match == Match.PARTIAL and partial is None:
                partial = route
        return partial
