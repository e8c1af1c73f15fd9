"""The requests P0 has open (request id -> `OpenRequest`), and the one place each one is released.

`AsyncLLM` owns one `OpenRequests`; admission, failover and the output loop share it (passed to
each at construction). A request is open from admission (`open`) until its caller's generator
ends (`release`), whatever ended it: its last output, an abort, the client gone, a failure, the
engine's death. An error put on its queue ends it for its caller; `fail_all` marks the whole
frontend dead. A queue holds at most one output (unread ones merge, `output_queue.py`); a request
whose caller has read nothing for `--stalled-stream-abort-s` while outputs keep coming is aborted (`put`).
The output processor reads and writes each request's output state here (`OutputStates`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableMapping

from mmserve.errors import ClientError
from mmserve.frontend.engine_client.core_client import EngineDeadError
from mmserve.frontend.engine_client.sender import RankSender
from mmserve.frontend.output.output_processor import RequestState
from mmserve.frontend.request.open_request import OpenRequest
from mmserve.frontend.request.output_queue import OutputQueue
from mmserve.ipc.messages import client_request_id
from mmserve.outputs import RequestOutput
from mmserve.transport.item_transport import ItemTransport

logger = logging.getLogger(__name__)

DEFAULT_STALL_ABORT_S = 60.0  # --stalled-stream-abort-s


class OpenRequests:
    """Request id -> `OpenRequest`; failing, aborting and releasing one, or failing all once P0 is dead."""

    def __init__(self, sender: RankSender, transport: ItemTransport, stall_abort_s: float = DEFAULT_STALL_ABORT_S,
                 ) -> None:
        self.sender = sender
        self.transport = transport
        self.stall_abort_s = stall_abort_s
        self._open: dict[str, OpenRequest] = {}
        self.output_states = OutputStates(self._open)
        self.dead_error: str | None = None  # why no rank serves and none can come back

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def get(self, request_id: str) -> OpenRequest | None:
        return self._open.get(request_id)

    def ids(self) -> list[str]:
        return sorted(self._open)

    def values(self) -> list[OpenRequest]:
        return list(self._open.values())

    @property
    def queues(self) -> dict[str, OutputQueue]:
        """Each open request's output queue."""
        return {rid: request.queue for rid, request in self._open.items()}

    def open(self, request: OpenRequest) -> OpenRequest:
        """Register a new request (ClientError if its id is in use)."""
        if request.request_id in self._open:
            raise ClientError(f"request id {request.request_id!r} is already in use")
        self._open[request.request_id] = request
        return request

    def close(self, request: OpenRequest) -> None:
        """Drop a request that was never sent (admission's undo)."""
        if self._open.get(request.request_id) is request:
            del self._open[request.request_id]

    def release(self, request: OpenRequest) -> None:
        """The request has ended for its caller: let go of everything P0 holds for it, once.

        Its store pins go first (an abort that raises leaks none), then a request P1 still runs is
        aborted there; its entry, output state and place in its rank's load go whatever happens."""
        if self._open.get(request.request_id) is not request:
            return
        try:
            self.transport.finish(request.request_id)
            if not request.finished:
                self.abort([request.request_id])
        finally:
            del self._open[request.request_id]
            request.output = request.resend = None
            if request.rank is not None:
                self.sender.land(request.rank)

    def put(self, result: RequestOutput) -> None:
        """Hand an output to its request's caller (dropped if the request is not open).

        A caller that has left its outputs unread past `stall_abort_s` has its request aborted
        (in P1 too) and ended with a `ClientError`, which it sees if it ever reads again."""
        request = self._open.get(result.request_id)
        if request is None:
            return
        request.shown(result)
        if result.finished and request.rank is not None:
            self.sender.count_served(request.rank, result)
        stalled = request.queue.stalled_s()
        if stalled <= self.stall_abort_s or result.finished:
            request.queue.put_nowait(result)
            return
        logger.warning("aborting request %s: its caller read none of its outputs for %.0f s "
                       "(--stalled-stream-abort-s)", result.request_id, stalled)
        self.abort([result.request_id])
        self.fail(result.request_id, ClientError(
            f"the request was aborted: its outputs went unread for {stalled:.0f} s", code="stream_stalled"))

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests: their output state goes, they can no longer start over, P1 is told.

        An id `request#index` (one completion of an n > 1 request, ended here by a stop string)
        is only sent on to P1: the request's other completions run on."""
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            if (request := self._open.get(rid)) is not None:
                request.output = request.resend = None
            elif (request := self._open.get(client_request_id(rid))) is None:
                continue
            if request.rank is not None:
                by_rank.setdefault(request.rank, []).append(rid)
        self.sender.abort(by_rank)

    def fail(self, request_id: str, error: Exception) -> None:
        """End one request with `error`: its output state goes and it can no longer start over."""
        if (request := self._open.get(request_id)) is not None:
            request.output = request.resend = None
            request.queue.put_nowait(error)

    def fail_all(self, message: str) -> None:
        """P0 is dead: every open request ends with `EngineDeadError(message)`."""
        self.dead_error = message
        logger.error("engine core is dead: %s", message)
        for request in self._open.values():
            request.queue.put_nowait(EngineDeadError(message))
            request.output = None

    def orphans(self, rank: int) -> tuple[list[str], list[str]]:
        """Rank `rank` died: (requests on it that can start over elsewhere, requests that are lost).

        Both leave the rank's load."""
        movable: list[str] = []
        lost: list[str] = []
        for rid, request in self._open.items():
            if request.rank == rank:
                (movable if request.resend is not None else lost).append(rid)
        self.sender.orphaned(rank)
        return movable, lost


class OutputStates(MutableMapping[str, RequestState]):
    """The open requests' output states, as the output processor's table: each one lives on its request."""

    def __init__(self, requests: dict[str, OpenRequest]) -> None:
        self._requests = requests

    def __getitem__(self, request_id: str) -> RequestState:
        request = self._requests.get(request_id)
        if request is None or request.output is None:
            raise KeyError(request_id)
        return request.output

    def __setitem__(self, request_id: str, state: RequestState) -> None:
        self._requests[request_id].output = state  # KeyError: a request is opened before its output state

    def __delitem__(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None or request.output is None:
            raise KeyError(request_id)
        request.output = None

    def __iter__(self) -> Iterator[str]:
        return iter([rid for rid, request in self._requests.items() if request.output is not None])

    def __len__(self) -> int:
        return sum(request.output is not None for request in self._requests.values())
