"""`POST /v1/responses`: OpenAI's Responses API over the chat path.

A request becomes chat messages (`protocol_responses.py`: the stored conversation of its
`previous_response_id`, its `instructions` as the system turn, its input items), then runs exactly as a
chat completion does (`OpenAIServingChat.start`: tool modes and forced-call grammars, the chat
template, every cache layer), and is answered as a response object (`responses_output.py`) or
as the Responses API's events (`responses_stream.py`). A finished response's conversation is kept
(`response_store.py`, scoped by the request's API key and `cache_salt`) unless the request says
`store: false`; kept before its last bytes are sent, so a follow-up that read them finds it.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mmserve.cache_report import cache_headers
from mmserve.entrypoints.openai.errors import OpenAIError
from mmserve.entrypoints.openai.protocol import UsageInfo
from mmserve.entrypoints.openai.protocol_responses import ResponsesRequest
from mmserve.entrypoints.openai.response_store import Conversation, KeptResponses, scope_of
from mmserve.entrypoints.openai.responses_output import ResponseShape, history_turn
from mmserve.entrypoints.openai.responses_stream import ResponsesStream
from mmserve.entrypoints.openai.serving_chat import (ChatTurns, OpenAIServingChat, RequestRecord, first_output,
                                                     last_output)
from mmserve.entrypoints.openai.streaming import SSEResponse
from mmserve.entrypoints.openai.tool_calls import tool_mode

logger = logging.getLogger(__name__)


class OpenAIServingResponses:
    """The responses handler: the chat handler's machinery plus the store of finished responses."""

    def __init__(self, chat: OpenAIServingChat, store: KeptResponses) -> None:
        self.chat = chat
        self.store = store

    async def create_response(self, raw_request: Request) -> Response:
        return await self.chat.recorded(self._create, raw_request)

    async def _create(self, raw_request: Request, record: RequestRecord) -> Response:
        request = ResponsesRequest.model_validate_json(await raw_request.body())
        model = self.chat.check_model(request.model)
        response_id = f"resp_{uuid.uuid4().hex}"
        if request.unknown_fields():
            logger.warning("request %s: ignoring unknown field(s): %s", response_id,
                           ", ".join(request.unknown_fields()))
        scope = scope_of(_bearer(raw_request), request.cache_salt)
        history = await self._history(scope, request.previous_response_id) + request.input_messages()
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        defaults = self.chat.engine.generation_defaults
        params = request.to_sampling_params(defaults.max_tokens(self.chat.engine.max_model_len),
                                            defaults.request_defaults)
        tool_specs = request.chat_tools()
        tools = tool_mode(tool_specs, request.chat_tool_choice(), request.parallel_tool_calls,
                          self.chat.auto_tool_parser)
        turns = ChatTurns(system + history, tools, tool_specs, request.cache_salt,
                          {"mm_processor_kwargs": request.mm_processor_kwargs}, format_param="text.format")
        outputs = await self.chat.start(raw_request, response_id, turns, params, bool(request.stream))
        shape = ResponseShape(response_id, model, request)

        async def keep(items: list[dict[str, Any]]) -> None:
            if request.store is not False:
                await self.store.put(scope, response_id, history + [history_turn(items)])

        handed_over = False
        try:
            first = await first_output(outputs)
            record.observe(first)
            if request.stream:
                stream = ResponsesStream(response_id, model, outputs, first, record, True, 0, shape=shape,
                                         tools=tools, on_done=keep)
                handed_over = True
                return SSEResponse(stream, cache_headers(record.report))
            final = await last_output(outputs, first, record)
        finally:
            if not handed_over:
                await outputs.aclose()
        choice = final.outputs[0]
        content, calls = tools.extract(choice.text) if tools is not None else (choice.text, [])
        usage = UsageInfo.of(record.prompt_tokens, record.generation_tokens, record.cached_tokens)
        body, items = shape.whole(content, calls, usage, choice.finish_reason)
        await keep(items)
        return JSONResponse(body, headers=cache_headers(record.report))

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
