"""The Responses API's output objects: output items, the response body and its usage.

A response's `output` holds, in the order they were opened, a reasoning model's `reasoning` item
(its thinking as one `reasoning_text` part, with a reasoning parser), at most one `message` item
(the answer's text as one `output_text` part) and one `function_call` item per tool call. Usage is
chat's `UsageInfo` (made once, by `UsageInfo.of`) renamed: `prompt_tokens_details` becomes
`input_tokens_details` whole, so a field added there shows on both APIs.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mmserve.entrypoints.openai.protocol import UsageInfo
from mmserve.entrypoints.openai.protocol_responses import ResponsesRequest
from mmserve.entrypoints.openai.tool_parsers import ToolCall


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message item; `text` None while it has no content part yet."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A reasoning item (vLLM's shape: the thinking as `content`, no summary); `text` None while empty."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def function_call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def responses_usage(usage: UsageInfo, reasoning_tokens: int = 0) -> dict[str, Any]:
    """Chat's usage in the Responses API's names (`input_tokens_details.cached_tokens`, ...), with
    the output's `reasoning_tokens` (`reasoning.py: thinking_tokens`)."""
    details = usage.prompt_tokens_details.model_dump() if usage.prompt_tokens_details else {"cached_tokens": 0}
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": details,
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.total_tokens}


def history_turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the chat message a later turn replays (previous_response_id)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    thinking = [part["text"] for item in items if item["type"] == "reasoning" for part in item["content"]]
    if thinking:
        turn["reasoning_content"] = "".join(thinking)
    return turn


@dataclass
class ResponseShape:
    """What every body of one response repeats: its id, model, creation time and the request's
    settings (`instructions`, `tools`, `text`, ...), as OpenAI echoes them."""

    response_id: str
    model: str
    request: ResponsesRequest
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict[str, Any]], usage: UsageInfo | None = None,
             finish_reason: str | None = None, reasoning_tokens: int = 0) -> dict[str, Any]:
        """The response object: `status` "in_progress", or "completed" / "incomplete" by `finish_reason`."""
        r = self.request
        if status != "in_progress":
            status = "incomplete" if finish_reason == "length" else "completed"
        text_format = r.text.format.echo() if r.text is not None and r.text.format is not None else {"type": "text"}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "tools": r.tools or [], "tool_choice": "auto" if r.tool_choice is None else r.tool_choice,
            "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id, "text": {"format": text_format},
            "metadata": r.metadata or {}, "store": r.store is not False, "truncation": "disabled",
            "reasoning": None, "user": r.user,
            "usage": None if usage is None else responses_usage(usage, reasoning_tokens),
        }

    def whole(self, content: str | None, calls: list[ToolCall], usage: UsageInfo, finish_reason: str | None,
              thinking: str | None = None, reasoning_tokens: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """A finished answer's body and its output items (its `thinking` first, when it thought)."""
        items = [] if thinking is None else [reasoning_item(new_item_id("rs"), thinking, "completed")]
        if content or not calls:
            items.append(message_item(new_item_id("msg"), content or "", "completed"))
        items += [function_call_item(new_item_id("fc"), call, "completed") for call in calls]
        return self.body("completed", items, usage, finish_reason, reasoning_tokens), items
