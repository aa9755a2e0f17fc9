"""Shared pieces of the service's tests: real profiles, a live server, a real PostgreSQL server.

``postgres_server`` starts Debian's PostgreSQL binaries (``initdb``, ``pg_ctl``)
in a temporary directory on a free port of 127.0.0.1 for the test session and
stops it at the end. ``initdb`` refuses to run as root, so as root it runs as
the ``postgres`` system user the Debian package creates (``runuser``). The tests
that need it skip, saying why, only when the binaries are absent (``.ci/run``
installs them) or no unprivileged user exists to run them.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import experiments
from goodput import Profile
from goodput.client import Client, NotReadyError

PROFILES = Path(experiments.__file__).resolve().parent / "data" / "profiles"


def profile(name: str = "mlp") -> Profile:
    """A profile measured on this project's CPU host (``experiments/data/profiles``)."""
    return Profile.load(PROFILES / f"cpu-zoo-{name}.jsonl")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(call, timeout: float = 60.0):
    """``call()``'s result once the service stops answering 503 (its model is being built)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except NotReadyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextlib.contextmanager
def live_server(store, **options) -> Iterator[tuple[str, Client]]:
    """``create_app(store, **options)`` served on 127.0.0.1:<free port> in a thread; yields (url, client)."""
    from service import create_app
    from service.server import BackgroundServer

    options.setdefault("coalesce_s", 0.0)
    options.setdefault("min_interval_s", 0.0)
    app = create_app(store, **options)
    with BackgroundServer(app) as server, Client(server.url, token=options.get("tokens", (None,))[0]) as client:
        yield server.url, client


# ---------------------------------------------------------------------- PostgreSQL
def _postgres_bin() -> Path | None:
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name), reverse=True):
        if (Path(candidate) / "initdb").exists() and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb and shutil.which("pg_ctl") else None


class PostgresServer:
    """A throw-away PostgreSQL cluster: ``initdb`` in a temporary directory, ``pg_ctl start`` on a free port."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.prefix: list[str] = []
        self.user = None
        if os.geteuid() == 0:
            try:
                self.user = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root and there is no 'postgres' user to run initdb as") from None
            self.prefix = ["runuser", "-u", "postgres", "--"]
        self.dir = Path(tempfile.mkdtemp(prefix="goodput-pg-"))
        if self.user is not None:
            os.chown(self.dir, self.user.pw_uid, self.user.pw_gid)
        self.data = self.dir / "data"
        self.port = 0

    def _run(self, *args: str, timeout: float = 120) -> None:
        result = subprocess.run([*self.prefix, *args], capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed: {result.stdout}{result.stderr}")

    def start(self) -> PostgresServer:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--no-sync", "--no-instructions")
        for attempt in range(3):
            self.port = free_port()
            options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                       "-c full_page_writes=off -c max_connections=60")
            try:
                self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-o", options,
                          "-w", "-t", "60", "start")
                return self
            except RuntimeError:
                if attempt == 2:
                    raise
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A fresh, empty database: its SQLAlchemy URL."""
        import psycopg

        name = f"goodput_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    bindir = _postgres_bin()
    if bindir is None:
        pytest.skip("PostgreSQL's binaries (initdb, pg_ctl) are absent: apt-get install postgresql (.ci/run does)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed (pip install 'goodput[postgres]')")
    try:
        server = PostgresServer(bindir)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store of each kind: a SQLite file, and a database on the session's PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'goodput.db'}"
    return request.getfixturevalue("postgres_server").create_database()
