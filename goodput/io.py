"""Crash-safe file writing (a reader sees the old file or the new one, never half of one), and a clean stdout."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file, ``fsync`` and ``os.replace``."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file, ``fsync`` and ``os.replace``: a process that
    dies midway leaves the previous file whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a written file gets the usual mode
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def read_json(path: str | os.PathLike[str]) -> Any:
    """Parse a JSON file; a syntax error becomes a :class:`~goodput.errors.DataFormatError` with its line,
    as does a file that is not UTF-8 text (a spreadsheet, a compressed file)."""
    from .errors import DataFormatError

    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataFormatError(path, exc.lineno, "json", exc.msg, "not valid JSON") from None
    except UnicodeDecodeError as exc:
        raise not_utf8(path, exc) from None


def check_out_path(field: str, path: str | os.PathLike[str], kind: str) -> None:
    """Refuse an unusable output path before the work that fills it, as a ValidationError naming ``field``:
    ``kind`` ``"file"`` given a folder, ``"folder"`` given a file, or a place that cannot be created (an
    ancestor that is a file, or a folder without write permission)."""
    from .errors import ValidationError

    target = Path(path)
    if kind == "file" and target.is_dir():
        raise ValidationError(field, os.fspath(path), "is a directory; expected a file")
    if kind == "folder" and target.exists() and not target.is_dir():
        raise ValidationError(field, os.fspath(path), "is a file; expected a directory")
    existing = (target.parent if kind == "file" else target).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValidationError(field, os.fspath(path), f"{existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValidationError(field, os.fspath(path), f"permission denied: cannot write in {existing}")


def try_lock_file(path: str | os.PathLike[str]) -> int | None:
    """An exclusive, non-blocking ``flock`` on ``path`` (created if missing): its descriptor, held until closed
    (``os.close``; the kernel lets it go when the process dies), or ``None`` when another holds it. A file that
    cannot be opened (a missing folder, no permission) is the ``OSError``."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def not_utf8(path: str | os.PathLike[str], exc: UnicodeDecodeError) -> Exception:
    """The :class:`~goodput.errors.DataFormatError` for a file that is not UTF-8 text (a spreadsheet's cp1252
    export, a compressed file), naming the file, ``encoding`` and the first byte it could not read."""
    from .errors import DataFormatError

    return DataFormatError(path, None, "encoding", exc.object[exc.start:exc.end], "not UTF-8 text: save the file as UTF-8")


_REDIRECT_LOCK = threading.Lock()
_redirect = {"depth": 0, "saved": None}  # one redirection for all threads inside; the last one out restores


@contextlib.contextmanager
def native_stdout_to_stderr() -> Iterator[None]:
    """Meanwhile, send what native code writes to file descriptor 1 to descriptor 2.

    HiGHS (scipy's MILP solver) prints a debug line to stdout in some solves whatever its
    output options (ERGO-Code/HiGHS#2783); around a solve this keeps the process's stdout
    what the caller writes there, e.g. ``goodput allocate --json``. Meant for a native call
    only: what Python writes to ``sys.stdout`` inside the block (this thread or another)
    reaches stdout only if it is still buffered when the block ends; flushed inside it
    (``print(flush=True)``, ``PYTHONUNBUFFERED``, a full buffer) it goes to stderr. Safe
    across threads and nesting (the first in redirects, the last out restores); a process
    without a real descriptor 1 runs the block unchanged.
    """
    with _REDIRECT_LOCK:
        if _redirect["depth"] == 0:
            try:
                sys.stdout.flush()
                saved = os.dup(1)
                os.dup2(2, 1)
            except (OSError, ValueError, AttributeError):
                saved = None
            _redirect["saved"] = saved
        _redirect["depth"] += 1
    try:
        yield
    finally:
        with _REDIRECT_LOCK:
            _redirect["depth"] -= 1
            saved = _redirect["saved"]
            if _redirect["depth"] == 0 and saved is not None:
                os.dup2(saved, 1)
                os.close(saved)
                _redirect["saved"] = None


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process's umask, read without changing it (Linux: /proc); elsewhere set briefly to 0o077.

    Setting it to 0 to read it, even briefly, would make files that other threads
    create meanwhile world-writable.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask
