"""Running the service under uvicorn on a socket bound first (port 0: the OS picks a free one).

:func:`serve` is ``goodput serve``'s loop: it binds, starts the app (the model
worker starts with it), prints ``goodput serve: listening on http://HOST:PORT``
once requests are accepted, and stops cleanly on SIGINT/SIGTERM.
:class:`BackgroundServer` runs the same server in a thread of the current
process (tests, benchmarks, ``goodput demo``).

Example::

    with BackgroundServer(create_app("sqlite:///goodput.db")) as server:
        Client(server.url).health()
"""

from __future__ import annotations

import gc
import socket
import sys
import threading
import time
from typing import Any

import uvicorn

__all__ = ["serve", "bind", "BackgroundServer"]


def bind(host: str = "127.0.0.1", port: int = 8470) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn's server, announcing its address once it accepts requests."""

    def __init__(self, config: uvicorn.Config, url: str, announce: bool) -> None:
        super().__init__(config)
        self.url = url
        self.announce = announce

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.announce and self.started:
            print(f"goodput serve: listening on {self.url}", file=sys.stdout, flush=True)


def _config(app: Any, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on", timeout_graceful_shutdown=5,
                          timeout_keep_alive=30, server_header=False)


def serve(app: Any, host: str = "127.0.0.1", port: int = 8470, *, log_level: str = "warning") -> None:
    """Serve ``app`` on ``host:port`` until SIGINT/SIGTERM.

    The interpreter's thread switch interval is lowered from 5 ms to 1 ms: while the model
    worker refits (Python between its numpy and torch calls), a request waits at most that
    long for the interpreter lock. The objects made by the imports (torch, gpytorch, pandas,
    … about 300,000) are moved out of the garbage collector's reach (``gc.freeze``): they
    live as long as the process, and a full collection, which pauses every thread, then
    scans only the models (measured: 330 -> 110 ms with 6 Bayesian models).
    """
    sys.setswitchinterval(0.001)
    gc.collect()
    gc.freeze()
    sock = bind(host, port)
    server = _Server(_config(app, log_level), _url(sock), announce=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


class BackgroundServer:
    """The service on ``127.0.0.1`` and a free port, in a thread; a context manager.

    Attributes:
        url: ``http://127.0.0.1:PORT`` once started.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning") -> None:
        self.app = app
        self.sock = bind(host, port)
        self.url = _url(self.sock)
        self.server = _Server(_config(app, log_level), self.url, announce=False)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="goodput-serve", daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        """Serve in the thread once the app's store is this server's (``Store.claim``: another server's store is
        a ``StoreBusyError`` here, in one line, not uvicorn's failed start-up); the socket is closed on failure."""
        try:
            registry = getattr(getattr(self.app, "state", None), "registry", None)
            if registry is not None:
                registry.store.claim()
            self.thread.start()
            deadline = time.monotonic() + timeout
            while not self.server.started:
                if not self.thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"goodput serve did not start on {self.url}")
                time.sleep(0.01)
        except BaseException:
            self.server.should_exit = True
            self.sock.close()
            raise
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
