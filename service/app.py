"""The FastAPI application of ``goodput serve`` (OpenAPI at ``/docs``).

Endpoints (JSON bodies):

- ``PUT  /v1/jobs/{job}`` — register a job or change its settings -> the job's record;
- ``POST /v1/jobs/{job}/observations`` — ``{"observations": [...]}`` -> ``{"accepted", "total"}``,
  answered after the records are committed; idempotent by record id;
- ``GET  /v1/jobs`` — the registered jobs; ``GET /v1/jobs/{job}`` — settings, stored count,
  GPU types, the model's state, last refit, diagnostics;
- ``GET  /v1/jobs/{job}/observations?after=&limit=`` — the stored records, in order of arrival;
- ``GET  /v1/jobs/{job}/goodput?gpu_type=&num_nodes=&num_gpus=`` — the best configuration;
- ``GET  /v1/jobs/{job}/table?cluster=`` — the job's goodput table (Sia's configuration set);
- ``POST /v1/allocate`` — one scheduling round -> ``Allocation.to_dict()``;
- ``POST /v1/k8s/filter``, ``POST /v1/k8s/prioritize`` — the Kubernetes scheduler extender;
- ``GET  /v1/cluster-prior`` — where the jobs' cluster prior comes from and what it learned;
- ``GET  /healthz``, ``GET /metrics`` (Prometheus).

Errors: 401 (a write without a valid token, when tokens are set), 404 (unknown
job), 413 (body over the limit), 422 (a bad body or query: ``detail`` names
where, the field and the value, as FastAPI's own validation does), 503 (a
model still being rebuilt after start-up, with ``Retry-After``; or the store
unreachable).

Example::

    app = create_app("sqlite:///goodput.db", cluster="t4:6x4,a100:2x8", token_file="tokens.txt")
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import Body, FastAPI, Query, Request, Security
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPBearer
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from goodput import Cluster, ClusterPrior, Observation
from goodput.errors import UnknownGPUTypeError, ValidationError
from goodput.hybrid import Stages
from goodput.validation import MAX_GPU_TYPE_LENGTH

from .auth import DEFAULT_MAX_BODY, BodyLimitMiddleware, TokenAuthMiddleware, read_tokens
from .k8s import Extender
from .metrics import CONTENT_TYPE_LATEST, Metrics, MetricsMiddleware
from .registry import NotReadyError, Registry, build_model, check_export_dir
from .schemas import (
    JOB_PATTERN,
    AllocateIn,
    GoodputOut,
    JobOut,
    JobSettings,
    ObservationBatch,
    ObservationsAccepted,
    StoredRecords,
    TableOut,
    json_bytes,
    json_safe,
    validation_detail,
)
from .store import Store, UnknownJobError, record_id

__all__ = ["create_app"]

log = logging.getLogger("goodput.service")

JobName = Annotated[str, PathParam(pattern=JOB_PATTERN, description="the job's name: letters, digits, '.', '_', '-'")]
_bearer = HTTPBearer(auto_error=False, description="with --token-file: writes need one of its tokens")
RETRY_AFTER_S = 2


def _bytes_response(body: bytes, status: int = 200) -> Response:
    return Response(content=body, status_code=status, media_type="application/json")


_CACHED_PATH = re.compile(r"^/v1/jobs/([A-Za-z0-9][A-Za-z0-9._-]{0,127})/(goodput|table)$")


def _count(values: list[str], limit: int) -> int | None:
    """One ASCII-digit value in 1..limit, else None."""
    if len(values) != 1 or not values[0].isascii() or not values[0].isdigit():
        return None
    number = int(values[0])
    return number if 1 <= number <= limit else None


class CachedReads:
    """ASGI middleware: ``GET goodput`` and ``GET table`` answered from the published model's cache.

    A query whose answer the current snapshot holds (the server cluster's table and its rows
    are computed when a model is published; any other answer once asked) is sent without
    routing or request models, which is most of a query's cost. Anything else — an unknown
    job, a model not built yet, an odd or invalid query, an answer not cached — goes on to
    the application, which validates it and answers (or refuses) in full.
    """

    def __init__(self, app: Any, registry: Registry, fastapi_app: FastAPI) -> None:
        self.app = app
        self.registry = registry
        self.fastapi_app = fastapi_app
        self._routes: dict[str, Any] | None = None

    def _route(self, kind: str) -> Any:
        if self._routes is None:
            self._routes = {getattr(r, "path", "").rsplit("/", 1)[-1]: r for r in self.fastapi_app.routes
                            if getattr(r, "path", "") in ("/v1/jobs/{job}/goodput", "/v1/jobs/{job}/table")}
        return self._routes.get(kind)

    def lookup(self, job: str, kind: str, query: bytes) -> bytes | None:
        published = self.registry.current(job)
        if published is None:
            return None
        try:
            params = parse_qs(query.decode("ascii"), keep_blank_values=True)
        except (UnicodeDecodeError, ValueError):
            return None
        if kind == "table":
            if set(params) - {"cluster"} or len(params.get("cluster", [""])) != 1:
                return None
            return published.cached(("table-json", params["cluster"][0] if params else None))
        if set(params) - {"gpu_type", "num_nodes", "num_gpus"} or len(params.get("gpu_type", ())) != 1:
            return None
        gpu_type = params["gpu_type"][0]
        gpus = _count(params.get("num_gpus", []), 1_000_000)
        nodes = _count(params.get("num_nodes", ["1"]), 100_000)
        if not 1 <= len(gpu_type) <= 64 or gpus is None or nodes is None or gpus < nodes:
            return None
        return published.cached(("goodput-json", gpu_type, nodes, gpus))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            match = _CACHED_PATH.match(scope["path"])
            if match is not None:
                body = self.lookup(match.group(1), match.group(2), scope["query_string"])
                if body is not None:
                    scope["route"] = self._route(match.group(2))  # the metrics' route label
                    await send({"type": "http.response.start", "status": 200,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
                    return
        await self.app(scope, receive, send)


def create_app(
    store: str | Store = "sqlite:///goodput.db",
    *,
    store_options: Mapping[str, Any] | None = None,
    cluster: str | Cluster | None = None,
    token_file: str | Path | None = None,
    tokens: tuple[str, ...] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY,
    export_dir: str | Path | None = None,
    model_options: Mapping[str, Any] | None = None,
    cluster_prior: ClusterPrior | str | Path | None = None,
    learn_prior: bool = False,
    prior_interval_s: float = 600.0,
    prior_jobs: int = 64,
    k8s_max_score: int = 10,
    coalesce_s: float = 0.05,
    min_interval_s: float = 1.0,
) -> FastAPI:
    """The service as an ASGI application; the model worker starts and stops with the app's lifespan.

    Args:
        store: a SQLAlchemy URL or a :class:`~service.store.Store`; ``store_options``: the Store's keyword
            arguments for a URL (``{"sqlite_synchronous": "NORMAL"}``). Every argument that can be refused
            is checked before a URL's store is opened: a refusal leaves no database behind.
        cluster: the cluster (``"t4:6x4,a100:2x8"``): default of table and allocation queries, and
            its table is precomputed whenever a model is published.
        token_file: a file of bearer tokens (one a line): writes then need one. ``tokens``: the same, given directly.
        max_body_bytes: larger request bodies get 413.
        export_dir: keep ``<job>.csv`` there current with each job's table over ``cluster`` (Slurm).
        model_options: passed to every :class:`~goodput.JobModel` (``{"bayesian": False}`` for the plain fit).
        cluster_prior: a :class:`~goodput.ClusterPrior` or the path of one saved as JSON (``goodput
            prior``): every job's model takes it as its prior, without the job's own cells.
        learn_prior, prior_interval_s, prior_jobs: learn the cluster prior from the ``prior_jobs`` jobs that
            reported last, at most once per ``prior_interval_s`` (:class:`~service.registry.Registry`).
        k8s_max_score: the extender's top score: 10 (kube-scheduler) or 100.
        coalesce_s: how long the model worker waits for more observations after an idle spell.
        min_interval_s: a job's model is updated at most once per this many seconds during a stream.
    """
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    if token_file is not None:
        tokens = (tokens or ()) + read_tokens(token_file)
    if max_body_bytes < 1024:
        raise ValidationError("max_body_bytes", max_body_bytes, "must be at least 1024")
    if isinstance(cluster_prior, (str, Path)):
        try:
            cluster_prior = ClusterPrior.load(cluster_prior)
        except OSError as exc:
            raise ValidationError("cluster_prior", str(cluster_prior), f"cannot be read ({exc.strerror or exc})") from None
    check_export_dir(export_dir, cluster)
    store = store if isinstance(store, Store) else Store(store, **(store_options or {}))
    metrics = Metrics()
    registry = Registry(store, cluster=cluster, export_dir=export_dir, metrics=metrics,
                        model_options=model_options, cluster_prior=cluster_prior, learn_prior=learn_prior,
                        prior_interval_s=prior_interval_s, prior_jobs=prior_jobs, coalesce_s=coalesce_s, min_interval_s=min_interval_s)

    def goodput_of(job: str, gpu: str, nodes: int, gpus: int, replicas: int | None) -> float | None:
        try:
            published = registry.published(job)
            if gpu not in published.gpu_types:
                return None
            if replicas is not None:  # a hybrid job's replica is a pipeline of num_stages GPUs
                gpus = replicas * published.stages(gpu)
        except (UnknownJobError, NotReadyError, ValidationError):
            return None
        try:
            return float(published.goodput(gpu, nodes, gpus)["goodput"])
        except ValidationError:  # a shape the job cannot take there (fewer GPUs than nodes): no batch fits it
            return 0.0

    def allowed_types(job: str) -> list[str] | None:
        try:
            return registry.record(job).settings.get("gpu_types")
        except UnknownJobError:
            return None

    extender = Extender(goodput_of, allowed_types, max_score=k8s_max_score)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry.start()
        try:
            yield
        finally:
            await run_in_threadpool(registry.close)

    app = FastAPI(title="goodput", version=_version(), lifespan=lifespan, responses=_ANY_ROUTE,
                  description="Jobs report observations as they train; schedulers query goodput, tables, allocations. "
                  "Writes need a bearer token when the server was started with --token-file.")
    app.state.registry = registry
    app.state.metrics = metrics
    app.state.extender = extender
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if tokens:
        app.add_middleware(TokenAuthMiddleware, tokens=tuple(tokens))
    app.add_middleware(CachedReads, registry=registry, fastapi_app=app)
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=app.router.routes)
    writes = [Security(_bearer)]

    # ------------------------------------------------------------------ errors
    @app.exception_handler(UnknownJobError)
    async def _unknown_job(request: Request, exc: UnknownJobError) -> JSONResponse:
        return JSONResponse({"detail": f"unknown job {exc.value!r}: register it first (PUT /v1/jobs/{exc.value})"},
                            status_code=404)

    @app.exception_handler(NotReadyError)
    async def _not_ready(request: Request, exc: NotReadyError) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "job": exc.job, "ready": exc.done, "jobs": exc.total},
                            status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(ValidationError)
    async def _invalid(request: Request, exc: ValidationError) -> JSONResponse:
        where = "query" if request.method == "GET" else "body"
        return JSONResponse({"detail": validation_detail(exc, (where,))}, status_code=422)

    @app.exception_handler(SQLAlchemyError)
    async def _store_down(request: Request, exc: SQLAlchemyError) -> JSONResponse:
        log.error("goodput serve: store error: %s", exc)
        return JSONResponse({"detail": f"the store is unavailable: {type(exc).__name__}"}, status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    # ------------------------------------------------------------------ jobs and observations
    @app.put("/v1/jobs/{job}", response_model=JobOut, dependencies=writes, tags=["jobs"], responses=_WRITE)
    def put_job(job: JobName, settings: JobSettings) -> Any:
        """Register a job or change its settings (its model is then rebuilt; the old one answers meanwhile)."""
        checked = settings.checked()
        build_model(job, checked)  # the core's own checks of the settings, before anything is stored
        registry.register(job, checked)
        return JSONResponse(json_safe(registry.status(job)))

    @app.post("/v1/jobs/{job}/observations", response_model=ObservationsAccepted, dependencies=writes, tags=["jobs"],
              responses={**_WRITE, **_JOB})
    def post_observations(job: JobName, batch: ObservationBatch) -> Any:
        """Store observations durably (answered after the commit); a record whose id is stored already is skipped."""
        registry.record(job)  # an unknown job: 404 (before it gets a settings lock)
        with registry.settings_lock(job).shared():  # its settings unchanged from this check to the commit
            observations, ids = [], []
            stages = Stages.parse(registry.record(job).settings.get("num_stages", 1))
            for index, record in enumerate(batch.observations):
                data = record.model_dump(exclude_unset=True)
                given_id = data.pop("id", None)
                if data.get("job") is None:
                    data["job"] = job
                elif data["job"] != job:
                    raise RequestValidationError([{"type": "value_error", "loc": ["body", "observations", index, "job"],
                                                   "msg": f"the URL names job {job!r}", "input": data["job"]}])
                try:
                    observation = Observation.from_dict(data)
                    if observation.num_stages != stages.of(observation.gpu_type):  # the job's model would refuse it
                        raise ValidationError("num_stages", observation.num_stages,
                                              f"job {job!r} runs {stages.of(observation.gpu_type)} stage(s) per replica on "
                                              f"{observation.gpu_type} (its settings' num_stages)")
                except ValidationError as exc:
                    raise RequestValidationError(validation_detail(exc, ("body", "observations", index))) from None
                observations.append(observation)
                ids.append(given_id if given_id is not None else record_id(observation.to_dict()))
            result = registry.add(job, observations, ids)
        return {"accepted": result.accepted, "total": result.total}

    @app.get("/v1/jobs", tags=["jobs"])
    def list_jobs() -> dict[str, list[str]]:
        """The registered jobs' names."""
        return {"jobs": registry.jobs()}

    @app.get("/v1/jobs/{job}", response_model=JobOut, tags=["jobs"], responses=_JOB)
    def get_job(job: JobName) -> Any:
        """Settings, observations stored, GPU types seen, the model's state and last refit, diagnostics."""
        return JSONResponse(json_safe(registry.status(job)))

    @app.get("/v1/jobs/{job}/observations", response_model=StoredRecords, tags=["jobs"], responses=_JOB)
    def get_observations(job: JobName, after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
                         limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000) -> Any:
        """The stored records in order of arrival, ``limit`` at a time after row ``after``."""
        registry.record(job)
        rows = registry.store.observations(job, after=after, limit=limit)
        records = [{"row": r.row_id, "id": r.record_id, "received": r.received, "observation": r.data} for r in rows]
        return _bytes_response(json_bytes({"job": job, "records": records,
                                      "next_after": rows[-1].row_id if len(rows) == limit else None}))

    # ------------------------------------------------------------------ queries
    @app.get("/v1/jobs/{job}/goodput", response_model=GoodputOut, tags=["queries"], responses=_JOB)
    async def get_goodput(job: JobName, gpu_type: Annotated[str, Query(min_length=1, max_length=MAX_GPU_TYPE_LENGTH)],
                          num_gpus: Annotated[int, Query(ge=1, le=1_000_000)],
                          num_nodes: Annotated[int, Query(ge=1, le=100_000)] = 1) -> Any:
        """The best batch configuration of an allocation and its goodput, from the last published model."""
        if num_gpus < num_nodes:
            raise RequestValidationError([{"type": "value_error", "loc": ["query", "num_gpus"],
                                           "msg": f"must be >= num_nodes ({num_nodes})", "input": num_gpus}])
        key = ("goodput-json", gpu_type, num_nodes, num_gpus)
        for attempt in range(2):
            published = registry.published(job)
            body = published.cached(key)
            if body is not None:
                return _bytes_response(body)
            try:
                body = await run_in_threadpool(published.goodput_json, gpu_type, num_nodes, num_gpus)
                return _bytes_response(body)
            except UnknownGPUTypeError as exc:
                if attempt == 0 and registry.published(job) is not published:
                    continue  # a newer model was published meanwhile: ask it
                raise registry.not_ready_for(job, str(exc.value).strip().lower()) or exc from None
        raise AssertionError("unreachable")  # pragma: no cover

    @app.get("/v1/jobs/{job}/table", response_model=TableOut, tags=["queries"], responses=_JOB)
    async def get_table(job: JobName, cluster: Annotated[str | None, Query(
            description="type:NODESxGPUS,... (default: the server's --cluster)")] = None) -> Any:
        """The job's goodput table over the cluster's configurations (Sia's set)."""
        published = registry.published(job)
        key = ("table-json", cluster)
        body = published.cached(key)
        if body is None:
            body = await run_in_threadpool(published.table_json, _cluster(cluster), cluster)
        return _bytes_response(body)

    @app.post("/v1/allocate", dependencies=writes, tags=["queries"], responses={**_WRITE, **_JOB})
    def post_allocate(request: AllocateIn) -> Any:
        """One scheduling round (goodput.allocate) over the jobs' tables -> Allocation.to_dict()."""
        allocation = registry.allocate(_cluster(request.cluster), request.jobs, request.current, request.policy,
                                       request.p, request.options, request.specs)
        return _bytes_response(json_bytes(allocation.to_dict()))

    def _cluster(spec: str | None) -> Cluster:
        if spec is None:
            if registry.cluster is None:
                raise ValidationError("cluster", None, "name one (type:NODESxGPUS,...): the server has no --cluster")
            return registry.cluster
        return Cluster.parse(spec)

    # ------------------------------------------------------------------ Kubernetes
    @app.post("/v1/k8s/filter", tags=["kubernetes"])
    def k8s_filter(args: Annotated[dict[str, Any], Body(description="ExtenderArgs: Pod, Nodes or NodeNames")]) -> Any:
        """kube-scheduler's filter call: ExtenderArgs -> ExtenderFilterResult."""
        return _bytes_response(json_bytes(extender.filter(args)))

    @app.post("/v1/k8s/prioritize", tags=["kubernetes"])
    def k8s_prioritize(args: Annotated[dict[str, Any], Body(description="ExtenderArgs: Pod, Nodes or NodeNames")]) -> Any:
        """kube-scheduler's prioritize call: ExtenderArgs -> HostPriorityList (scores 0..10)."""
        return _bytes_response(json_bytes(extender.prioritize(args)))

    # ------------------------------------------------------------------ operations
    @app.get("/v1/cluster-prior", tags=["operations"])
    def get_cluster_prior() -> Any:
        """Where the jobs' cluster prior comes from (none, given, learned) and what it learned: the spread of job
        and job × type effects per coordinate, their correlations, each job's Student-t weight, the size slopes."""
        return json_safe({"status": registry.prior_status(), "hierarchy": registry.prior_description()})

    @app.get("/healthz", tags=["operations"])
    def healthz() -> Any:
        """Liveness and readiness: the store answers; how many jobs have a model."""
        registry.store.ping()
        ready, total = registry.readiness()
        return {"status": "ok", "store": registry.store.dialect, "jobs": total, "ready": ready,
                "rebuilding": total - ready, "worker": registry.backlog(), "cluster_prior": registry.prior_status()}

    @app.get("/metrics", tags=["operations"], response_class=PlainTextResponse)
    def get_metrics() -> Response:
        """Prometheus text: requests, latencies, observations stored, model publishes and refits."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


# The error answers the module docstring lists, declared in the OpenAPI document (it had listed 200 and 422 alone)
_ANY_ROUTE: dict[int | str, dict[str, Any]] = {
    413: {"description": "the request body is over the server's limit"},
    503: {"description": "a model still being built, or the store unreachable; retry after Retry-After seconds"},
}
_WRITE: dict[int | str, dict[str, Any]] = {401: {"description": "a write without a valid bearer token (servers started with --token-file)"}}
_JOB: dict[int | str, dict[str, Any]] = {404: {"description": "an unknown job: register it first (PUT /v1/jobs/{job})"}}


def _version() -> str:
    from goodput import __version__

    return __version__
