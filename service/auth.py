"""Bearer tokens for writes, and a limit on request bodies (plain ASGI middlewares).

With ``goodput serve --token-file F`` every write — ``PUT``, ``POST``, ``PATCH``,
``DELETE`` — needs ``Authorization: Bearer <token>`` with a token listed in ``F``
(one per line; blank lines and ``#`` comments ignored); else 401 with
``WWW-Authenticate: Bearer``. The Kubernetes extender's calls
(``POST /v1/k8s/filter``, ``/v1/k8s/prioritize``) are read-only and stay open:
kube-scheduler sends no token. Reads (``GET``) are open. Tokens are compared
with :func:`hmac.compare_digest` against every listed token (constant time,
no early exit). The check runs before the body is read.

Bodies over ``max_body_bytes`` (10 MB by default) are refused with 413: at
once when ``Content-Length`` says so, else as soon as the streamed body passes
the limit.
"""

from __future__ import annotations

import hmac
import json
from pathlib import Path
from typing import Any

from starlette.exceptions import HTTPException

from goodput.errors import ValidationError

__all__ = ["read_tokens", "TokenAuthMiddleware", "BodyLimitMiddleware", "OPEN_WRITE_PREFIXES", "DEFAULT_MAX_BODY"]

DEFAULT_MAX_BODY = 10 * 1024 * 1024
OPEN_WRITE_PREFIXES = ("/v1/k8s/",)  # the scheduler extender: read-only POSTs
WRITE_METHODS = frozenset({"PUT", "POST", "PATCH", "DELETE"})


def read_tokens(path: str | Path) -> tuple[str, ...]:
    """The tokens in ``path``: one a line, blank lines and ``#`` comments ignored; at least one."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValidationError("token_file", str(path), f"cannot be read ({exc.strerror or exc})") from None
    tokens = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    if not tokens:
        raise ValidationError("token_file", str(path), "holds no token (one a line)")
    short = [t for t in tokens if len(t) < 16]
    if short:
        raise ValidationError("token_file", str(path), "a token is shorter than 16 characters; use e.g. "
                              "python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return tokens


async def _send_json(send: Any, status: int, detail: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class TokenAuthMiddleware:
    """Refuse writes without a valid bearer token (401); see the module docstring."""

    def __init__(self, app: Any, tokens: tuple[str, ...]) -> None:
        self.app = app
        self.tokens = tuple(t.encode("utf-8") for t in tokens)

    def authorized(self, header: bytes | None) -> bool:
        if header is None:
            return False
        scheme, _, given = header.partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            return False
        given = given.strip()
        ok = False
        for token in self.tokens:  # every token compared: the time does not tell which one nearly matched
            ok |= hmac.compare_digest(given, token)
        return ok

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and scope.get("method") in WRITE_METHODS
                and not scope.get("path", "").startswith(OPEN_WRITE_PREFIXES)):
            header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            if not self.authorized(header):
                await _send_json(send, 401, "writes need 'Authorization: Bearer <token>' with a token of the "
                                 "server's --token-file", ((b"www-authenticate", b'Bearer realm="goodput"'),))
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with 413 (see the module docstring)."""

    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_BODY) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await _send_json(send, 400, f"Content-Length {length.decode(errors='replace')!r} is not a number")
                return
            if declared > self.max_bytes:
                await _send_json(send, 413, f"request body of {declared} bytes exceeds the limit of {self.max_bytes}")
                return
        received = 0
        limit = self.max_bytes

        async def limited() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # FastAPI passes an HTTPException raised while reading the body through
                    raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
            return message

        await self.app(scope, limited, send)
