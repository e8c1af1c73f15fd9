"""`tools` and `tool_choice` on chat completions, as OpenAI defines them (vLLM's flags for "auto").

- `"none"`: the tools are rendered into the prompt (as the chat template does); the answer is text.
- a named function, or `"required"`: the output is constrained by the structured-output grammar —
  the named function's arguments object, or a JSON array of `{"name", "arguments"}` calls (one at
  most when `parallel_tool_calls` is false) — so the calls are valid for their schemas whatever
  the weights; the finish reason is `"tool_calls"`.
- `"auto"` (the default when tools are given; the parser is `--tool-call-parser NAME`, else the
  model family's known one, `deployment_defaults.py`): the model answers freely and the parser
  (tool_parsers/) extracts calls; text that turns out to be a call is never streamed as content.

`ToolMode.extract` answers a whole choice; `ToolMode.stream()` gives each streamed choice its
`ChoiceTools`, which turns the choice's text deltas into content and tool-call deltas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mmserve.entrypoints.openai.protocol import ParameterError
from mmserve.entrypoints.openai.tool_parsers import ToolCall, ToolParser, ToolStream, tool_parser
from mmserve.frontend.request.chat import check_tools
from mmserve.structured_outputs import StructuredOutputsParams


@dataclass
class ToolMode:
    kind: str  # "none" | "auto" | "named" | "required"
    tools: list[dict[str, Any]]
    name: str | None = None  # the named function
    parser: ToolParser | None = None  # "auto"
    parallel: bool = True

    def structured(self) -> StructuredOutputsParams | None:
        """The grammar a named or required call is held to (None for "none" / "auto")."""
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.kind == "named":
            schema: dict[str, Any] = params[self.name or ""]
        elif self.kind == "required":
            calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "arguments": p},
                      "required": ["name", "arguments"], "additionalProperties": False} for name, p in params.items()]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
        else:
            return None
        try:
            return StructuredOutputsParams.for_schema(schema)
        except ValueError as e:
            raise ParameterError("tools", f"a tool's parameters cannot be enforced: {e}") from None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole choice's text."""
        if self.kind == "named":
            return None, [ToolCall(self.name or "", compact_arguments(text))]
        if self.kind == "required":
            return None, _forced_calls(text)
        if self.kind == "auto" and self.parser is not None:
            found = self.parser.extract(text)
            return found.content, found.calls
        return text, []

    def stream(self) -> ChoiceTools:
        return ChoiceTools(self)

    @property
    def forced(self) -> bool:
        return self.kind in ("named", "required")


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's streamed tool_calls entries


class ChoiceTools:
    """One streamed choice: a named call opens at once (id and name) and streams its arguments as
    they are generated; "required" calls come whole when the array closes; "auto" follows its
    parser's stream."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.num_calls = 0
        self._parser_stream: ToolStream | None = mode.parser.stream() if mode.kind == "auto" and mode.parser else None

    def feed(self, text: str) -> ToolDelta:
        self.text += text
        if self.mode.kind == "named":
            return self._named(text)
        if self.mode.kind == "required":
            return ToolDelta()
        if self._parser_stream is not None:
            step = self._parser_stream.feed(text)
            return ToolDelta(step.content, [self._entry(i, c) for i, c in step.calls])
        return ToolDelta(content=text)

    def finish(self) -> ToolDelta:
        if self.mode.kind == "required":
            return ToolDelta(calls=[self._entry(i, c) for i, c in enumerate(_forced_calls(self.text))])
        if self._parser_stream is not None:
            step = self._parser_stream.finish()
            return ToolDelta(step.content, [self._entry(i, c) for i, c in step.calls])
        return ToolDelta()

    def _named(self, text: str) -> ToolDelta:
        calls = []
        if self.num_calls == 0:
            call = ToolCall(self.mode.name or "", "")
            calls.append({"index": 0, "id": call.id, "type": "function",
                          "function": {"name": call.name, "arguments": ""}})
            self.num_calls = 1
        if text:
            calls.append({"index": 0, "function": {"arguments": text}})
        return ToolDelta(calls=calls)

    def _entry(self, index: int, call: ToolCall) -> dict[str, Any]:
        self.num_calls = max(self.num_calls, index + 1)
        return {"index": index, **call_entry(call)}


def tool_mode(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool | None,
              auto_parser: str | None) -> ToolMode | None:
    """The request's tool mode (None without tools); a `ParameterError` for a bad combination."""
    if tools is None:
        if choice not in (None, "none"):
            raise ParameterError("tool_choice", "tool_choice needs tools")
        return None
    try:
        tools = check_tools(tools)
    except ValueError as e:
        raise ParameterError("tools", str(e)) from None
    parallel = True if parallel is None else parallel
    choice = "auto" if choice is None else choice
    if choice in ("none", "required"):
        return ToolMode(choice, tools, parallel=parallel)
    if choice == "auto":
        if auto_parser is None:
            raise ParameterError("tool_choice", 'tool_choice "auto" (the default with tools) needs a tool-call '
                                 "format, and this model family has none known: start the server with "
                                 "--tool-call-parser NAME, or name a function, or use \"required\" or \"none\"")
        return ToolMode("auto", tools, parser=tool_parser(auto_parser), parallel=parallel)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or (isinstance(choice, dict) and choice.get("type") != "function"):
        raise ParameterError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}')
    if name not in {t["function"]["name"] for t in tools}:
        raise ParameterError("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return ToolMode("named", tools, name=name, parallel=parallel)


def call_entry(call: ToolCall) -> dict[str, Any]:
    """A call as OpenAI's `tool_calls` entries carry it."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def finish_reason(reason: str | None, called: bool, tools: ToolMode | None) -> str | None:
    """"tool_calls" when the answer called tools and was not cut short (OpenAI's meaning)."""
    return "tool_calls" if called and tools is not None and reason == "stop" else reason


def compact_arguments(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text  # cut short by max_tokens: the client sees what was generated


def _forced_calls(text: str) -> list[ToolCall]:
    try:
        calls = json.loads(text)
    except ValueError:
        return []  # cut short by max_tokens
    return [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls
            if isinstance(c, dict) and isinstance(c.get("name"), str)]
