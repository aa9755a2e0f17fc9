"""Exceptions raised at the library's boundaries.

Every validation error is a :class:`ValueError` subclass that names the field
and the offending value, so callers can catch ``ValueError`` and users can read
what was wrong without a traceback dive.
"""

from __future__ import annotations

from typing import Any


class ValidationError(ValueError):
    """A value failed validation.

    Attributes:
        field: the name of the argument or record field that was wrong.
        value: the value that was given.
        reason: what was expected instead.
    """

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"{field}={value!r}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        """Picklable across processes (a worker's error reaches the parent as itself, not as a broken pool)."""
        return (type(self), (self.field, self.value, self.reason), self.__dict__)


class UnknownGPUTypeError(ValidationError):
    """A GPU type that the model, table or cluster has never heard of."""

    def __init__(self, gpu_type: Any, known: list[str] | tuple[str, ...] = (), field: str = "gpu_type"):
        known_text = ", ".join(sorted(known)) if known else "none"
        self.known = tuple(known)
        super().__init__(field, gpu_type, f"unknown GPU type (known: {known_text})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.value, self.known, self.field), self.__dict__)


class DataFormatError(ValidationError):
    """A file (profile, CSV, JSON) holds a record that cannot be read.

    ``line`` is 1-based, as an editor shows it; ``path`` is the file.
    """

    def __init__(self, path: Any, line: int | None, field: str, value: Any, reason: str) -> None:
        self.path = str(path)
        self.line = line
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(field, value, reason)
        self.args = (f"{where}: {field}={value!r}: {reason}",)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.line, self.field, self.value, self.reason), self.__dict__)
