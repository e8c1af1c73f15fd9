"""`POST /v1/chat/completions`: check the request, build the prompt, run it, answer whole or streamed.

A request's engine generator is always closed when the request ends, which aborts it in the
engine core if it was still running: a client that disconnects (before or during the stream)
frees its KV blocks. Errors raised before the first output are HTTP errors (4xx / 503); once a
stream has started they are sent as an SSE `error` event followed by `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mmserve.entrypoints.openai.errors import OpenAIError, to_openai_error
from mmserve.entrypoints.openai.protocol import (AssistantMessage, ChatCompletionChoice, ChatCompletionRequest,
                                                 ChatCompletionResponse, ChatCompletionStreamChoice,
                                                 ChatCompletionStreamResponse, DeltaMessage, UsageInfo)
from mmserve.metrics import ServerMetrics
from mmserve.outputs import RequestOutput

if TYPE_CHECKING:
    from mmserve.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"; nobody reads it


@dataclass
class RequestRecord:
    """One request's token counts and times (perf_counter seconds), counted once when it ends."""

    metrics: ServerMetrics
    arrival: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    first_token_time: float | None = None
    finished: bool = False

    def observe(self, out: RequestOutput) -> None:
        self.prompt_tokens = len(out.prompt_token_ids)
        self.generation_tokens = len(out.outputs[0].token_ids)
        self.cached_tokens = out.num_cached_tokens or 0
        if self.first_token_time is None and self.generation_tokens:
            self.first_token_time = time.perf_counter()

    def finish(self, outcome: str) -> None:
        """Count the request under `outcome`; later calls do nothing."""
        if self.finished:
            return
        self.finished = True
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival
        self.metrics.on_request_finished(outcome, self.prompt_tokens, self.generation_tokens, ttft,
                                         time.perf_counter() - self.arrival)


def outcome_of(out: RequestOutput) -> str:
    """`success` for a request finished by stop or length, else `abort`."""
    return "success" if out.finished and out.outputs[0].finish_reason in ("stop", "length") else "abort"


class OpenAIServingChat:
    """The chat completions handler over an `AsyncLLM`-like engine."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], metrics: ServerMetrics) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.metrics = metrics

    async def create_chat_completion(self, raw_request: Request) -> Response:
        """Answer one request; every exception is counted as an error (abort if cancelled) and re-raised."""
        record = RequestRecord(self.metrics, time.perf_counter())
        try:
            return await self._create(raw_request, record)
        except asyncio.CancelledError:
            record.finish("abort")
            raise
        except BaseException:
            record.finish("error")
            raise

    async def _create(self, raw_request: Request, record: RequestRecord) -> Response:
        request = ChatCompletionRequest.model_validate_json(await raw_request.body())
        model = self.check_model(request.model)
        request.check_supported()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if request.unknown_fields():
            logger.warning("request %s: ignoring unknown field(s): %s", request_id,
                           ", ".join(request.unknown_fields()))
        params = request.to_sampling_params(self.engine.max_model_len)  # the engine stops at max_model_len
        prompt = await self.engine.build_prompt(request.messages_as_dicts(), request.cache_salt)
        if request.mm_processor_kwargs is not None:
            prompt["mm_processor_kwargs"] = request.mm_processor_kwargs
        if request.media_io_kwargs is not None:
            prompt["media_io_kwargs"] = request.media_io_kwargs
        outputs = self.engine.generate(request_id, prompt, params)
        handed_over = False
        try:
            first = await _first_output(outputs)
            record.observe(first)
            if request.stream:
                include_usage = request.stream_options is not None and request.stream_options.include_usage
                stream = ChatStream(request_id, model, outputs, first, record, include_usage)
                handed_over = True
                return SSEResponse(stream)
            return await _complete(request_id, model, outputs, first, record)
        finally:
            if not handed_over:
                await outputs.aclose()

    def check_model(self, name: str | None) -> str:
        """The model name to answer with; a 404 for a name this server does not serve."""
        if name is None:
            return self.served_model_names[0]
        if name not in self.served_model_names:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves "
                              f"{', '.join(map(repr, self.served_model_names))}", code="model_not_found",
                              param="model")
        return name


async def _first_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        raise RuntimeError("the engine ended a request without any output") from None


async def _complete(request_id: str, model: str, outputs: AsyncIterator[RequestOutput], first: RequestOutput,
                    record: RequestRecord) -> JSONResponse:
    """Wait for the last output and answer with the whole completion."""
    final = first
    async for out in outputs:
        record.observe(out)
        final = out
    record.finish(outcome_of(final))
    completion = final.outputs[0]
    response = ChatCompletionResponse(
        id=request_id, model=model,
        choices=[ChatCompletionChoice(message=AssistantMessage(content=completion.text),
                                      finish_reason=completion.finish_reason)],
        usage=UsageInfo.of(record.prompt_tokens, record.generation_tokens, record.cached_tokens))
    return JSONResponse(response.model_dump())


class ChatStream:
    """The SSE events of one streamed completion, starting from its first engine output.

    Events: a chunk with the assistant role, one chunk per non-empty text delta, a chunk with the
    finish reason, a usage chunk (no choices) when asked for, then `data: [DONE]`.
    """

    def __init__(self, request_id: str, model: str, outputs: AsyncIterator[RequestOutput], first: RequestOutput,
                 record: RequestRecord, include_usage: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.outputs = outputs
        self.first = first
        self.record = record
        self.include_usage = include_usage
        self.created = int(time.time())

    async def events(self) -> AsyncIterator[str]:
        try:
            yield self._chunk(DeltaMessage(role="assistant", content=""))
            out = self.first
            while True:
                if out.outputs[0].delta_text:
                    yield self._chunk(DeltaMessage(content=out.outputs[0].delta_text))
                if out.finished:
                    break
                out = await anext(self.outputs)
                self.record.observe(out)
            yield self._chunk(DeltaMessage(), finish_reason=out.outputs[0].finish_reason)
            if self.include_usage:
                yield self._usage_chunk()
            self.record.finish(outcome_of(out))
        except Exception as exc:  # the status line is sent: report it in the stream
            self.record.finish("error")
            yield f"data: {to_openai_error(exc).body().model_dump_json()}\n\n"
        finally:
            await self.close()
        yield "data: [DONE]\n\n"

    async def close(self) -> None:
        """End the request: closing its engine generator aborts it if it is still running."""
        await self.outputs.aclose()
        self.record.finish("abort")

    def _chunk(self, delta: DeltaMessage, finish_reason: str | None = None) -> str:
        chunk = ChatCompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model,
            choices=[ChatCompletionStreamChoice(delta=delta, finish_reason=finish_reason)])
        return self._encode(chunk, delta)

    def _usage_chunk(self) -> str:
        usage = UsageInfo.of(self.record.prompt_tokens, self.record.generation_tokens, self.record.cached_tokens)
        chunk = ChatCompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                             choices=[], usage=usage)
        return f"data: {chunk.model_dump_json()}\n\n"

    def _encode(self, chunk: ChatCompletionStreamResponse, delta: DeltaMessage) -> str:
        body: dict[str, Any] = chunk.model_dump()
        body["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        if not self.include_usage:
            del body["usage"]
        return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that ends its request however the stream stops.

    Starlette cancels the stream when the client disconnects, possibly before it started: closing
    here makes sure the engine generator is closed (and the request aborted) in every case.
    """

    def __init__(self, stream: ChatStream) -> None:
        super().__init__(stream.events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.stream.close()


async def cancel_on_disconnect(handler: Awaitable[Response], raw_request: Request) -> Response:
    """Run `handler`; if the client disconnects first, cancel it (which aborts its engine request).

    The body is read first: after it, the only message `receive()` can bring is the disconnect.
    A body that cannot be read (too large, the client gone) raises before `handler` starts.
    """
    try:
        await raw_request.body()
    except BaseException:
        if asyncio.iscoroutine(handler):
            handler.close()  # never started: close it, so no "never awaited" warning
        raise
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass
