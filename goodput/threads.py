"""Run the model's small-matrix numerics with one BLAS thread.

The model's linear algebra works on matrices of a few hundred rows at most
(Cholesky factors of the GP, Pollux's L-BFGS-B on seven parameters). On such
sizes OpenBLAS's threads only contend, and on a busy host they spin: measured on
this project's 2-core CI machine under load, ``fit_throughput`` of 70
observations took 0.84 s with the default thread pool and 9 ms with one thread,
a 200×200 Cholesky 0.55 ms against 0.10 ms. :func:`single_threaded` limits BLAS
to one thread for the duration of a call (threadpoolctl; about 10 µs to enter),
and restores the caller's setting afterwards. BLAS's thread count is the
process's, so calls that overlap in several threads (a service's worker and its
requests) share one limit: the first to enter sets it, the last to leave
restores what was there before the first (each restoring what it found had left
the process at one thread for good).

threadpoolctl (3.8) lets only one "controlling" thread change OpenBLAS's
process-wide count and silently ignores the others; a limit set through
``ThreadpoolController.limit`` keeps that thread in control after it is
restored. Once the main thread had run one decorated call, the model's numerics
in every other thread (a service's worker and requests) ran unlimited:
CPU / wall time 1.98 for a 1500×1500 product against 1.0. As this module already
keeps the one process-wide limit under its lock, it releases the control before
setting the limit and after restoring it.

Example::

    @single_threaded
    def refit(self): ...
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["blas_single_thread", "single_threaded"]

_controller: Any = None
_lock = threading.Lock()
_active = 0  # blocks inside blas_single_thread now, in every thread
_limiter: Any = None  # the limit the first of them set, which the last restores
F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def blas_single_thread() -> Iterator[None]:
    """Limit BLAS/LAPACK to one thread inside the block (shared by blocks that overlap in other threads)."""
    global _controller, _active, _limiter
    with _lock:
        if _active == 0:
            if _controller is None:
                from threadpoolctl import ThreadpoolController

                _controller = ThreadpoolController()
            _release_openblas_control()
            _limiter = _controller.limit(limits=1, user_api="blas")
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                _release_openblas_control()  # the last to leave may not be the thread that set the limit
                _limiter.restore_original_limits()
                _limiter = None
                _release_openblas_control()


def _release_openblas_control() -> None:
    """Let this thread set OpenBLAS's count: threadpoolctl 3.8 ignores every thread but the first to set it
    (``OpenBLASController.clear_controlling_thread``; versions without it let any thread set it)."""
    from threadpoolctl import OpenBLASController

    clear = getattr(OpenBLASController, "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)


def single_threaded(fn: F) -> F:
    """Decorator: run ``fn`` under :func:`blas_single_thread`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with blas_single_thread():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
