"""`POST /v1/chat/completions`: check the request, build the prompt, run it, answer whole or streamed.

A request's engine generator is always closed when the request ends, which aborts it in the
engine core if it was still running: a client that disconnects (before or during the stream)
frees its KV blocks (`streaming.py`). Errors raised before the first output are HTTP errors
(4xx / 503); once a stream has started they are sent as an SSE `error` event followed by `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncGenerator, Awaitable, Callable

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mmserve.cache_report import CacheReport, cache_headers
from mmserve.entrypoints.openai.choices import ChoiceDelta, ChoiceStream, chat_logprobs, completion_tokens, outcome_of
from mmserve.entrypoints.openai.errors import OpenAIError
from mmserve.entrypoints.openai.tool_calls import ChoiceTools, ToolMode, call_entry, finish_reason, tool_mode
from mmserve.entrypoints.openai.routing import routing
from mmserve.entrypoints.openai.streaming import SSEResponse
from mmserve.entrypoints.openai.protocol import (AssistantMessage, ChatCompletionChoice, ChatCompletionRequest,
                                                 ChatCompletionResponse, ChatCompletionStreamChoice,
                                                 ChatCompletionStreamResponse, DeltaMessage, ParameterError,
                                                 UsageInfo)
from mmserve.metrics import ServerMetrics
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mmserve.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

@dataclass
class RequestRecord:
    """One request's token counts and times (perf_counter seconds), counted once when it ends."""

    metrics: ServerMetrics
    arrival: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    report: CacheReport | None = None  # what each cache layer did for the prompt (`x-mmserve-cache`)
    first_token_time: float | None = None
    finished: bool = False

    def observe(self, out: RequestOutput) -> None:
        self.prompt_tokens = len(out.prompt_token_ids)
        self.generation_tokens = completion_tokens(out)
        self.cached_tokens = out.num_cached_tokens or 0
        self.report = out.cache_report or self.report
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


@dataclass
class ChatTurns:
    """A conversation as `OpenAIServingChat.start` takes it, from chat or from responses."""

    messages: list[dict[str, Any]]  # OpenAI chat messages
    tools: ToolMode | None
    tool_specs: list[dict[str, Any]] | None  # the tools in chat's shape, for the chat template
    cache_salt: str | None
    extras: dict[str, Any]  # prompt fields: mm_processor_kwargs, media_io_kwargs (None: absent)
    format_param: str = "response_format"  # the request's structure parameter, named when refused


class OpenAIServingChat:
    """The chat completions handler over an `AsyncLLM`-like engine."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], metrics: ServerMetrics,
                 auto_tool_parser: str | None = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.metrics = metrics
        self.auto_tool_parser = auto_tool_parser  # tool_choice "auto" enabled with this parser

    async def create_chat_completion(self, raw_request: Request) -> Response:
        return await self.recorded(self._create, raw_request)

    async def recorded(self, handler: Callable[[Request, RequestRecord], Awaitable[Response]],
                       raw_request: Request) -> Response:
        """Answer one request with `handler`; every exception is counted as an error (abort if
        cancelled) and re-raised."""
        record = RequestRecord(self.metrics, time.perf_counter())
        try:
            return await handler(raw_request, record)
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
        defaults = self.engine.generation_defaults  # the engine stops at max_model_len
        params = request.to_sampling_params(defaults.max_tokens(self.engine.max_model_len), defaults.request_defaults)
        tools = tool_mode(request.tools, request.tool_choice, request.parallel_tool_calls, self.auto_tool_parser)
        extras = {"mm_processor_kwargs": request.mm_processor_kwargs, "media_io_kwargs": request.media_io_kwargs}
        turns = ChatTurns(request.messages_as_dicts(), tools, request.tools, request.cache_salt, extras)
        outputs = await self.start(raw_request, request_id, turns, params, bool(request.stream))
        handed_over = False
        try:
            first = await first_output(outputs)
            record.observe(first)
            if request.stream:
                include_usage = request.stream_options is not None and request.stream_options.include_usage
                stream = ChatStream(request_id, model, outputs, first, record, include_usage, request.top_logprobs or 0,
                                    tools=tools)
                handed_over = True
                return SSEResponse(stream, cache_headers(record.report))
            return await _complete(request_id, model, outputs, first, record, request.top_logprobs or 0, tools)
        finally:
            if not handed_over:
                await outputs.aclose()

    async def start(self, raw_request: Request, request_id: str, turns: ChatTurns, params: SamplingParams,
                    stream: bool) -> AsyncGenerator[RequestOutput, None]:
        """Start a conversation's generation, as chat and responses both do: a forced tool call
        becomes the grammar (refused next to another structure), the chat template renders the
        messages with the tools, the prompt extras join the prompt. Returns the engine's outputs."""
        tools = turns.tools
        if tools is not None and tools.forced:
            if params.structured_outputs is not None:
                raise ParameterError(turns.format_param, f"{turns.format_param} cannot be combined with a forced "
                                     "tool call")
            params = msgspec.structs.replace(params, structured_outputs=tools.structured())
        prompt = await self.engine.build_prompt(turns.messages, turns.cache_salt, turns.tool_specs)
        prompt.update({k: v for k, v in turns.extras.items() if v is not None})
        return self.engine.generate(request_id, prompt, params, **routing(raw_request, stream))

    def check_model(self, name: str | None) -> str:
        """The model name to answer with; a 404 for a name this server does not serve."""
        if name is None:
            return self.served_model_names[0]
        if name not in self.served_model_names:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves "
                              f"{', '.join(map(repr, self.served_model_names))}", code="model_not_found",
                              param="model")
        return name


async def first_output(outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        raise RuntimeError("the engine ended a request without any output") from None


async def last_output(outputs: AsyncGenerator[RequestOutput, None], first: RequestOutput,
                      record: RequestRecord) -> RequestOutput:
    """Wait for the request's last output (observed in `record`, counted as its outcome)."""
    final = first
    async for out in outputs:
        record.observe(out)
        final = out
    record.finish(outcome_of(final))
    return final


async def _complete(request_id: str, model: str, outputs: AsyncGenerator[RequestOutput, None], first: RequestOutput,
                    record: RequestRecord, top_logprobs: int, tools: ToolMode | None = None) -> JSONResponse:
    """Wait for the last output and answer with the whole completion (one choice per `n`)."""
    final = await last_output(outputs, first, record)
    choices = []
    for c in final.outputs:
        content, calls = tools.extract(c.text) if tools is not None else (c.text, [])
        message = AssistantMessage(content=content, tool_calls=[call_entry(call) for call in calls] or None)
        choices.append(ChatCompletionChoice(
            index=c.index, message=message, finish_reason=finish_reason(c.finish_reason, bool(calls), tools),
            logprobs=None if c.logprobs is None else chat_logprobs(c.token_ids, c.logprobs, top_logprobs)))
    response = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=UsageInfo.of(
        record.prompt_tokens, record.generation_tokens, record.cached_tokens))
    body = response.model_dump()
    for choice in body["choices"]:  # "tool_calls" only when there are calls, as OpenAI answers
        if choice["message"]["tool_calls"] is None:
            del choice["message"]["tool_calls"]
    return JSONResponse(body, headers=cache_headers(record.report))



class ChatStream(ChoiceStream):
    """Chat chunks: the assistant role per choice first, then per choice and step its new text (and
    the new tokens' log probabilities when asked for), and a chunk with its finish reason."""

    def __init__(self, *args: Any, tools: ToolMode | None = None) -> None:
        super().__init__(*args)
        self.tools = tools
        self._tool_streams: dict[int, ChoiceTools] = {}  # choice index -> its tool-call parsing

    def _open(self) -> list[str]:
        return [self._chunk(DeltaMessage(role="assistant", content=""), index=c.index) for c in self.first.outputs]

    def _delta(self, d: ChoiceDelta) -> list[str]:
        if self.tools is not None:
            return self._tool_delta(d)
        events = []
        logprobs = None if not d.logprobs else chat_logprobs(d.token_ids, d.logprobs, self.top_logprobs)
        if d.text or logprobs:
            events.append(self._chunk(DeltaMessage(content=d.text), index=d.index, logprobs=logprobs))
        if d.finish_reason is not None:
            events.append(self._chunk(DeltaMessage(), finish_reason=d.finish_reason, index=d.index))
        return events

    def _tool_delta(self, d: ChoiceDelta) -> list[str]:
        """The choice's text through its tool-call parsing: content, then calls as they complete."""
        assert self.tools is not None
        parsing = self._tool_streams.setdefault(d.index, self.tools.stream())
        step = parsing.feed(d.text)
        if d.finish_reason is not None:
            tail = parsing.finish()
            step.content, step.calls = step.content + tail.content, step.calls + tail.calls
        logprobs = None if not d.logprobs else chat_logprobs(d.token_ids, d.logprobs, self.top_logprobs)
        events = []
        if step.content or logprobs:
            events.append(self._chunk(DeltaMessage(content=step.content), index=d.index, logprobs=logprobs))
        if step.calls:
            events.append(self._chunk(DeltaMessage(tool_calls=step.calls), index=d.index))
        if d.finish_reason is not None:
            reason = finish_reason(d.finish_reason, parsing.num_calls > 0, self.tools)
            events.append(self._chunk(DeltaMessage(), finish_reason=reason, index=d.index))
        return events

    def _chunk(self, delta: DeltaMessage, finish_reason: str | None = None, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> str:
        chunk = ChatCompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model,
            choices=[ChatCompletionStreamChoice(index=index, delta=delta, finish_reason=finish_reason,
                                                logprobs=logprobs)])
        return self._encode(chunk, delta)

    def _usage(self, usage: UsageInfo) -> str:
        chunk = ChatCompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                             choices=[], usage=usage)
        return f"data: {chunk.model_dump_json()}\n\n"

    def _encode(self, chunk: ChatCompletionStreamResponse, delta: DeltaMessage) -> str:
        body: dict[str, Any] = chunk.model_dump()
        body["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        if not self.include_usage:
            del body["usage"]
        return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
