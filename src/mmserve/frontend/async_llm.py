"""P0's asyncio engine for the server: requests go to the engine-core process (P1) over ZMQ,
outputs come back on one background task and are routed to each request's queue.

Input processing (media decoding, the HF image processor, tokenizing) runs in worker threads
so the event loop keeps serving while images are processed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from mmserve.config import EngineConfig
from mmserve.frontend.chat import parse_chat_messages
from mmserve.frontend.core_client import EngineCoreClient, EngineDeadError
from mmserve.frontend.input_processor import InputProcessor
from mmserve.frontend.llm_engine import eos_token_id
from mmserve.frontend.output_processor import OutputProcessor
from mmserve.ipc.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from mmserve.models.builtin import resolve_model
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Starts P1 on construction (blocking until it is ready; RuntimeError if it cannot start)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model(config.model.model)
        self.client = EngineCoreClient(config, self.model_dir)
        self.max_model_len = self.client.max_model_len
        self.input_processor = InputProcessor(config, self.model_dir, self.max_model_len, eos_token_id(self.model_dir))
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
        return self._stats

    async def build_prompt(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """OpenAI messages -> a prompt dict with its images loaded (ValueError for bad input)."""
        return await asyncio.to_thread(self._build_prompt, messages)

    def _build_prompt(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        conversation, images = parse_chat_messages(messages, self.input_processor.media_limits)
        text = self.input_processor.processor.apply_chat_template(conversation)
        return {"prompt": text, "multi_modal_data": {"image": images}}

    async def generate(self, request_id: str, prompt: str | dict[str, Any],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every engine step until it finishes.

        Bad input raises ValueError before anything is sent to P1. Leaving the loop early
        (client gone, task cancelled) aborts the request in P1, which frees its blocks.
        """
        self._ensure_output_task()
        if not self.is_healthy:
            raise EngineDeadError(self._dead_error or "the engine core process is not running")
        request = await asyncio.to_thread(self.input_processor.process, request_id, prompt, params)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(request, prompt if isinstance(prompt, str) else prompt.get("prompt"))
        self.client.add_request(request)
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

    async def abort(self, request_id: str) -> None:
        self._abort_now([request_id])

    def _abort_now(self, request_ids: list[str]) -> None:
        self.output_processor.abort_requests(request_ids)
        if self.is_healthy:
            self.client.abort_requests(request_ids)

    # ---- the output loop --------------------------------------------------------------------

    def _ensure_output_task(self) -> None:
        if self._output_task is None or self._output_task.done():
            self._output_task = asyncio.get_running_loop().create_task(self._output_loop())

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
        ok: list[EngineCoreOutput] = []
        for out in batch.outputs:
            if out.error is None:
                ok.append(out)
                continue
            self.output_processor.abort_requests([out.request_id])
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(ValueError(out.error))
        processed = self.output_processor.process_outputs(ok)
        if processed.to_abort:
            self.client.abort_requests(processed.to_abort)
        for out in processed.outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail_all(self, message: str) -> None:
        self._dead_error = message
        logger.error("engine core is dead: %s", message)
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(message))
        self.output_processor.abort_requests(list(self._queues))

    def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        self.client.shutdown()
