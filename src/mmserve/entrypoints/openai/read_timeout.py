"""Connections that have not sent a whole request within a deadline are closed (uvicorn protocol).

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) but lets a connection that
trickles its headers or body hold a descriptor forever. `read_timeout_protocol` makes an httptools
protocol that arms a timer when a connection opens and when each request's first byte arrives,
and closes the connection if the request is not complete by then (`--request-read-timeout-s`).
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT_S = 30.0


class _ReadTimeoutProtocol(HttpToolsProtocol):
    """httptools' protocol with a deadline on reading each whole request."""

    read_timeout_s = DEFAULT_READ_TIMEOUT_S
    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._disarm()  # the keep-alive timeout takes over until the next request begins
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _expire(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            logger.info("closing a connection from %s: no whole request within %.0f s (--request-read-timeout-s)",
                        "%s:%d" % self.client if self.client else "?", self.read_timeout_s)
            self.transport.close()


def read_timeout_protocol(timeout_s: float) -> type[HttpToolsProtocol]:
    """An httptools protocol class closing connections that send no whole request in `timeout_s`."""
    return type("ReadTimeoutProtocol", (_ReadTimeoutProtocol,), {"read_timeout_s": timeout_s})
