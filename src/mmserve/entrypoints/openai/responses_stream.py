"""A streamed response: the Responses API's typed SSE events over chat's streaming machinery.

Order, as OpenAI sends it and its client assembles it: `response.created`, `response.in_progress`;
then per output item `response.output_item.added`, for a message `response.content_part.added`
and `response.output_text.delta`s, for a call `response.function_call_arguments.delta`s, for a
reasoning model's thinking (with a reasoning parser) `response.reasoning_text.delta`s; at the
end each open item's `...done` events (`response.reasoning_text.done`, `response.output_text.done`,
`response.content_part.done`, `response.function_call_arguments.done`, `response.output_item.done`)
and `response.completed` with the whole response and its usage. Every event carries `type` and a `sequence_number`. A
failure after the first event ends the stream with `response.failed`: the whole response so far,
its `status` "failed" and its `error` (`code`, `message`).
The tool-call parsing is chat's (`tool_calls.py: ChoiceTools`): text that turns out to be a call
is never streamed as text.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from mmserve.entrypoints.openai.choices import ChoiceDelta, ChoiceStream
from mmserve.entrypoints.openai.errors import to_openai_error
from mmserve.entrypoints.openai.protocol import UsageInfo
from mmserve.entrypoints.openai.reasoning import ReasoningSplitter, thinking_tokens
from mmserve.entrypoints.openai.responses_output import (ResponseShape, function_call_item, message_item,
                                                         new_item_id, reasoning_item)
from mmserve.entrypoints.openai.tool_calls import ChoiceTools, ToolMode, compact_arguments
from mmserve.entrypoints.openai.tool_parsers import ToolCall


class ResponsesStream(ChoiceStream):
    """One response's events; `on_done(items)` is awaited with its output items once it completes,
    before its last events are written (a follow-up that read them finds the response kept)."""

    def __init__(self, *args: Any, shape: ResponseShape, tools: ToolMode | None,
                 on_done: Callable[[list[dict[str, Any]]], Awaitable[None]], reasoning: bool = False,
                 thinking_end: int | None = None) -> None:
        super().__init__(*args)
        self.splitter = ReasoningSplitter(self.first.prompt or "") if reasoning else None
        self.thinking_end = thinking_end  # `</think>`'s id when one token: its thinking tokens are counted
        self.token_ids: list[int] = []  # the output's, while they may be thinking
        self.thinking: dict[str, Any] | None = None  # the reasoning item, once it opened
        self.thought = ""  # its text so far
        self.shape = shape
        self.on_done = on_done
        self.parsing: ChoiceTools | None = tools.stream() if tools is not None else None
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # output items in the order they opened
        self.text: str | None = None  # the message item's text, once it opened
        self.calls: dict[int, dict[str, Any]] = {}  # call index -> its function_call item
        self.finish_reason: str | None = None

    def _open(self) -> list[str]:
        return [self._event("response.created", response=self.shape.body("in_progress", [])),
                self._event("response.in_progress", response=self.shape.body("in_progress", []))]

    def _delta(self, d: ChoiceDelta) -> list[str]:
        events = self._thought(d) if self.splitter is not None else []
        content, calls = d.text, []
        if self.parsing is not None:
            step = self.parsing.feed(d.text)
            if d.finish_reason is not None:
                tail = self.parsing.finish()
                step.content, step.calls = step.content + tail.content, step.calls + tail.calls
            content, calls = step.content, step.calls
        events += self._text(content) if content else []
        for entry in calls:
            events += self._call(entry)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
        return events

    def _thought(self, d: ChoiceDelta) -> list[str]:
        """The delta's thinking as reasoning-text deltas (its item opened first); `d.text` keeps the answer's part."""
        assert self.splitter is not None
        if self.thinking_end is not None and self.thinking_end not in self.token_ids:
            self.token_ids += d.token_ids
        thinking, d.text = self.splitter.step(d.text, d.finish_reason is not None)
        events = []
        if self.thinking is None and self.splitter.reasoned:
            self.thinking = reasoning_item(new_item_id("rs"), None, "in_progress")
            self.items.append(self.thinking)
            events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                      item=self.thinking))
        if thinking and self.thinking is not None:
            self.thought += thinking
            events.append(self._event("response.reasoning_text.delta", **self._where(self.thinking), delta=thinking))
        return events

    def _text(self, text: str) -> list[str]:
        events = self._open_message() if self.text is None else []
        self.text = (self.text or "") + text
        return events + [self._event("response.output_text.delta", **self._where(self._message()), delta=text,
                                     logprobs=[])]

    def _open_message(self) -> list[str]:
        item = message_item(new_item_id("msg"), None, "in_progress")
        self.items.append(item)
        self.text = ""
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=item),
                self._event("response.content_part.added", **self._where(item), part=_part(""))]

    def _call(self, entry: dict[str, Any]) -> list[str]:
        """A chat tool-call delta: one with an id opens a call, the others add to its arguments."""
        events = []
        index, function = entry["index"], entry.get("function", {})
        if "id" in entry:
            item = function_call_item(new_item_id("fc"), ToolCall(function.get("name", ""), "", entry["id"]),
                                      "in_progress")
            self.calls[index] = item
            self.items.append(item)
            events.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        item = self.calls[index]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.items.index(item), delta=function["arguments"]))
        return events

    def _usage(self, usage: UsageInfo) -> str:
        """The end: every open item's done events, then `response.completed` (the whole response)."""
        answered = any(item["type"] != "reasoning" for item in self.items)
        events = [] if answered else self._open_message()  # an empty answer is an empty message, as whole
        for index, item in enumerate(self.items):
            if item["type"] == "reasoning":
                item.update(reasoning_item(item["id"], self.thought, "completed"))
                events.append(self._event("response.reasoning_text.done", **self._where(item), text=self.thought))
            elif item["type"] == "message":
                item["content"], item["status"] = [_part(self.text or "")], "completed"
                where = self._where(item)
                events += [self._event("response.output_text.done", **where, text=self.text or "", logprobs=[]),
                           self._event("response.content_part.done", **where, part=_part(self.text or ""))]
            else:
                item["arguments"] = compact_arguments(item["arguments"])
                item["status"] = "completed"
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=index, name=item["name"], arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        reasoned = self.splitter is not None and self.splitter.reasoned
        body = self.shape.body("completed", self.items, usage, self.finish_reason,
                               thinking_tokens(self.token_ids, reasoned, self.thinking_end))
        return "".join(events) + self._event("response.completed", response=body)

    async def _finished(self) -> None:
        await self.on_done(self.items)

    def _failed(self, exc: Exception) -> str:
        error = to_openai_error(exc)
        body = self.shape.body("in_progress", self.items)
        body.update(status="failed", error={"code": error.code or "server_error", "message": error.message})
        return self._event("response.failed", response=body)

    def _message(self) -> dict[str, Any]:
        return next(item for item in self.items if item["type"] == "message")

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> str:
        self.sequence += 1
        data = json.dumps({"type": kind, "sequence_number": self.sequence - 1, **fields}, ensure_ascii=False,
                          separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
