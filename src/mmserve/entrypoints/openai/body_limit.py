"""A cap on the request body, enforced before the body is buffered (ASGI middleware).

A declared `Content-Length` over the cap is refused with 413 before a byte is read; a body sent
without one (chunked) is counted as it streams in and refused with 413 as soon as it passes the
cap, so no request can make the server hold more than the cap in memory.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        mb = self.max_bytes / (1 << 20)
        body = json.dumps({"error": {"message": f"the request body exceeds the server's limit of {mb:.1f} MiB "
                                                f"(--max-request-body-mb)", "type": "invalid_request_error",
                                     "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def default_body_limit(max_media_bytes: int, max_images: int) -> int:
    """Room for every allowed image as base64 (4/3 of its bytes) plus 1 MiB of text and JSON."""
    return max_images * (max_media_bytes * 4 // 3 + 4) + (1 << 20)
