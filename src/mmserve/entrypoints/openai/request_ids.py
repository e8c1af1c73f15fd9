"""Request ids a client gives, as vLLM reads them, and vLLM's `--enable-request-id-headers`.

A client names its request with an `X-Request-Id` header or the body's `request_id` (the header
wins); the answer's id is then the endpoint's prefix and that name (`chatcmpl-<name>`), so the
client's logs and the server's meet. The engine's own id gets a suffix, since two requests may
carry one name. With the flag every answer carries `X-Request-Id`: the client's name, else the
answer's id, else (a request refused before its id was made) a fresh one.
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request

from mmserve.entrypoints.openai.protocol import ParameterError

MAX_REQUEST_ID_CHARS = 256


def client_request_id(raw_request: Request, body_id: str | None) -> str | None:
    """The client's name for the request: its `X-Request-Id` header, else the body's `request_id`;
    None when neither. A `ParameterError` for one that is not 1 to `MAX_REQUEST_ID_CHARS` printable
    ASCII characters without spaces (it reaches logs and headers)."""
    named = raw_request.headers.get("x-request-id")
    param = "X-Request-Id"
    if named is None:
        named, param = body_id, "request_id"
    if named is None:
        return None
    if not (0 < len(named) <= MAX_REQUEST_ID_CHARS and named.isascii() and named.isprintable() and " " not in named):
        raise ParameterError(param, f"{param} must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters "
                             f"without spaces; got {named[:40]!r}")
    return named


class RequestIdHeaderMiddleware:
    """Every HTTP answer gets `X-Request-Id`: the id the handler recorded in the request's state
    (`raw_request.state.request_id`), else the request's own header, else a fresh one."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})

        async def with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                named = scope["state"].get("request_id") or _header(scope) or uuid.uuid4().hex
                message["headers"] = [*message.get("headers", []), (b"x-request-id", named.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, with_id)


def _header(scope: dict[str, Any]) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if 0 < len(text) <= MAX_REQUEST_ID_CHARS and text.isprintable() else None
    return None
