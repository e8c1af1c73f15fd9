"""The hermes format, what Qwen2.5-VL and Qwen3-VL emit (vLLM's `hermes` parser):
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, any number of them, with text
before, between or after. A last call the model ended without its closing tag still counts when
its JSON parses."""

from __future__ import annotations

import json
from typing import Any

from mmserve.entrypoints.openai.tool_parsers import Extracted, StreamDelta, ToolCall, ToolParser, ToolStream

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse_call(body: str) -> ToolCall | None:
    """The call a tag's body holds, or None if it is not `{"name": str, "arguments": object}`."""
    try:
        obj: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models double-encode: keep it when it is an object's JSON
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class HermesToolParser(ToolParser):
    name = "hermes"

    def extract(self, text: str) -> Extracted:
        stream = HermesStream()
        first, last = stream.feed(text), stream.finish()
        content = first.content + last.content
        calls = [call for _, call in first.calls + last.calls]
        return Extracted(content or None, calls)

    def stream(self) -> HermesStream:
        return HermesStream()


class HermesStream(ToolStream):
    """Outside a call, content is yielded at once except for a tail that could be the start of
    `<tool_call>` or whitespace that may turn out to touch one (whitespace touching a call tag is
    not content); inside a call nothing is yielded until its closing tag: then the call (or, if
    its JSON does not parse, its text as content)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._num_calls = 0
        self._space = ""  # trailing whitespace held back
        self._after_call = False  # drop leading whitespace (it touches the call before it)
        self._held = ""  # the whitespace before an open call, given back if the call is not one

    def feed(self, delta: str) -> StreamDelta:
        self._buffer += delta
        out = StreamDelta()
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return out
                self._close_call(self._buffer[:end], True, out)
                self._buffer = self._buffer[end + len(CLOSE):]
            else:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = len(self._buffer) - _partial_tag_tail(self._buffer)
                    self._emit(self._buffer[:keep], out)
                    self._buffer = self._buffer[keep:]
                    return out
                self._emit(self._buffer[:start], out)
                self._buffer = self._buffer[start + len(OPEN):]
                self._held, self._space, self._in_call = self._space, "", True

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self._in_call:  # ended without its closing tag
            self._close_call(self._buffer, False, out)
        else:
            self._emit(self._buffer, out)
        if not self._num_calls:
            out.content += self._space
        self._buffer, self._space = "", ""
        return out

    def _emit(self, text: str, out: StreamDelta) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        body = text.rstrip()
        if body:
            out.content += self._space + body
            self._space = ""
        self._space += text[len(body):]

    def _close_call(self, body: str, closed: bool, out: StreamDelta) -> None:
        self._in_call = False
        call = parse_call(body)
        if call is None:  # left as text
            self._space = self._held
            self._emit(OPEN + body + (CLOSE if closed else ""), out)
            return
        out.calls.append((self._num_calls, call))
        self._num_calls += 1
        self._after_call = True


def _partial_tag_tail(text: str) -> int:
    """How many trailing characters of `text` could begin `<tool_call>` (0 if none)."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
