"""The access log line of each HTTP request, written once the response's first bytes are out.

uvicorn logs it on `http.response.start`, before the status line is written, which delays every
streamed request's first token (README, "Measurements behind the design"). This middleware writes the same
line (uvicorn's arguments, through the handlers and formatter uvicorn set up for its access log)
right after the first body message has been handed to the transport, or when the response ends
without one (an error that escapes the app: 500, as Starlette answers it).

`take_over_uvicorn_access_log` moves uvicorn's access-log handlers to `mmserve.access`: uvicorn
logs a request only while its `uvicorn.access` logger has handlers, so its own line stops.
"""

from __future__ import annotations

import logging
from typing import Any

from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from mmserve.entrypoints.openai.body_limit import Message, Receive, Scope, Send

logger = logging.getLogger("mmserve.access")


class AccessLogMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not logger.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        status: int | None = None
        logged = False

        async def logging_send(message: Message) -> None:
            nonlocal status, logged
            await send(message)
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not logged:
                logged = True
                _log(scope, status)

        try:
            await self.app(scope, receive, logging_send)
        except Exception:
            if status is None:  # Starlette's outermost middleware answers it with a 500
                status = 500
            raise
        finally:
            if status is not None and not logged:
                _log(scope, status)


def _log(scope: Any, status: int | None) -> None:  # an HTTP scope, as uvicorn types it
    logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"], get_path_with_query_string(scope),
                scope["http_version"], status)


def take_over_uvicorn_access_log() -> None:
    """Give uvicorn's access-log handlers and level to `mmserve.access` (call after uvicorn's
    `Config` has set up logging, before serving); uvicorn then writes no access line itself."""
    theirs = logging.getLogger("uvicorn.access")
    logger.handlers, logger.propagate = theirs.handlers, theirs.propagate
    logger.setLevel(theirs.level)
    theirs.handlers, theirs.propagate = [], False
