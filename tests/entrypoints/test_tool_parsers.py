"""Tool-call parsers on recorded model outputs (Qwen2.5-VL / Qwen3-VL's hermes format), whole and
streamed in every split; the contract in entrypoints/openai/tool_parsers/__init__.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, Extracted, tool_parser

CLICK = '<tool_call>\n{"name": "click", "arguments": {"x": 120, "y": 48, "button": "left"}}\n</tool_call>'
TYPE = '<tool_call>\n{"name": "type_text", "arguments": {"text": "héllo <b>"}}\n</tool_call>'
RECORDED = {
    "one call": CLICK,
    "two calls": CLICK + "\n" + TYPE,
    "text then a call": "I will click the OK button.\n" + CLICK,
    "text around calls": "First this.\n" + CLICK + "\nThen that.\n" + TYPE + "\nDone.",
    "no call": "The screenshot shows a login form with two fields.",
    "malformed JSON": 'Trying: <tool_call>\n{"name": "click", "arguments": {"x": 1,}\n</tool_call> ok',
    "not a call object": "<tool_call>[1, 2]</tool_call>",
    "unterminated call": '<tool_call>\n{"name": "scroll", "arguments": {"dy": -3}}',
    "unterminated garbage": "see <tool_call>{\"name\": ",
    "partial tag text": "a <tool_ca b <tool_call",
    "string arguments": '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
}


def calls(extracted: Extracted) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in extracted.calls]


def test_recorded_outputs_whole():
    parse = tool_parser("hermes").extract
    assert calls(parse(RECORDED["one call"])) == [("click", {"x": 120, "y": 48, "button": "left"})]
    assert parse(RECORDED["one call"]).content is None
    two = parse(RECORDED["two calls"])
    assert [name for name, _ in calls(two)] == ["click", "type_text"] and two.content is None
    assert calls(two)[1][1] == {"text": "héllo <b>"}
    assert parse(RECORDED["text then a call"]).content == "I will click the OK button."
    around = parse(RECORDED["text around calls"])
    assert around.content == "First this.Then that.Done." and len(around.calls) == 2
    assert parse(RECORDED["no call"]) == Extracted(RECORDED["no call"], [])
    for kind in ("malformed JSON", "not a call object", "unterminated garbage", "partial tag text"):
        assert parse(RECORDED[kind]) == Extracted(RECORDED[kind], []), kind
    assert calls(parse(RECORDED["unterminated call"])) == [("scroll", {"dy": -3})]
    assert calls(parse(RECORDED["string arguments"])) == [("f", {"a": 1})]
    ids = [c.id for c in two.calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def stream_all(name: str, pieces: list[str]) -> tuple[str, list[tuple[int, str, str]]]:
    stream = tool_parser(name).stream()
    content, found = "", []
    for delta in [stream.feed(p) for p in pieces] + [stream.finish()]:
        content += delta.content
        found += [(i, c.name, c.arguments) for i, c in delta.calls]
    return content, found


@pytest.mark.parametrize("name", TOOL_PARSERS)
@pytest.mark.parametrize("kind", sorted(RECORDED))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_split_of_a_stream_equals_the_whole(name, kind, data):
    text = RECORDED[kind]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    whole = tool_parser(name).extract(text)
    content, found = stream_all(name, pieces)
    assert content == (whole.content or "")
    assert [(n, a) for _, n, a in found] == [(c.name, c.arguments) for c in whole.calls]
    assert [i for i, _, _ in found] == list(range(len(found)))


def test_text_of_a_call_is_never_streamed_as_content():
    pieces = list(RECORDED["text then a call"])  # one character at a time
    stream = tool_parser("hermes").stream()
    streamed = "".join(stream.feed(p).content for p in pieces) + stream.finish().content
    assert streamed == "I will click the OK button."  # no tag, no JSON, not even the newline before it


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("mistral-xml")
