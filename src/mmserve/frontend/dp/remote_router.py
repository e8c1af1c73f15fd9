"""An API server's `Router` when the launcher's coordinator routes (`coordinator.py`).

The request crosses without its items' data (hashes, placeholders, tokens and salt are what
routing reads); one ZMQ round trip over ipc:// per route, and `decisions` asked at scrape time.
Every use of the socket runs on one I/O thread of its own, so the event loop never blocks on the
coordinator: admission awaits `route_async`, and `on_sent` / `on_finished` are queued behind it
(in order). A coordinator that fails on an ask answers with the error, raised here at once.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import msgspec
import zmq

from mmserve.frontend.dp.dp_router import Route
from mmserve.ipc.launcher_messages import DecisionsAsk, RouteAnswer, RouteAsk, RouteLanded, RouteSent
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.ipc.serial import MsgpackDecoder, MsgpackEncoder

_ANSWER_TIMEOUT_S = 10.0  # an API server waits this long for a route before failing the request


class RemoteRouter:
    """`DPRouter`'s interface for an API server, answered by the coordinator at `address`.

    Load and restarts reach the coordinator without the API servers (`set_load` and `forget`
    do nothing here). The socket is used on `_io`, one thread, whichever thread calls."""

    def __init__(self, address: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(RouteAnswer)
        self._asked = 0
        self._io = ThreadPoolExecutor(1, thread_name_prefix="mmserve-coordinator-io")

    def route(self, request: EngineCoreRequest, live: Sequence[int], forced: int | None = None) -> Route:
        """One round trip, waited for (the failover path); see `route_async`."""
        return self._io.submit(self._route, request, live, forced).result()

    async def route_async(self, request: EngineCoreRequest, live: Sequence[int], forced: int | None = None) -> Route:
        """One round trip on the I/O thread, awaited; RuntimeError if the coordinator failed or did
        not answer within `_ANSWER_TIMEOUT_S`."""
        return await asyncio.wrap_future(self._io.submit(self._route, request, live, forced))

    def _route(self, request: EngineCoreRequest, live: Sequence[int], forced: int | None) -> Route:
        bare = msgspec.structs.replace(request, mm_items=[msgspec.structs.replace(item, data=None, shm_handle=None)
                                                          for item in request.mm_items])
        answer = self._ask(RouteAsk(bare, list(live), forced), request.request_id)
        return Route(answer.rank, answer.reason, [])

    @property
    def decisions(self) -> Counter[str]:
        """Every API server's routing decisions so far, by reason (one round trip)."""
        self._asked += 1
        ask = f"decisions-{self._asked}"
        return Counter(self._io.submit(self._ask, DecisionsAsk(ask), ask).result().decisions)

    def _ask(self, msg: RouteAsk | DecisionsAsk, request_id: str) -> RouteAnswer:
        self._sock.send_multipart(self._encoder.encode(msg), copy=False)
        while self._sock.poll(int(_ANSWER_TIMEOUT_S * 1000), zmq.POLLIN):
            answer: RouteAnswer = self._decoder.decode(self._sock.recv_multipart())
            if answer.request_id == request_id and answer.error is not None:
                raise RuntimeError(f"the data-parallel coordinator failed: {answer.error}")
            if answer.request_id == request_id:  # an answer that came too late is dropped
                return answer
        raise RuntimeError(f"the data-parallel coordinator did not answer within {_ANSWER_TIMEOUT_S:g} s")

    def on_sent(self, route: Route, request: EngineCoreRequest) -> None:
        self._io.submit(self._tell, RouteSent(request.request_id))

    def on_finished(self, rank: int) -> None:
        self._io.submit(self._tell, RouteLanded(rank))

    def _tell(self, msg: RouteSent | RouteLanded) -> None:
        self._sock.send_multipart(self._encoder.encode(msg), copy=False)

    def set_load(self, rank: int, running_and_waiting: int, kv_usage: float) -> None:
        pass

    def forget(self, rank: int) -> None:
        pass

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._ctx.destroy(linger=0)
