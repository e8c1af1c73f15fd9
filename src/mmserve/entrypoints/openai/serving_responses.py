"""`POST /v1/responses`: OpenAI's Responses API over the chat path.

A request becomes chat messages (`protocol_responses.py`: the stored conversation of its
`previous_response_id`, its `instructions` as the system turn, its input items), then runs exactly as a
chat completion does (`serving_base.py: OpenAIServing.start_chat`: tool modes and forced-call
grammars, the chat template, every cache layer), and is answered as a response object (`responses_output.py`) or
as the Responses API's events (`responses_stream.py`). A finished response's conversation is kept
(`response_store.py`, scoped by the request's API key and `cache_salt`) unless the request says
`store: false`; kept before its last bytes are sent, so a follow-up that read them finds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mmserve.cache_report import cache_headers
from mmserve.entrypoints.openai.choices import StreamUsage
from mmserve.entrypoints.openai.errors import OpenAIError
from mmserve.entrypoints.openai.protocol import UsageInfo
from mmserve.entrypoints.openai.protocol_responses import ResponsesRequest
from mmserve.entrypoints.openai.reasoning import ReasoningSplitter, thinking_tokens
from mmserve.entrypoints.openai.response_store import Conversation, KeptResponses, scope_of
from mmserve.entrypoints.openai.responses_output import ResponseShape, history_turn
from mmserve.entrypoints.openai.responses_stream import ResponsesStream
from mmserve.entrypoints.openai.serving_base import OpenAIServing, ServeContext, ServingOptions
from mmserve.entrypoints.openai.tool_calls import tool_mode
from mmserve.metrics import ServerMetrics
from mmserve.outputs import RequestOutput

if TYPE_CHECKING:
    from mmserve.frontend.async_llm import AsyncLLM


class OpenAIServingResponses(OpenAIServing):
    """The responses handler: the serving base plus the store of finished responses."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], metrics: ServerMetrics,
                 store: KeptResponses, options: ServingOptions | None = None) -> None:
        super().__init__(engine, served_model_names, metrics, options)
        self.store = store

    async def create_response(self, raw_request: Request) -> Response:
        return await self.serve(raw_request, ResponsesRequest, "resp_", self._create)

    async def _create(self, ctx: ServeContext[ResponsesRequest]) -> Response:
        request, response_id = ctx.request, ctx.request_id
        scope = scope_of(_bearer(ctx.raw_request), request.cache_salt)
        history = await self._history(scope, request.previous_response_id) + request.input_messages()
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        tool_specs = request.chat_tools()
        parser = self.options.auto_tool_parser
        tools = tool_mode(tool_specs, request.chat_tool_choice(), request.parallel_tool_calls, parser)
        outputs = await self.start_chat(ctx, system + history, tools, tool_specs, format_param="text.format")
        shape = ResponseShape(response_id, ctx.model, request)
        reasoning = self.splits_thinking(ctx, tools)
        tags = self.thinking_ids()
        thinking_end = None if tags is None else tags[1]

        async def keep(items: list[dict[str, Any]]) -> None:
            if request.store is not False:
                await self.store.put(scope, response_id, history + [history_turn(items)])

        def stream(first: RequestOutput) -> ResponsesStream:
            return ResponsesStream(response_id, ctx.model, outputs, first, ctx.record, StreamUsage(True), 0,
                                   shape=shape, tools=tools, on_done=keep, reasoning=reasoning,
                                   thinking_end=thinking_end)

        async def whole(final: RequestOutput) -> Response:
            choice = final.outputs[0]
            thinking, text = ReasoningSplitter(final.prompt or "").split(choice.text) if reasoning \
                else (None, choice.text)
            content, calls = tools.extract(text) if tools is not None else (text, [])
            record = ctx.record
            usage = UsageInfo.of(record.prompt_tokens, record.generation_tokens, record.cached_tokens)
            body, items = shape.whole(content, calls, usage, choice.finish_reason, thinking,
                                      thinking_tokens(choice.token_ids, thinking is not None, thinking_end))
            await keep(items)
            return JSONResponse(body, headers=cache_headers(record.report))

        return await self.respond(ctx, outputs, stream if request.stream else None, whole)

    async def _history(self, scope: str, previous_response_id: str | None) -> Conversation:
        if previous_response_id is None:
            return []
        history = await self.store.get(scope, previous_response_id)
        if history is None:
            raise OpenAIError(404, f"previous response {previous_response_id!r} not found: it was never kept "
                              "(store: false, or it did not finish), was kept under another API key or cache_salt, "
                              "or was evicted from the responses kept in memory (--responses-store-mb)",
                              code="previous_response_not_found", param="previous_response_id")
        return history


def _bearer(raw_request: Request) -> str | None:
    """The API key the request was sent with (the `Authorization: Bearer` token), if any."""
    header = raw_request.headers.get("authorization")
    if header is None or not header.lower().startswith("bearer "):
        return None
    return header[len("bearer "):].strip()
