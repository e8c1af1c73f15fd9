"""P0's admission of a request: process it, register its output state, send it to P1, all or nothing.

The rule: from the moment P0 starts resolving a request until its message is on the wire to P1,
every step that changes shared state registers how to take itself back in one `UndoLog`. Any
exception runs them all in reverse, so nothing of the request stays; after the send nothing is
undone here: P1 owns the request, and what P0 holds for it is its `OpenRequest`'s, let go of in
one place (`OpenRequests.release`). Every request resolves in a
worker thread (fetch, decode, the HF processor, tokenizing): the event loop only routes, so
/health and the other requests' streams never wait behind one request's resolution.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from mmserve.errors import ClientError
from mmserve.frontend.engine_client.failover import RankFailover
from mmserve.frontend.engine_client.sender import RankSender
from mmserve.frontend.dp.dp_router import Route
from mmserve.frontend.input_processor import InputProcessor
from mmserve.frontend.request.open_request import OpenRequest
from mmserve.frontend.request.open_requests import OpenRequests
from mmserve.frontend.request.prompt import Prompt
from mmserve.frontend.output.output_processor import OutputProcessor
from mmserve.transport.undo import UndoLog
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Admission:
    """Admits requests into `requests` (and resends their items); `failover` says when a rank serves."""

    def __init__(self, input_processor: InputProcessor, output_processor: OutputProcessor, sender: RankSender,
                 requests: OpenRequests, failover: RankFailover) -> None:
        self.input_processor = input_processor
        self.output_processor = output_processor
        self.sender = sender
        self.requests = requests
        self.failover = failover

    async def admit(self, request_id: str, prompt: str | dict[str, Any] | Prompt, params: SamplingParams,
                    stream: bool, rank: int | None, shadow: bool = False,
                    candidate: bool = False, priority: int = 0, embed: bool = False) -> OpenRequest:
        """Resolve the request, register it and send it to P1: the one place that owns the undo.

        What registers itself in the `UndoLog`: the request's entry, its processor-cache
        in-flight items (`InputProcessor.reject`), its output state, IPC sender keys (a checkpoint)
        or shm pins and fresh entries. A client fault is a ValueError (a 4xx), anything else is
        ours (a 5xx). A cancellation while a worker thread resolves (the client left) runs the undo
        once that thread has ended, since it goes on regardless. A `shadow` request (the cache
        verifier's) has its items processed again; a `candidate` (and a shadow) asks P1 for the
        first token's logits row; `priority` orders it in P1 (`--scheduling-policy priority`); an
        `embed` request asks for its prompt's last hidden state."""
        prompt = Prompt.parse(prompt)  # a malformed prompt is refused before anything is done for it
        request = self.requests.open(OpenRequest(request_id, prompt, params, stream, candidate, priority,
                                                 embed=embed))  # the id
        undo = UndoLog()
        undo.push(self.requests.close, request)
        undo.push(self.input_processor.reject, request.pending)
        resolving: asyncio.Future[tuple[EngineCoreRequest, EngineCoreRequest | None]] | None = None
        try:
            resolving = asyncio.ensure_future(asyncio.to_thread(
                self._resolve, request, shadow, candidate or shadow, undo))
            processed, wire = await asyncio.shield(resolving)
            if rank is None and not self.failover.ranks.live():
                await self.failover.wait_for_live_rank()  # the rank died while the request was resolved
            picked = await self.sender.pick(processed, rank)  # a remote router's round trip, awaited
            self._register(request, processed, undo, rank, picked, wire)
        except asyncio.CancelledError:
            if resolving is None:
                undo.run()
            else:
                resolving.add_done_callback(lambda done: _undo_after(done, undo))
            raise
        except BaseException:
            undo.run()
            raise
        self.input_processor.accept(request.pending)
        return request

    def _resolve(self, request: OpenRequest, shadow: bool, first_logits: bool, undo: UndoLog,
                 ) -> tuple[EngineCoreRequest, EngineCoreRequest | None]:
        """In the worker thread: the processed request, and its message through the node's store
        where that store is another process's (`ItemTransport.prepare`; else None)."""
        processed = self.input_processor.process(request.request_id, request.prompt, request.params, request.pending,
                                                 shadow, request.report, request.priority)
        processed.return_first_logits = first_logits
        processed.return_hidden = request.embed
        return processed, self.sender.transport.prepare(processed, undo, request.report)

    def _register(self, request: OpenRequest, processed: EngineCoreRequest, undo: UndoLog, rank: int | None,
                  picked: Route | None, wire: EngineCoreRequest | None) -> None:
        """The request's output state, then its route and send; each step registered in `undo`."""
        self.output_processor.add_request(processed, request.prompt.shown_text, request.report)
        undo.push(self.output_processor.abort_requests, [request.request_id])
        request.rank = self.sender.send(processed, undo, request.report, rank, picked, wire)
        request.resend = processed

    def resend(self, request_id: str, missing: list[str]) -> None:
        """P1 lacked items sent by hash: start a new IPC epoch (both sides empty) and send again."""
        request = self.requests.get(request_id)
        if request is None or request.resend is None or request.rank is None:
            return  # aborted meanwhile
        logger.warning("P1 lacked %d item(s) of %s (IPC cache drift or a stale shm handle); resending",
                       len(missing), request_id)
        if any(item.data is None for item in request.resend.mm_items):
            self.requests.fail(request_id, ClientError("an image given by uuid alone is no longer cached: send the "
                                                      "image again together with its uuid"))
            return
        undo = UndoLog()
        try:
            self.sender.resend(request.rank, request.resend, undo, request.report)
        except Exception as e:
            undo.run()
            self.requests.fail(request_id, e)


def _undo_after(resolving: asyncio.Future[Any], undo: UndoLog) -> None:
    """A cancelled request's resolution ended: take back what it did (its error, if any, is one
    the client no longer waits for)."""
    if not resolving.cancelled():
        resolving.exception()  # retrieved, so asyncio does not log it
    undo.run()
