"""A client of ``goodput serve`` (httpx): register jobs, post observations, ask for goodput, tables, allocations.

It speaks the service's JSON and imports nothing from the service. Errors
carry the service's answer: a 422 raises :class:`ServiceValidationError` (a
:class:`~goodput.errors.ValidationError` naming the field and the value), a
404 :class:`UnknownJobError`, a 503 :class:`NotReadyError` (a job's model is
being built: at the service's start-up, or from a new job's first
observations, for a second or two; queries wait for it up to the client's
``wait``), any other refusal :class:`ServiceError`; a service
that cannot be reached raises :class:`ServiceUnavailableError` (an ``OSError``).

Example::

    from goodput import Cluster
    from goodput.client import Client

    with Client("http://127.0.0.1:8470", token="...") as client:
        client.put_job("cifar10", init_batch_size=128, max_batch_size=4096)
        client.post_observations("cifar10", profile.observations)     # {'accepted': 40, 'total': 40}
        client.goodput("cifar10", "t4", num_nodes=1, num_gpus=4)["goodput"]
        client.table("cifar10", "t4:6x4,a100:2x8").frame
        client.allocate("t4:6x4,a100:2x8")["cifar10"]
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import json
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import httpx

from .allocator import Allocation, JobAllocation, JobSpec
from .cluster import Cluster
from .errors import ValidationError
from .observations import Observation
from .table import GoodputTable
from .validation import check_float, check_job_name, is_collection

__all__ = ["Client", "ServiceError", "ServiceValidationError", "UnknownJobError", "NotReadyError", "PayloadTooLargeError",
           "ServiceUnavailableError", "observation_records"]


class ServiceError(RuntimeError):
    """The service refused a request. ``status`` is the HTTP status, ``detail`` its explanation."""

    def __init__(self, status: int, detail: Any, method: str = "", url: str = "") -> None:
        self.status = status
        self.detail = detail
        text = detail if isinstance(detail, str) else json.dumps(detail)
        super().__init__(f"{method} {url}: HTTP {status}: {text}".strip())


class ServiceValidationError(ServiceError, ValidationError):
    """HTTP 422: the service named the field and the value that were wrong (``field``, ``value``, ``reason``)."""

    def __init__(self, status: int, detail: Any, method: str = "", url: str = "") -> None:
        ServiceError.__init__(self, status, detail, method, url)
        first = detail[0] if isinstance(detail, list) and detail and isinstance(detail[0], Mapping) else {}
        loc = [str(part) for part in first.get("loc", [])]
        self.field = ".".join(loc[1:] if loc[:1] in (["body"], ["query"], ["path"]) else loc) or "request"
        self.value = first.get("input")
        self.reason = str(first.get("msg", detail))
        self.args = (f"{self.field}={self.value!r}: {self.reason}",)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status, self.detail), self.__dict__)


class UnknownJobError(ServiceError):
    """HTTP 404: the service does not know the job (register it with :meth:`Client.put_job`)."""


class NotReadyError(ServiceError):
    """HTTP 503: the job's model is being built (service start-up, or a new job's first observations being
    fitted) or the store is briefly unavailable; try again after ``retry_after`` seconds."""

    def __init__(self, status: int, detail: Any, method: str = "", url: str = "", retry_after: float = 1.0) -> None:
        super().__init__(status, detail, method, url)
        self.retry_after = retry_after


class PayloadTooLargeError(ServiceError):
    """HTTP 413: the request's body is over the server's limit (``goodput serve --max-body-mb``): send less at once."""


class ServiceUnavailableError(OSError):
    """The service could not be reached (refused, timed out, connection dropped)."""


def _job_path(job: str, *rest: str) -> str:
    """``/v1/jobs/{job}[/rest]`` for a name the service takes (else ValidationError here: '#', '?' or '/' in
    a name would reach another URL, another job's)."""
    return "/".join(("/v1/jobs", check_job_name(job), *rest))


def _pair(field: str, value: Any) -> list[Any]:
    """A (low, high) pair as a list (the service checks the numbers); anything else a ValidationError here."""
    if not is_collection(value):
        raise ValidationError(field, value, "expected a (low, high) pair")
    pair = list(value)
    if len(pair) != 2:
        raise ValidationError(field, value, "expected a (low, high) pair")
    return pair


def observation_records(observations: Iterable[Observation | Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The JSON records of observations: ``Observation.to_dict()``, or mappings as given (with an optional ``id``)."""
    records = []
    for index, item in enumerate(observations):
        if isinstance(item, Observation):
            records.append(item.to_dict())
        elif isinstance(item, Mapping):
            for key, value in item.items():  # JSON cannot carry them: say which, not "Out of range float values"
                if isinstance(value, float) and not math.isfinite(value):
                    raise ValidationError(f"observations[{index}].{key}", value, "expected a finite number")
            records.append(dict(item))
        else:
            raise ValidationError(f"observations[{index}]", item, "expected an Observation or a record dict")
    return records


class Client:
    """``goodput serve``'s API over HTTP.

    Args:
        url: the service, e.g. ``http://127.0.0.1:8470``.
        token: a bearer token for writes (the server's ``--token-file``).
        timeout: seconds (positive) to connect, and for each read and write of a request (httpx's
            timeouts: a server that answers, however slowly, keeps a request going); ``None``: none; an
            ``httpx.Timeout``: as it says.
        wait: seconds a query (goodput, table, allocate) waits, trying again as the service's
            ``Retry-After`` says, while a job's model is not ready (503); 0 raises :class:`NotReadyError` at once.
        transport: an httpx transport (tests, proxies); default: a pooled connection.
    """

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 30.0, wait: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValidationError("url", url, "expected http://HOST:PORT or https://...")
        headers = {"User-Agent": "goodput-client"}
        if token is not None:
            if not isinstance(token, str) or not token.strip():
                raise ValidationError("token", token, "expected a non-empty string")
            headers["Authorization"] = f"Bearer {token.strip()}"
        self.url = url.rstrip("/")
        # None (no timeout) and an httpx.Timeout go to httpx as they are; a number must be positive
        self.timeout = timeout if timeout is None or isinstance(timeout, httpx.Timeout) else \
            check_float("timeout", timeout, positive=True)
        self.wait = check_float("wait", wait, nonnegative=True)
        self._deadline: float | None = None  # deadline(): no request outlasts it
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    # ------------------------------------------------------------------ plumbing
    def query(self, method: str, path: str, **kwargs: Any) -> Any:
        """:meth:`request`, tried again while the answer is 503 (:class:`NotReadyError`), up to :attr:`wait` seconds."""
        deadline = time.monotonic() + self.wait
        while True:
            try:
                return self.request(method, path, **kwargs)
            except NotReadyError as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                # a wait shorter than the server's Retry-After had not waited at all: sleep what is left, one
                # last try at the deadline
                time.sleep(min(max(exc.retry_after, 0.05), left))

    @contextlib.contextmanager
    def deadline(self, at: float | None) -> Iterator[None]:
        """Within it, no request outlasts ``at`` (``time.monotonic()``): each one's timeout is cut to what is left,
        and one started after it is a :class:`ServiceUnavailableError` (a reporter's bounded close). Not for
        several threads at once."""
        saved, self._deadline = self._deadline, at
        try:
            yield
        finally:
            self._deadline = saved

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One request; the decoded JSON answer, or the text of a non-JSON one (``/metrics``)."""
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise ServiceUnavailableError(f"{method} {self.url}{path}: not sent, the caller's deadline has passed")
            own = kwargs.get("timeout", self.timeout)
            kwargs["timeout"] = min(left, own) if isinstance(own, (int, float)) else left
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ServiceUnavailableError(f"{method} {self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except (ValueError, AttributeError):
                detail = response.text
            where = f"{self.url}{path}"
            if response.status_code == 422:
                raise ServiceValidationError(422, detail, method, where)
            if response.status_code == 404:
                raise UnknownJobError(404, detail, method, where)
            if response.status_code == 413:
                raise PayloadTooLargeError(413, detail, method, where)
            if response.status_code == 503:
                raise NotReadyError(503, detail, method, where, retry_after=_retry_after(response.headers.get("Retry-After")))
            raise ServiceError(response.status_code, detail, method, where)
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.text

    # ------------------------------------------------------------------ jobs and observations
    def put_job(self, job: str, init_batch_size: int, max_batch_size: int | None = None,
                local_bsz_bounds: tuple[int, int] | Mapping[str, tuple[int, int]] | None = None,
                gpu_types: Iterable[str] | None = None,
                num_stages: int | Mapping[str, int] | None = None, model_size: float | None = None) -> dict[str, Any]:
        """Register ``job`` or change its settings; the job's record. ``num_stages``: GPUs per replica of a
        hybrid-parallel job (:mod:`goodput.hybrid`); ``model_size``: its trainable parameters (a cluster
        prior's size slopes place its sync costs)."""
        body: dict[str, Any] = {"init_batch_size": init_batch_size}
        if model_size is not None:
            body["model_size"] = check_float("model_size", model_size, positive=True)
        if num_stages is not None:
            body["num_stages"] = dict(num_stages) if isinstance(num_stages, Mapping) else num_stages
        if max_batch_size is not None:
            body["max_batch_size"] = max_batch_size
        if local_bsz_bounds is not None:
            body["local_bsz_bounds"] = ({k: _pair(f"local_bsz_bounds[{k!r}]", v) for k, v in local_bsz_bounds.items()}
                                        if isinstance(local_bsz_bounds, Mapping) else _pair("local_bsz_bounds", local_bsz_bounds))
        if gpu_types is not None:
            if not is_collection(gpu_types):
                raise ValidationError("gpu_types", gpu_types, "expected a list of GPU type names, e.g. ['t4']")
            body["gpu_types"] = list(gpu_types)
        return self.request("PUT", _job_path(job), json=body)

    def post_observations(self, job: str, observations: Iterable[Observation | Mapping[str, Any]]) -> dict[str, int]:
        """Store observations (``Observation`` objects, or record dicts with an optional ``id``): ``{accepted, total}``."""
        return self.request("POST", _job_path(job, "observations"),
                            json={"observations": observation_records(observations)})

    def jobs(self) -> list[str]:
        return self.request("GET", "/v1/jobs")["jobs"]

    def job(self, job: str) -> dict[str, Any]:
        """Settings, observations stored, GPU types, the model's state and diagnostics."""
        return self.request("GET", _job_path(job))

    def stored(self, job: str, after: int = 0, limit: int = 10_000) -> dict[str, Any]:
        """One page of the stored records: ``{"records": [{row, id, received, observation}], "next_after"}``."""
        return self.request("GET", _job_path(job, "observations"), params={"after": after, "limit": limit})

    # ------------------------------------------------------------------ queries
    def goodput(self, job: str, gpu_type: str, num_nodes: int = 1, num_gpus: int = 1) -> dict[str, Any]:
        """The best configuration: ``goodput``, ``batch_size``, ``local_bsz``, ``accum_steps``, ``std``, …"""
        return self.query("GET", _job_path(job, "goodput"),
                            params={"gpu_type": gpu_type, "num_nodes": num_nodes, "num_gpus": num_gpus})

    def table_dict(self, job: str, cluster: str | Cluster | None = None) -> dict[str, Any]:
        """The job's goodput table as the service sends it (rows, model version)."""
        params = {} if cluster is None else {"cluster": str(cluster)}
        return self.query("GET", _job_path(job, "table"), params=params)

    def table(self, job: str, cluster: str | Cluster | None = None) -> GoodputTable:
        """The job's goodput table over ``cluster`` (default: the server's)."""
        data = self.table_dict(job, cluster)
        return GoodputTable.from_dict({"job": data["job"], "rows": data["rows"],
                                       "missing_gpu_types": data.get("missing_gpu_types", [])})

    def allocate(self, cluster: str | Cluster | None = None, jobs: Iterable[str] | None = None,
                 current: Mapping[str, JobAllocation | Mapping[str, Any] | None] | None = None,
                 policy: str = "sia", p: float = -0.5, specs: Mapping[str, JobSpec | Mapping[str, Any]] | None = None,
                 **options: Any) -> Allocation:
        """One scheduling round over the service's jobs; ``specs``: per job, its :class:`~goodput.JobSpec`
        (age, restarts, restart_cost, ...: Sia's restart factor for running jobs)."""
        body: dict[str, Any] = {"cluster": None if cluster is None else str(cluster),
                                "jobs": None if jobs is None else list(jobs), "policy": policy, "p": p}
        if specs:
            body["specs"] = {job: (spec.to_dict() if isinstance(spec, JobSpec) else dict(spec)) for job, spec in specs.items()}
        if current is not None:
            body["current"] = {job: (value.to_dict() if isinstance(value, JobAllocation) else value)
                               for job, value in (current.items() if isinstance(current, Mapping) else current)}
        if options:
            body["options"] = options
        return Allocation.from_dict(self.query("POST", "/v1/allocate", json=body))

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/healthz")

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        return self.request("GET", "/metrics")


def _retry_after(value: str | None) -> float:
    """Seconds a ``Retry-After`` header asks for: a number, or an HTTP date (RFC 9110 §10.2.3: what a proxy in
    front of the service may send; it had raised a bare ValueError); 1 s when absent or unreadable."""
    if not value:
        return 1.0
    try:
        seconds = float(value)
        return max(seconds, 0.0) if math.isfinite(seconds) else 1.0
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 1.0
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max((when - datetime.datetime.now(datetime.timezone.utc)).total_seconds(), 0.0)
