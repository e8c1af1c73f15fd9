"""`POST /v1/chat/completions`: messages through the chat template, answered whole or streamed.

The request's path is the serving base's (`serving_base.py`: preamble, prompt, first output,
closing); here are chat's parts: `tools` / `tool_choice` as a `ToolMode`, the whole answer
(`ChatCompletionResponse`, one choice per `n`) and the stream's chunks (`ChatStream`).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mmserve.cache_report import cache_headers
from mmserve.entrypoints.openai.choices import (ChoiceDelta, ChoiceStream, StreamUsage, chat_logprobs,
                                                drop_unasked, prompt_logprobs_json)
from mmserve.entrypoints.openai.protocol import (AssistantMessage, ChatCompletionChoice, ChatCompletionRequest,
                                                 ChatCompletionResponse, ChatCompletionStreamChoice,
                                                 ChatCompletionStreamResponse, DeltaMessage, UsageInfo)
from mmserve.entrypoints.openai.reasoning import ReasoningSplitter
from mmserve.entrypoints.openai.request_record import RequestRecord
from mmserve.entrypoints.openai.serving_base import OpenAIServing, ServeContext
from mmserve.entrypoints.openai.tool_calls import ChoiceTools, ToolMode, call_entry, finish_reason, tool_mode
from mmserve.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    """The chat completions handler; with a reasoning parser, a reasoning model's thinking is the
    answer's `reasoning_content`, apart from its `content` (`reasoning.py`)."""

    async def create_chat_completion(self, raw_request: Request) -> Response:
        return await self.serve(raw_request, ChatCompletionRequest, "chatcmpl-", self._create)

    async def _create(self, ctx: ServeContext[ChatCompletionRequest]) -> Response:
        request = ctx.request
        options = self.options
        tools = tool_mode(request.tools, request.tool_choice, request.parallel_tool_calls, options.auto_tool_parser)
        template = request.template_options(options.chat_templates)
        outputs = await self.start_chat(ctx, request.messages_as_dicts(), tools, request.tools,
                                        request.structure_param() or "response_format", template)
        top = request.top_logprobs or 0
        usage = StreamUsage.of(request.stream_options, options.force_usage)
        as_ids = request.tokens_as_ids(options.tokens_as_ids)
        token_ids = bool(request.return_token_ids)

        echo = request.echoed()
        reasoning = self.splits_thinking(ctx, tools)

        def stream(first: RequestOutput) -> ChatStream:
            return ChatStream(ctx.request_id, ctx.model, outputs, first, ctx.record, usage, top, as_ids, tools=tools,
                              echo=echo, reasoning=reasoning, token_ids=token_ids)

        async def whole(final: RequestOutput) -> Response:
            return _whole(ctx.request_id, ctx.model, final, ctx.record, top, tools, echo, reasoning, as_ids, token_ids)

        return await self.respond(ctx, outputs, stream if request.stream else None, whole)


def _whole(request_id: str, model: str, final: RequestOutput, record: RequestRecord, top_logprobs: int,
           tools: ToolMode | None, echo: str = "", reasoning: bool = False, as_ids: bool = False,
           token_ids: bool = False) -> JSONResponse:
    """The whole completion (one choice per `n`), each choice's content after `echo`, its thinking
    apart when `reasoning`, its log probabilities' tokens named by id when `as_ids`; with
    `token_ids` the prompt's and each choice's token ids (vLLM's `return_token_ids`)."""
    choices = []
    for c in final.outputs:
        thinking, text = ReasoningSplitter(final.prompt or "").split(c.text) if reasoning else (None, c.text)
        content, calls = tools.extract(text) if tools is not None else (text, [])
        content = echo + (content or "") if echo else content
        message = AssistantMessage(content=content, reasoning_content=thinking,
                                   tool_calls=[call_entry(call) for call in calls] or None)
        choices.append(ChatCompletionChoice(
            index=c.index, message=message, finish_reason=finish_reason(c.finish_reason, bool(calls), tools),
            logprobs=None if c.logprobs is None else chat_logprobs(c.token_ids, c.logprobs, top_logprobs, as_ids),
            token_ids=list(c.token_ids) if token_ids else None))
    response = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=UsageInfo.of(
        record.prompt_tokens, record.generation_tokens, record.cached_tokens))
    if final.prompt_logprobs is not None:
        response.prompt_logprobs = prompt_logprobs_json(final.prompt_logprobs)
    if token_ids:
        response.prompt_token_ids = list(final.prompt_token_ids)
    body = drop_unasked(response.model_dump())
    for choice in body["choices"]:  # "tool_calls" only when there are calls, as OpenAI answers (so thinking)
        for key in ("tool_calls", "reasoning_content"):
            if choice["message"][key] is None:
                del choice["message"][key]
    return JSONResponse(body, headers=cache_headers(record.report))


class ChatStream(ChoiceStream):
    """Chat chunks: the assistant role per choice first (and the `echo`ed text), then per choice and
    step its new text (and the new tokens' log probabilities when asked for), and a chunk with its
    finish reason."""

    def __init__(self, *args: Any, tools: ToolMode | None = None, echo: str = "", reasoning: bool = False,
                 token_ids: bool = False) -> None:
        super().__init__(*args)
        self.tools = tools
        self.echo = echo
        self.reasoning = reasoning
        self.token_ids = token_ids  # vLLM's return_token_ids: the prompt's in the first chunk, then each chunk's
        self._unsent_ids: dict[int, list[int]] = {}  # choice index -> its tokens no chunk carried yet
        self._tool_streams: dict[int, ChoiceTools] = {}  # choice index -> its tool-call parsing
        self._splitters: dict[int, ReasoningSplitter] = {}  # choice index -> its thinking / answer split

    def _open(self) -> list[str]:
        events = []
        prompt_ids = list(self.first.prompt_token_ids) if self.token_ids else None
        for c in self.first.outputs:
            events.append(self._chunk(DeltaMessage(role="assistant", content=""), index=c.index, prompt_ids=prompt_ids))
            prompt_ids = None
            if self.echo:
                events.append(self._chunk(DeltaMessage(content=self.echo), index=c.index))
        return events

    def _delta(self, d: ChoiceDelta) -> list[str]:
        if self.token_ids:  # the delta's first chunk carries them (or a later one, if its text is held back)
            self._unsent_ids[d.index] = self._unsent_ids.get(d.index, []) + d.token_ids
        events = self._thinking(d) if self.reasoning else []
        if self.tools is not None:
            return events + self._tool_delta(d)
        logprobs = None if not d.logprobs else chat_logprobs(d.token_ids, d.logprobs, self.top_logprobs, self.as_ids)
        if d.text or logprobs:
            events.append(self._chunk(DeltaMessage(content=d.text), index=d.index, logprobs=logprobs))
        if d.finish_reason is not None:
            events.append(self._chunk(DeltaMessage(), finish_reason=d.finish_reason, index=d.index))
        return events

    def _thinking(self, d: ChoiceDelta) -> list[str]:
        """The delta's thinking as a `reasoning_content` chunk; `d.text` keeps the answer's part."""
        splitter = self._splitters.get(d.index)
        if splitter is None:
            splitter = self._splitters[d.index] = ReasoningSplitter(self.first.prompt or "")
        thinking, d.text = splitter.step(d.text, d.finish_reason is not None)
        return [self._chunk(DeltaMessage(reasoning_content=thinking), index=d.index)] if thinking else []

    def _tool_delta(self, d: ChoiceDelta) -> list[str]:
        """The choice's text through its tool-call parsing: content, then calls as they complete."""
        assert self.tools is not None
        parsing = self._tool_streams.setdefault(d.index, self.tools.stream())
        step = parsing.feed(d.text)
        if d.finish_reason is not None:
            tail = parsing.finish()
            step.content, step.calls = step.content + tail.content, step.calls + tail.calls
        logprobs = None if not d.logprobs else chat_logprobs(d.token_ids, d.logprobs, self.top_logprobs, self.as_ids)
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
               logprobs: dict[str, Any] | None = None, prompt_ids: list[int] | None = None) -> str:
        token_ids = self._unsent_ids.pop(index, None) if self.token_ids else None
        chunk = ChatCompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model, prompt_token_ids=prompt_ids,
            choices=[ChatCompletionStreamChoice(index=index, delta=delta, finish_reason=finish_reason,
                                                logprobs=logprobs, token_ids=token_ids)])
        return self._encode(chunk, delta)

    def _usage(self, usage: UsageInfo) -> str:
        chunk = ChatCompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                             choices=[], usage=usage)
        return f"data: {json.dumps(drop_unasked(chunk.model_dump()), ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _encode(self, chunk: ChatCompletionStreamResponse, delta: DeltaMessage) -> str:
        body = drop_unasked(self._with_usage(chunk.model_dump()))
        body["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
