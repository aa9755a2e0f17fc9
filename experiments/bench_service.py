"""The goodput service under load, on loopback: query latency, ingest rate, a kill -9 during ingest (issue 32).

Three parts, each against a real ``goodput serve`` process on 127.0.0.1 and a
free port, with a fresh SQLite store (WAL, ``synchronous=FULL``) in a
temporary directory:

1. **Queries**: 50 jobs × 200 observations (three GPU types; the parameters of
   ``experiments.bench_core.TYPES``, 3% noise), the Bayesian model, the server's
   cluster ``t4:6x4,a100:2x8,rtx2080ti:3x8``. Once every model is built,
   ``GET goodput`` (a random job and configuration of the cluster's set) and
   ``GET table`` at 1, 8 and 64 concurrent clients (asyncio keep-alive
   connections of this process's own lean HTTP/1.1 client; httpx for ingest): p50/p99 latency as the clients see it, over a bounded count and
   time. Targets: ``GET goodput`` p99 ≤ 10 ms at 8 clients.
2. **Ingest**: the 10,000 observations above, posted by 8 concurrent
   reporters in batches of 50 with their own ids: observations/s acknowledged
   (each acknowledged after its commit). Target ≥ 5,000/s.
3. **Kill -9**: 8 concurrent reporters post (batches of 25, ids) to a fresh
   server; the server is SIGKILLed mid-ingest and restarted on the same store;
   every stored record is read back. Acknowledged but missing (target 0), stored
   twice (target 0), and stored without an acknowledgement (in flight at the
   kill: allowed, the sender resends it and it is stored once).

4. **Cluster prior** (``--parts prior``): the same jobs (each with a parameter
   count, 1–100 M) stored by a server, then a server with ``--learn-prior`` on
   that store: seconds its worker takes to learn the prior from every job, and
   from its start until every job is rebuilt, given the prior without its own
   cells, refitted and republished. Then one job's new observation makes it
   learn again (``--prior-interval 1``), and as the learning starts (in its child
   process) 5 jobs report a step each: seconds until each one's published model
   holds its step (median, slowest), and how many of them while the prior was
   still being learned. As that prior comes back, 5 jobs report again: the same
   seconds while the other jobs are refitted under the new prior, and until
   every job is republished. Last, the server restarted on the store: seconds
   until every job is rebuilt, with the prior the store kept.

After the queries, scheduler rounds while the jobs go on reporting: ``POST /v1/allocate`` every
50 ms for the same bounded time, while 8 reporters post 40 new steps of every job on its
modelled types; rounds answered and refused (503), and the answered ones' p50/p99.

A last row: what :class:`profilers.reporter.GoodputReporter` costs a training
step (µs per ``with reporter.step(...)``), against a real step of the zoo's MLP
on this CPU (target < 1%).

Run: ``python -m experiments.bench_service`` (about 3 minutes on 2 cores; most of
it building the 50 Bayesian models) or ``--quick`` (5 jobs × 40 observations,
the plain model, a few seconds of load).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from experiments.bench_core import TYPES, observations
from experiments.benchutil import parser, report
from goodput import Cluster, Observation

CLUSTER = "t4:6x4,a100:2x8,rtx2080ti:3x8"


# ---------------------------------------------------------------------- a server process
class ServerProcess:
    """``goodput serve --port 0`` in a child process; ``url`` once it listens."""

    def __init__(self, store: str, *args: str, timeout: float = 120.0) -> None:
        command = [sys.executable, "-m", "cli", "serve", "--port", "0", "--store", store, *args]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=Path(__file__).resolve().parents[1], start_new_session=True)
        self.url = ""
        self.output: list[str] = []
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.output.append(line)
            if "listening on " in line:
                self.url = line.rsplit("listening on ", 1)[1].strip()
                break
        if not self.url:
            self.proc.kill()
            raise RuntimeError("goodput serve did not start:\n" + "".join(self.output))
        self._drain = threading.Thread(target=self._read_rest, daemon=True)
        self._drain.start()

    def _read_rest(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush; what was not committed is gone."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# ---------------------------------------------------------------------- workloads
def job_observations(job: str, count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` records of ``job`` over the three GPU types, each with its own id."""
    per_type = [count // 3 + (1 if i < count % 3 else 0) for i in range(3)]
    records = []
    for i, (gpu, n) in enumerate(zip(TYPES, per_type)):
        records += [o.to_dict() for o in observations(gpu, n, seed=seed * 7 + i, job=job)]
    records.append(Observation(job=job, gpu_type="t4", num_nodes=1, num_replicas=1, local_bsz=128, step_time=0.1,
                               grad_sqr=1.0, grad_var=4.0).to_dict())
    return [{**r, "id": f"{job}:{k}"} for k, r in enumerate(records[:count])]


def batches_of(names: list[str], per_job: int, size: int, *, shuffle_seed: int | None = None,
               fresh_ids: bool = False) -> list[tuple[str, list[dict[str, Any]]]]:
    """Each job's :func:`job_observations` (job ``i``: seed ``i``; ``fresh_ids``: random ids) in POSTs of ``size``,
    shuffled across jobs with ``shuffle_seed`` (``None``: in job order)."""
    batches = []
    for i, job in enumerate(names):
        records = job_observations(job, per_job, seed=i)
        if fresh_ids:
            records = [{**r, "id": uuid.uuid4().hex} for r in records]
        batches += [(job, records[k:k + size]) for k in range(0, len(records), size)]
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(batches)
    return batches


def register(url: str, jobs: list[str], sizes: dict[str, float] | None = None) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        for job in jobs:
            settings = {"init_batch_size": 128, "max_batch_size": 4096, "local_bsz_bounds": [8, 512]}
            if sizes:
                settings["model_size"] = sizes[job]
            http.put(f"/v1/jobs/{job}", json=settings).raise_for_status()


async def ingest(url: str, batches: list[tuple[str, list[dict[str, Any]]]], clients: int,
                 acked: set[str] | None = None, stop_on_error: bool = False) -> tuple[int, float, int]:
    """Post ``batches`` from ``clients`` concurrent senders: (records acknowledged, seconds, failed requests)."""
    queue: asyncio.Queue = asyncio.Queue()
    for item in batches:
        queue.put_nowait(item)
    counts = {"acked": 0, "failed": 0}

    async def sender(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            job, records = queue.get_nowait()
            try:
                response = await http.post(f"/v1/jobs/{job}/observations", json={"observations": records})
                response.raise_for_status()
            except httpx.HTTPError:
                counts["failed"] += 1
                if stop_on_error:
                    return
                continue
            counts["acked"] += len(records)
            if acked is not None:
                acked.update(r["id"] for r in records)

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(sender(http) for _ in range(clients)))
    return counts["acked"], time.perf_counter() - started, counts["failed"]


class _Connection:
    """A lean HTTP/1.1 keep-alive GET client on asyncio streams.

    httpx costs about a millisecond of this process's CPU per request; with 8 clients in one
    event loop the clients, not the server, would set the latency. This one costs tens of
    microseconds, so the figures are the server's (the loopback and the kernel included).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> _Connection:
        parsed = httpx.URL(url)
        reader, writer = await asyncio.open_connection(parsed.host, parsed.port)
        return cls(reader, writer, f"{parsed.host}:{parsed.port}")

    async def get(self, path: str) -> tuple[int, bytes]:
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def query_latency(url: str, paths: list[str], clients: int, count: int, seconds: float) -> dict[str, float]:
    """Latency (ms) of GETs of random ``paths`` from ``clients`` concurrent clients: at most ``count``, ``seconds``."""
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds
    rng = random.Random(clients)
    per_client = max(1, count // clients)

    async def client(connection: _Connection) -> None:
        nonlocal errors
        for _ in range(per_client):
            if time.perf_counter() > deadline:
                return
            path = rng.choice(paths)
            started = time.perf_counter()
            status, _ = await connection.get(path)
            latencies.append((time.perf_counter() - started) * 1e3)
            errors += status != 200

    connections = [await _Connection.open(url) for _ in range(clients)]
    try:
        for path in paths[:50]:  # warm up: the connections, and the first answer of each
            await connections[0].get(path)
        started = time.perf_counter()
        await asyncio.gather(*(client(c) for c in connections))
        elapsed = time.perf_counter() - started
    finally:
        for connection in connections:
            await connection.close()
    latencies.sort()
    return {"requests": len(latencies), "errors": errors, "p50_ms": _quantile(latencies, 0.5),
            "p99_ms": _quantile(latencies, 0.99), "max_ms": latencies[-1], "requests_per_s": len(latencies) / elapsed}


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; sorted here, so any order will do)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def wait_ready(url: str, jobs: list[str], timeout: float) -> float:
    """Seconds until every job's model holds every stored observation and the server's worker is idle
    (the models are built in the background, then the server cluster's answers are computed ahead)."""
    started = time.perf_counter()
    deadline = time.monotonic() + timeout

    def built(job: str) -> bool:
        record = http.get(f"/v1/jobs/{job}").json()
        return record["model"]["state"] == "ready" and record["model"]["observations"] == record["observations"]

    with httpx.Client(base_url=url, timeout=30) as http:
        for job in jobs:
            poll_until(lambda: built(job), deadline, f"models not built in {timeout} s ({job} and after)")
        poll_until(lambda: http.get("/healthz").json()["worker"]["idle"], deadline,
                   f"the server's worker still busy after {timeout} s")
    return time.perf_counter() - started


def stored_ids(url: str, jobs: list[str]) -> list[str]:
    """Every stored record id of ``jobs`` (duplicates kept, to count them)."""
    ids: list[str] = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for job in jobs:
            after: int | None = 0
            while after is not None:
                page = http.get(f"/v1/jobs/{job}/observations", params={"after": after, "limit": 10000}).json()
                ids += [r["id"] for r in page["records"]]
                after = page["next_after"]
    return ids


def kill_during_ingest(folder: Path, *, jobs: int = 8, clients: int = 8, batch: int = 25, records_per_job: int = 400,
                       kill_at: float = 0.4, server_args: tuple[str, ...] = ("--model", "plain")) -> dict[str, Any]:
    """SIGKILL a server while ``clients`` senders post to it (once ``kill_at`` of the records are acknowledged),
    restart it on the same store, count.

    Returns acknowledged, stored, lost (acknowledged but not stored), duplicates (stored twice),
    in_flight (stored without an acknowledgement) and the restarted server's answer time.
    """
    store = f"sqlite:///{folder / 'kill.db'}"
    names = [f"kill-{i}" for i in range(jobs)]
    batches = batches_of(names, records_per_job, batch, shuffle_seed=0, fresh_ids=True)
    acked: set[str] = set()
    sent: set[str] = {r["id"] for _, b in batches for r in b}
    with ServerProcess(store, *server_args) as server:
        register(server.url, names)
        def kill_midway() -> None:
            deadline = time.monotonic() + 120
            while len(acked) < kill_at * len(sent) and time.monotonic() < deadline:
                time.sleep(0.001)
            server.kill()

        killer = threading.Thread(target=kill_midway, daemon=True)
        killer.start()
        acknowledged, seconds, failed = asyncio.run(ingest(server.url, batches, clients, acked, stop_on_error=True))
        killer.join()
    started = time.perf_counter()
    with ServerProcess(store, *server_args) as restarted:
        restart_s = time.perf_counter() - started
        ids = stored_ids(restarted.url, names)
        counted = sum(httpx.get(f"{restarted.url}/v1/jobs/{job}").json()["observations"] for job in names)
    unique = set(ids)
    return {"sent": len(sent), "acknowledged": len(acked), "stored": len(unique), "lost": len(acked - unique),
            "duplicates": len(ids) - len(unique), "in_flight": len(unique - acked), "unknown": len(unique - sent),
            "counted": counted, "failed_requests": failed, "ingest_s_before_kill": seconds, "restart_s": restart_s}


# ---------------------------------------------------------------------- the reporter's cost
def reporter_cost(folder: Path, url: str, steps: int) -> dict[str, Any]:
    """µs per ``with reporter.step()`` around nothing, and a real MLP step's ms on this CPU."""
    import torch

    from profilers import zoo
    from profilers.reporter import GoodputReporter

    work = zoo.get("mlp")
    model = work.model
    optimizer = work.optimizer_factory(model.parameters())
    batch = work.make_batch(64, "cpu")

    def train_step() -> None:
        optimizer.zero_grad()
        work.loss_fn(model, batch).backward()
        optimizer.step()

    torch.set_num_threads(1)
    for _ in range(20):
        train_step()
    real = []
    for _ in range(200):
        started = time.perf_counter()
        train_step()
        real.append(time.perf_counter() - started)
    reporter = GoodputReporter("bench-reporter", url, init_batch_size=64, buffer_dir=folder / "reporter",
                               flush_interval=0.5)
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(steps):
            with reporter.step(local_bsz=64):
                pass
        bare = time.perf_counter()
        for _ in range(steps):
            pass
        rounds.append(((bare - started) - (time.perf_counter() - bare)) / steps)
    reporter.close()
    cost_s = statistics.median(rounds)
    step_s = statistics.median(real)
    return {"what": "reporter cost per training step", "reporter_us": cost_s * 1e6, "mlp_step_ms": step_s * 1e3,
            "percent_of_step": 100 * cost_s / step_s, "target_percent": 1.0, "sent": reporter.sent}


def prior_figures(folder: Path, names: list[str], per_job: int) -> dict[str, Any]:
    """Store the jobs (with parameter counts) through one server, then time a ``--learn-prior`` server on the store."""
    store = f"sqlite:///{folder / 'prior.db'}"
    sizes = {job: 10 ** (6 + 2 * i / max(len(names) - 1, 1)) for i, job in enumerate(names)}
    with ServerProcess(store, "--model", "plain") as server:  # storing only: the plain model builds fast
        register(server.url, names, sizes)
        acknowledged, _, failed = asyncio.run(ingest(server.url, batches_of(names, per_job, 50), 8))
    started = time.perf_counter()
    with ServerProcess(store, "--model", "bayesian", "--learn-prior", "--prior-interval", "1") as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:
        health = _wait_health(http, _learned_and_idle)
        elapsed = time.perf_counter() - started
        prior = health["cluster_prior"]
        probes = names[:0:-max(len(names) // 5, 1)][:5]
        learning = _absorbed_while_learning(http, names[0], probes)
        fresh = _absorbed_during_refresh(http, probes, prior["learned_at"])
    started = time.perf_counter()  # a restart: the jobs rebuilt with the prior the store kept
    with ServerProcess(store, "--model", "bayesian", "--learn-prior", "--prior-interval", "1") as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:
        again = _wait_health(http, _learned_and_idle)
        restart = {"restart_to_republished_s": time.perf_counter() - started,
                   "restart_restored": bool(again["cluster_prior"].get("restored"))}
    return {"what": f"cluster prior learned beside the worker ({len(names)} jobs x {per_job}, bayesian)",
            "observations": acknowledged, "failed": failed, "learn_s": prior.get("seconds"),
            "cells": prior.get("cells"), "start_to_republished_s": elapsed, "learned": prior["source"] == "learned",
            **learning, **fresh, **restart}


def poll_until(check: Callable[[], Any], deadline: float, what: str, poll_s: float = 0.1) -> Any:
    """Call ``check`` every ``poll_s`` until it returns something true (returned); TimeoutError(``what``) once
    ``time.monotonic()`` passes ``deadline``."""
    while not (result := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(poll_s)
    return result


def _wait_health(http: httpx.Client, done: Callable[[dict[str, Any]], bool], poll_s: float = 0.2) -> dict[str, Any]:
    """Poll ``/healthz`` (for up to 30 minutes) until ``done(health)``; that health."""
    def check() -> dict[str, Any] | None:
        health = http.get("/healthz").json()
        return health if done(health) else None

    return poll_until(check, time.monotonic() + 1800, "the server did not get there in 1800 s", poll_s)


def _learned_and_idle(health: dict[str, Any]) -> bool:
    return health["cluster_prior"]["source"] == "learned" and health["worker"]["idle"]


def _absorbed_figures(prefix: str, absorbed: dict[str, float]) -> dict[str, Any]:
    """The probes' count, median and slowest seconds until absorbed, as ``<prefix>_...`` fields."""
    return {f"{prefix}_probes": len(absorbed), f"{prefix}_absorbed_median_s": statistics.median(absorbed.values()),
            f"{prefix}_absorbed_max_s": max(absorbed.values())}


def _post_one(http: httpx.Client, job: str) -> int:
    """One new observation of ``job`` (a fresh id); the job's stored count after it."""
    record = {**job_observations(job, 1, seed=99)[0], "id": uuid.uuid4().hex}
    http.post(f"/v1/jobs/{job}/observations", json={"observations": [record]}).raise_for_status()
    return http.get(f"/v1/jobs/{job}").json()["observations"]


def _absorbed(http: httpx.Client, probes: list[str]) -> tuple[dict[str, float], float]:
    """Each of ``probes`` reports a step; the seconds until each job's published model holds it, and the start."""
    started = time.perf_counter()
    stored = {job: _post_one(http, job) for job in probes}
    absorbed: dict[str, float] = {}

    def all_absorbed() -> bool:
        for job in probes:
            if job not in absorbed and http.get(f"/v1/jobs/{job}").json()["model"]["observations"] >= stored[job]:
                absorbed[job] = time.perf_counter() - started
        return len(absorbed) == len(probes)

    poll_until(all_absorbed, time.monotonic() + 1800, "the probes' observations not absorbed in 1800 s", 0.01)
    return absorbed, started


def _absorbed_while_learning(http: httpx.Client, trigger: str, probes: list[str]) -> dict[str, Any]:
    """``trigger``'s new observation makes the server learn the prior again (``--prior-interval 1``); as the
    learning starts, each of ``probes`` reports a step. The median and slowest seconds until a probe's model
    holds its step, and how many did before the prior came back."""
    learned_at = http.get("/healthz").json()["cluster_prior"]["learned_at"]
    _post_one(http, trigger)
    # the learning under way: in its child process, or (before it had one) the worker busy learning
    _wait_health(http, lambda h: h["worker"].get("learning_prior") or h["worker"]["busy"] == "(cluster prior)", poll_s=0.01)
    absorbed, _ = _absorbed(http, probes)
    before = http.get("/healthz").json()["cluster_prior"]["learned_at"] == learned_at
    return {**_absorbed_figures("learning", absorbed), "learning_absorbed_before_prior": before}


def _absorbed_during_refresh(http: httpx.Client, probes: list[str], learned_at: float) -> dict[str, Any]:
    """Jobs' observations posted as a new prior comes back: seconds until each job's published model holds its own.

    The moment the prior learned after ``learned_at`` is adopted every job is due a refit under it,
    and each of ``probes`` reports a step. Returns the median and the slowest probe's seconds, and the
    seconds from that moment until every job is republished (the worker's queues empty: the next
    learning, which the probes' steps call for, may have started)."""
    _wait_health(http, lambda h: (h["cluster_prior"].get("learned_at") or 0) > learned_at, poll_s=0.01)
    absorbed, started = _absorbed(http, probes)

    def republished(h: dict[str, Any]) -> bool:
        w = h["worker"]
        return not (w["rebuild"] or w["update"] or w["warm"] or w["refresh"]) and w["busy"] in (None, "(cluster prior)")

    _wait_health(http, republished, poll_s=0.05)
    seconds = time.perf_counter() - started
    # the learning the probes' steps call for, and its refreshes: the prior the store keeps is then current
    _wait_health(http, lambda h: h["worker"]["idle"] and not h["worker"].get("prior_behind"), poll_s=0.05)
    return {**_absorbed_figures("refresh", absorbed), "refresh_republished_s": seconds}


# ---------------------------------------------------------------------- main
def load_figures(url: str, names: list[str], per_job: int, model: str, count: int, seconds: float) -> list[dict[str, Any]]:
    """Ingest ``per_job`` observations of each job from 8 senders, wait for the models, time the queries."""
    rows: list[dict[str, Any]] = []
    register(url, names)
    acknowledged, elapsed, failed = asyncio.run(ingest(url, batches_of(names, per_job, 50, shuffle_seed=1), 8))
    rows.append({"what": f"ingest, 8 reporters, batches of 50 ({len(names)} jobs x {per_job})",
                 "observations": acknowledged, "seconds": elapsed, "per_s": acknowledged / elapsed,
                 "failed": failed, "target_per_s": 5000})
    build_s = wait_ready(url, names, timeout=900)
    rows.append({"what": f"models built and answers computed after ingest ({model})", "seconds": build_s})
    configs = Cluster.parse(CLUSTER).configurations()
    goodput_paths = [f"/v1/jobs/{job}/goodput?gpu_type={g}&num_nodes={n}&num_gpus={k}"
                     for job in names for g, n, k in configs]
    table_paths = [f"/v1/jobs/{job}/table" for job in names]
    for kind, paths in (("goodput", goodput_paths), ("table", table_paths)):
        for clients in (1, 8, 64):
            figures = asyncio.run(query_latency(url, paths, clients, count, seconds))
            target = 10.0 if kind == "goodput" and clients == 8 else None
            rows.append({"what": f"GET {kind}, {clients} clients", **figures, "target_p99_ms": target})
    rows.append(rounds_while_reporting(url, names, seconds))
    return rows


def rounds_while_reporting(url: str, names: list[str], seconds: float) -> dict[str, Any]:
    """``POST /v1/allocate`` every 50 ms for ``seconds`` once 8 reporters start posting new steps of every job on
    the types its model has (batches of 5, fresh ids; the models absorb them meanwhile), as jobs do while they
    train: rounds answered (200) and refused (503: a model being built), and the answered rounds' latency. A
    round had been a 503 whenever any job's report was not yet in its model."""
    reports = batches_of(names, 40, 5, shuffle_seed=2, fresh_ids=True)
    sender = threading.Thread(target=lambda: asyncio.run(ingest(url, reports, 8)), daemon=True)
    codes: dict[int, int] = {}
    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=60) as http:
        sender.start()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.perf_counter()
            status = http.post("/v1/allocate", json={}).status_code
            codes[status] = codes.get(status, 0) + 1
            if status == 200:
                latencies.append((time.perf_counter() - start) * 1000.0)
            time.sleep(0.05)
        sender.join(seconds + 120)
    return {"what": f"POST allocate (all {len(names)} jobs) every 50 ms while 8 reporters post steps",
            "rounds": sum(codes.values()), "answered": codes.get(200, 0), "not_ready_503": codes.get(503, 0),
            "other": sum(v for k, v in codes.items() if k not in (200, 503)),
            "p50_ms": _quantile(latencies, 0.5) if latencies else None,
            "p99_ms": _quantile(latencies, 0.99) if latencies else None}


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_service", __doc__)
    p.add_argument("--jobs", type=int, help="jobs (default 50; --quick 5)")
    p.add_argument("--observations", type=int, help="observations per job (default 200; --quick 40)")
    p.add_argument("--model", choices=["bayesian", "plain"], help="the server's models (default bayesian; --quick plain)")
    p.add_argument("--parts", default="load,reporter,kill,prior",
                   help="what to run, comma-separated: load (ingest and queries), reporter, kill, prior (default all)")
    args = p.parse_args(argv)
    parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    if not parts or parts - {"load", "reporter", "kill", "prior"}:
        p.error(f"--parts: expected some of load, reporter, kill, prior; got {args.parts!r}")
    jobs = args.jobs or (5 if args.quick else 50)
    per_job = args.observations or (40 if args.quick else 200)
    model = ("--model", args.model or ("plain" if args.quick else "bayesian"))
    count, seconds = (300, 3.0) if args.quick else (4000, 20.0)
    rows: list[dict[str, Any]] = []
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-service-") as tmp:
        folder = Path(tmp)
        names = [f"job-{i:02d}" for i in range(jobs)]
        with ServerProcess(f"sqlite:///{folder / 'goodput.db'}", "--cluster", CLUSTER, *model) as server:
            if "reporter" in parts:
                rows.append(reporter_cost(folder, server.url, 2000 if args.quick else 20000))
            if "load" in parts:
                rows += load_figures(server.url, names, per_job, model[1], count, seconds)
        if "kill" in parts:
            killed = kill_during_ingest(folder, jobs=4 if args.quick else 8, records_per_job=100 if args.quick else 400)
            rows.append({"what": "kill -9 during ingest (8 reporters), restart", **killed, "target_lost": 0,
                         "target_duplicates": 0})
        if "prior" in parts:
            rows.append(prior_figures(folder, names, per_job))
    for row in rows:
        if row.get("target_p99_ms") is not None:
            row["meets_target"] = row["p99_ms"] <= row["target_p99_ms"]
        if row.get("target_per_s") is not None:
            row["meets_target"] = row["per_s"] >= row["target_per_s"]
        if "target_lost" in row:
            row["meets_target"] = row["lost"] == 0 and row["duplicates"] == 0
        if "target_percent" in row:
            row["meets_target"] = row["percent_of_step"] < row["target_percent"]
    report("bench_service", rows, args, extra={"load_average_before": load, "load_average_after": os.getloadavg(),
                                               "jobs": jobs, "observations_per_job": per_job})
    return 0


if __name__ == "__main__":
    sys.exit(main())
