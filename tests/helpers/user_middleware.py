"""Middleware of an operator's own, as `mmserve serve --middleware helpers.user_middleware.X` names
it (tests/test_vllm_flags.py): a pure ASGI class and an HTTP function, each stamping a header."""

from __future__ import annotations

from typing import Any


class Stamp:
    """A pure ASGI middleware: every HTTP answer gets `x-stamp: asgi`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def stamped(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-stamp", b"asgi")]
            await send(message)

        await self.app(scope, receive, stamped)


async def seen(request: Any, call_next: Any) -> Any:
    """An HTTP middleware function: every answer gets `x-seen` with the request's path."""
    response = await call_next(request)
    response.headers["x-seen"] = request.url.path
    return response


not_middleware = 42
