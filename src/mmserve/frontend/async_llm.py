"""P0's asyncio engine for the server: requests go to the engine-core process (P1) over ZMQ,
outputs come back on one background task and are routed to each request's queue.

Input processing (media decoding, the HF image processor, tokenizing) runs in worker threads
so the event loop keeps serving while images are processed. The IPC sender cache is updated on
the event loop, right before each send, so its updates happen in send order — the order P1
applies them in. Until P1 produces a request's first output, P0 keeps the request's processed
items: if P1 lacked an item it was sent by hash (drift), P0 starts a new IPC epoch and resends.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncGenerator

import msgspec

from mmserve.config import EngineConfig
from mmserve.frontend.chat import check_tools, parse_chat_messages
from mmserve.frontend.core_client import EngineCoreClient, EngineDeadError
from mmserve.frontend.input_processor import InputProcessor
from mmserve.frontend.item_transport import ItemTransport
from mmserve.models.hf_config import eos_token_id
from mmserve.frontend.output_processor import OutputProcessor
from mmserve.frontend.undo import UndoLog
from mmserve.ipc.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from mmserve.models.builtin import resolve_model
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Starts P1 on construction (blocking until it is ready; RuntimeError if it cannot start)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model(config.model.model)
        self.transport = ItemTransport(config.multimodal)
        try:
            self.client = EngineCoreClient(config, self.model_dir, shm_info=self.transport.shm_info)
        except BaseException:
            self.transport.close()
            raise
        self.max_model_len = self.client.max_model_len
        self.input_processor = InputProcessor(config, self.model_dir, self.max_model_len, eos_token_id(self.model_dir),
                                              known_tokens=self.transport.known_tokens)
        self._unadmitted: dict[str, EngineCoreRequest] = {}  # full requests until P1's first output
        self.tokenizer = self.input_processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self._queues: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._output_task: asyncio.Task[None] | None = None
        self._dead_error: str | None = None
        self._stats: SchedulerStats | None = None

    @property
    def is_healthy(self) -> bool:
        return self._dead_error is None and self.client.is_alive()

    @property
    def dead_error(self) -> str | None:
        return self._dead_error

    def stats(self) -> SchedulerStats | None:
        """P1's latest stats, with P0's cache layers (processor, ipc) merged in."""
        base = self._stats or SchedulerStats(0, 0, 0, 0, 0)
        caches = {**base.caches, "processor": self.input_processor.processor_cache.stats(),
                  **self.transport.stats()}
        return msgspec.structs.replace(base, caches=caches)

    async def build_prompt(self, messages: list[dict[str, Any]], cache_salt: str | None = None,
                           tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """OpenAI messages (and function `tools`, rendered by the template) -> a prompt dict naming
        its images (ValueError for bad input); the images are read, hashed and processed by
        `generate`, off the event loop."""
        inputs = parse_chat_messages(messages)
        tools = check_tools(tools) if tools is not None else None
        text = self.input_processor.processor.apply_chat_template(inputs.conversation, tools)
        return inputs.prompt(text, cache_salt)

    async def generate(self, request_id: str, prompt: str | dict[str, Any],
                       params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's output after every engine step until it finishes.

        Bad input raises ValueError before anything is sent to P1. Leaving the loop early
        (client gone, task cancelled) aborts the request in P1, which frees its blocks.
        """
        self._ensure_output_task()
        if not self.is_healthy:
            raise EngineDeadError(self._dead_error or "the engine core process is not running")
        queue = await self._admit(request_id, prompt, params)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort_now([request_id])
            self.transport.finish(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_now([request_id])

    async def _admit(self, request_id: str, prompt: str | dict[str, Any],
                     params: SamplingParams) -> asyncio.Queue[RequestOutput | Exception]:
        """Resolve the request (off the event loop), register it and send it to P1: the one place
        that owns the undo.

        The rule: from the moment P0 starts resolving a request until its message is on the
        wire to P1, every step that changes shared state registers how to take itself back in
        one `UndoLog` — processor-cache in-flight entries (`InputProcessor.reject`), the request's
        queue and output state, IPC sender keys (a checkpoint) or shm pins and fresh entries, the
        resend record. Any exception runs them all in reverse, so nothing of the request stays; a
        client fault is a ValueError (a 4xx), anything else is ours (a 5xx). A cancellation while
        the worker thread resolves (the client left) runs them once that thread has ended, since
        it goes on regardless. After the send nothing is undone here: P1 owns the request, and
        an abort goes through P1."""
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        undo = UndoLog()
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._queues[request_id] = queue  # reserves the id before anything else is done for it
        undo.push(self._queues.pop, request_id, None)
        undo.push(self.input_processor.reject, request_id)
        resolving = asyncio.ensure_future(
            asyncio.to_thread(self.input_processor.process, request_id, prompt, params, False))
        try:
            request = await asyncio.shield(resolving)
            self._register(request, prompt if isinstance(prompt, str) else prompt.get("prompt"), undo)
        except asyncio.CancelledError:
            resolving.add_done_callback(lambda done: _undo_after(done, undo))
            raise
        except BaseException:
            undo.run()
            raise
        self.input_processor.accept(request_id)
        return queue

    def _register(self, request: EngineCoreRequest, prompt_text: str | None, undo: UndoLog) -> None:
        """The request's output state, then the send; each step registered in `undo`."""
        self.output_processor.add_request(request, prompt_text)
        undo.push(self.output_processor.abort_requests, [request.request_id])
        self._send(request, undo)

    def _send(self, request: EngineCoreRequest, undo: UndoLog, resend: bool = False) -> None:
        """Send the request, its items through the transport (by hash or handle where P1 can
        have them); each change is registered in `undo` before the next step that can fail."""
        message, by_reference = self.transport.to_wire(request, undo, resend)
        if by_reference:  # P1 may lack one: keep the whole request until P1 answers
            self._unadmitted[request.request_id] = request
            undo.push(self._unadmitted.pop, request.request_id, None)
        self.client.add_request(message)

    def _resend(self, request_id: str, missing: list[str]) -> None:
        """P1 lacked items sent by hash: start a new IPC epoch (both sides empty) and send again."""
        request = self._unadmitted.get(request_id)
        if request is None or request_id not in self._queues:
            return  # aborted meanwhile
        logger.warning("P1 lacked %d item(s) of %s (IPC cache drift or a stale shm handle); resending",
                       len(missing), request_id)
        if any(item.data is None for item in request.mm_items):
            self._fail(request_id, ValueError("an image given by uuid alone is no longer cached: send the image "
                                              "again together with its uuid"))
            return
        undo = UndoLog()
        try:
            self._send(request, undo, resend=True)
        except Exception as e:
            undo.run()
            self._fail(request_id, e)

    def _abort_now(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._unadmitted.pop(rid, None)
        self.output_processor.abort_requests(request_ids)
        if self.is_healthy:
            self.client.abort_requests(request_ids)

    # ---- the output loop --------------------------------------------------------------------

    def _ensure_output_task(self) -> None:
        if self._output_task is None or self._output_task.done():
            loop = asyncio.get_running_loop()
            self._output_task = loop.create_task(self._output_loop())
            self._log_task = loop.create_task(self._log_stats_periodically())

    async def _log_stats_periodically(self, every_s: float = 10.0) -> None:
        """One INFO line every `every_s` seconds while anything happened: load and hit rates."""
        last = None
        while True:
            await asyncio.sleep(every_s)
            stats = self.stats()
            if stats is None or stats == last:
                continue
            last = stats
            rates = ", ".join(f"{layer} {c.hits / c.queries:.0%}" for layer, c in sorted(stats.caches.items())
                              if c.queries)
            logger.info("running %d, waiting %d, KV blocks free %d/%d; cache hit rates: %s", stats.num_running,
                        stats.num_waiting, stats.num_free_blocks, stats.num_total_blocks, rates or "no lookups")

    async def _output_loop(self) -> None:
        try:
            while True:
                self._dispatch(await self.client.get_output_async())
        except EngineDeadError as e:
            self._fail_all(str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("output loop failed")
            self._fail_all(f"the frontend's output loop failed: {e}")

    def _dispatch(self, batch: EngineCoreOutputs) -> None:
        if batch.stats is not None:
            self._stats = batch.stats
        for request_id, missing in batch.resend.items():
            self._resend(request_id, missing)
        ok: list[EngineCoreOutput] = []
        for out in batch.outputs:
            self._unadmitted.pop(out.request_id, None)
            if out.error is None:
                ok.append(out)
            else:
                self._fail(out.request_id, ValueError(out.error))
        processed = self.output_processor.process_outputs(ok)
        if processed.to_abort:
            self.client.abort_requests(processed.to_abort)
        for result in processed.outputs:
            queue = self._queues.get(result.request_id)
            if queue is not None:
                queue.put_nowait(result)

    def _fail(self, request_id: str, error: Exception) -> None:
        self.output_processor.abort_requests([request_id])
        self._unadmitted.pop(request_id, None)
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def _fail_all(self, message: str) -> None:
        self._dead_error = message
        logger.error("engine core is dead: %s", message)
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(message))
        self.output_processor.abort_requests(list(self._queues))

    def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
            self._log_task.cancel()
        self.client.shutdown()
        self.transport.close()


def _undo_after(resolving: asyncio.Future[Any], undo: UndoLog) -> None:
    """A cancelled request's resolution ended: take back what it did (its error, if any, is one
    the client no longer waits for)."""
    if not resolving.cancelled():
        resolving.exception()  # retrieved, so asyncio does not log it
    undo.run()
