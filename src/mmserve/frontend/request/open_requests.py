"""The requests P0 has open: each one's output queue, and how it ends in an error.

`AsyncLLM` owns one `OpenRequests`; admission, failover and the output loop share it (passed to
each at construction). A request's queue exists from admission until its caller's generator ends;
an error put on it ends the request for its caller. `fail_all` marks the whole frontend dead.
A queue holds at most one output (unread ones merge, `output_queue.py`); a request whose caller
has read nothing for `--stalled-stream-abort-s` while outputs keep coming is aborted (`put`).
"""

from __future__ import annotations

import logging

from mmserve.errors import ClientError
from mmserve.frontend.engine_client.core_client import EngineDeadError
from mmserve.frontend.dp.flights import RequestFlights
from mmserve.frontend.output.output_processor import OutputProcessor
from mmserve.frontend.request.output_queue import OutputQueue
from mmserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

DEFAULT_STALL_ABORT_S = 60.0  # --stalled-stream-abort-s


class OpenRequests:
    """Request id -> output queue; failing one request, or all of them once P0 is dead."""

    def __init__(self, output_processor: OutputProcessor, flights: RequestFlights,
                 stall_abort_s: float = DEFAULT_STALL_ABORT_S) -> None:
        self.output_processor = output_processor
        self.flights = flights
        self.stall_abort_s = stall_abort_s
        self.queues: dict[str, OutputQueue] = {}
        self.dead_error: str | None = None  # why no rank serves and none can come back

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.queues

    def __len__(self) -> int:
        return len(self.queues)

    def open(self, request_id: str) -> OutputQueue:
        """A new request's queue (ClientError if its id is in use)."""
        if request_id in self.queues:
            raise ClientError(f"request id {request_id!r} is already in use")
        queue = OutputQueue()
        self.queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    def put(self, result: RequestOutput) -> None:
        """Hand an output to its request's caller (dropped if the caller is gone).

        A caller that has left its outputs unread past `stall_abort_s` has its request aborted
        (in P1 too) and ended with a `ClientError`, which it sees if it ever reads again."""
        queue = self.queues.get(result.request_id)
        if queue is None:
            return
        stalled = queue.stalled_s()
        if stalled <= self.stall_abort_s or result.finished:
            queue.put_nowait(result)
            return
        logger.warning("aborting request %s: its caller read none of its outputs for %.0f s "
                       "(--stalled-stream-abort-s)", result.request_id, stalled)
        self.flights.abort([result.request_id])
        self.fail(result.request_id, ClientError(
            f"the request was aborted: its outputs went unread for {stalled:.0f} s", code="stream_stalled"))

    def fail(self, request_id: str, error: Exception) -> None:
        """End one request with `error`: its output state goes and it can no longer start over."""
        self.output_processor.abort_requests([request_id])
        self.flights.stay(request_id)
        queue = self.queues.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def fail_all(self, message: str) -> None:
        """P0 is dead: every open request ends with `EngineDeadError(message)`."""
        self.dead_error = message
        logger.error("engine core is dead: %s", message)
        for queue in self.queues.values():
            queue.put_nowait(EngineDeadError(message))
        self.output_processor.abort_requests(list(self.queues))
