"""Tool-call parsers for `tool_choice: "auto"` (`--tool-call-parser NAME`): each one turns a model's
free text into OpenAI tool calls, whole (`extract`) or while it streams (`stream()`).

A parser is one module that subclasses `ToolParser` and is listed in `TOOL_PARSERS`; a new format
is one file. The contract every parser keeps (tests/entrypoints/test_tool_parsers.py checks it for
every registered parser):
- whatever the split of the text into deltas, the content and calls a stream yields equal what
  `extract` returns for the whole text;
- text that turns out to be part of a call is never yielded as content;
- a call whose JSON does not parse is left in the content, as text.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    """One call: `arguments` is the JSON text of the arguments object, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))


@dataclass
class Extracted:
    content: str | None  # None when the text held calls and nothing else
    calls: list[ToolCall]


@dataclass
class StreamDelta:
    """What one step of a stream adds: content text, and calls completed in it (each with its
    index among the answer's calls)."""

    content: str = ""
    calls: list[tuple[int, ToolCall]] = field(default_factory=list)


class ToolParser:
    name = ""

    def extract(self, text: str) -> Extracted:
        raise NotImplementedError

    def stream(self) -> ToolStream:
        raise NotImplementedError


class ToolStream:
    """Incremental parsing of one answer: `feed` each delta, then `finish` once."""

    def feed(self, delta: str) -> StreamDelta:
        raise NotImplementedError

    def finish(self) -> StreamDelta:
        raise NotImplementedError


def tool_parser(name: str) -> ToolParser:
    """The registered parser called `name`; ValueError naming the known ones otherwise."""
    from mmserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser

    parsers: dict[str, type[ToolParser]] = {cls.name: cls for cls in (HermesToolParser,)}
    if name not in parsers:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(parsers))}")
    return parsers[name]()


TOOL_PARSERS = ("hermes",)
