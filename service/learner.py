"""Learning the cluster prior in a child process, beside the service's worker.

Learning a :class:`~goodput.hierarchy.ClusterPrior` from the service's jobs is the
worker's longest task: every (job, GPU type) cell's fit, each type's sync shape,
the residual GP's shared hyperparameters and the hierarchy's EM take 15–17 s of
CPU for 50 jobs × 200 observations (``experiments/bench_service.py --parts
prior``). Run by the worker, it held up every job's update behind it; run in a
thread, it would take the interpreter lock from the worker and from the request
threads. :class:`PriorLearner` runs it in a spawned process (its own interpreter
and CPU core) and hands the prior back through a pipe: the summaries, shapes and
GP prior only, with the hierarchy already fitted.

A process that fails, dies or runs past its ``timeout_s`` (then ended) reports an
error instead; :meth:`PriorLearner.stop` ends one still running (the service's
shutdown does not wait for it). As with
:func:`profilers.profile_job`'s replicas, a script that starts the service in its
own process must do so under ``if __name__ == "__main__":`` (the child is spawned).

Example::

    learner = PriorLearner()
    learner.start({"a": obs_a, "b": obs_b}, {"a": 1e6, "b": 2e7}, on_done=print)
    # ... on_done(prior, None, seconds) from a watcher thread once learned
    learner.stop()
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from goodput.hierarchy import ClusterPrior
from goodput.observations import Observation
from goodput.validation import check_float

__all__ = ["PriorLearner", "learn_prior", "LEARN_TIMEOUT_S"]

log = logging.getLogger("goodput.service")

LEARN_TIMEOUT_S = 3600.0  # a learning still running after this long is ended (64 jobs take ~20 s on 2 cores)

# on_done(prior, error, seconds): the learned prior (or None) and what went wrong (or None)
Done = Callable[[ClusterPrior | None, str | None, float], None]


def learn_prior(observations: Mapping[str, Sequence[Observation]], sizes: Mapping[str, float | None]) -> ClusterPrior:
    """The cluster prior of ``{job: observations}`` and their parameter counts, without the observations
    (a job's left-out prior is then a refit of the hierarchy, not of every cell), its hierarchy fitted,
    and each job's left-out prior fitted too (:meth:`~goodput.hierarchy.ClusterPrior.exclude` keeps them:
    about 0.1 s each at 50 jobs that the service's worker does not spend when the jobs take the prior)."""
    learned = ClusterPrior.from_observations(observations, sizes)
    prior = ClusterPrior(learned.summaries, shapes=learned.shapes, gp_prior=learned.gp_prior)
    prior.fitted()
    for job in prior.jobs:
        prior.exclude(job).fitted()
    return prior


def _exit_with(parent: int, every_s: float = 1.0) -> None:
    """End this process once ``parent`` is gone (it was reparented): a server killed with ``kill -9`` (or
    by the OOM killer) does not leave its learning running to the end, beside the restarted server's."""
    while True:
        time.sleep(every_s)
        if os.getppid() != parent:
            os._exit(1)


def _child(conn: Any, observations: Mapping[str, Sequence[Observation]], sizes: Mapping[str, float | None],
           parent: int | None = None) -> None:
    """The child's work: learn, send ``("ok", prior)`` or ``("error", text)``.

    Ctrl-C in the server's terminal reaches the child too (one process group): it is ignored here, the
    server ends the child itself (:meth:`PriorLearner.stop`); it had died with a traceback, reported as
    a failed learning. The child also ends when ``parent`` does (:func:`_exit_with`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent,), name="goodput-parent-watch", daemon=True).start()
    try:
        message: tuple[str, Any] = ("ok", learn_prior(observations, sizes))
    except Exception as exc:  # noqa: BLE001 - the parent logs it; the service keeps the prior it had
        message = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        conn.send(message)
    finally:
        conn.close()


class PriorLearner:
    """One learning at a time in a spawned process; the result comes to ``on_done`` from a watcher thread.

    ``timeout_s``: a learning still running after this many seconds is ended and reported as an error.
    """

    def __init__(self, timeout_s: float = LEARN_TIMEOUT_S) -> None:
        self.timeout_s = check_float("timeout_s", timeout_s, positive=True)
        self._lock = threading.Lock()
        self._process: Any = None
        self._watcher: threading.Thread | None = None
        self._stopped = False

    def start(self, observations: Mapping[str, Sequence[Observation]], sizes: Mapping[str, float | None],
              on_done: Done) -> None:
        """Start learning from ``{job: observations}`` (copied to the child) and their ``sizes`` (parameters).

        Raises ``RuntimeError`` while a learning runs or after :meth:`stop`, and what starting the process
        raises; every other failure reaches ``on_done`` as its error."""
        ctx = multiprocessing.get_context("spawn")
        with self._lock:
            if self._stopped:
                raise RuntimeError("the prior learner was stopped")
            if self._watcher is not None and self._watcher.is_alive():
                raise RuntimeError("a cluster prior is being learned already")
            receive, send = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_child, args=(send, {j: list(o) for j, o in observations.items()}, dict(sizes),
                                                       os.getpid()),
                                  name="goodput-prior-learner", daemon=True)
            try:
                process.start()
            except BaseException:
                receive.close()
                raise
            finally:
                send.close()  # the child holds its own end: its exit ends our recv()
            self._process = process
            self._watcher = threading.Thread(target=self._watch, args=(process, receive, on_done, time.perf_counter()),
                                             name="goodput-prior-watcher", daemon=True)
            self._watcher.start()

    def _watch(self, process: Any, receive: Any, on_done: Done, started: float) -> None:
        prior, error = None, None
        try:
            if receive.poll(self.timeout_s):  # a result, or EOF: the child exited
                kind, payload = receive.recv()
                prior, error = (payload, None) if kind == "ok" else (None, payload)
            else:
                process.terminate()
                error = f"learning the prior took longer than {self.timeout_s:g} s; the process was ended"
        except (EOFError, OSError):  # the child died without a word (killed, out of memory) or was stopped
            process.join(1.0)
            error = f"the learning process ended without a result (exit code {process.exitcode})"
        finally:
            receive.close()
        process.join(5.0)
        with self._lock:
            stopped = self._stopped
        if not stopped:
            on_done(prior, error, time.perf_counter() - started)

    def stop(self, timeout: float = 5.0) -> None:
        """End a learning still running (its result is dropped) and refuse new ones."""
        with self._lock:
            self._stopped = True
            process, watcher = self._process, self._watcher
        if process is not None and process.is_alive():
            process.terminate()
        if watcher is not None:
            watcher.join(timeout)
