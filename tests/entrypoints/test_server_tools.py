"""Tool calling through the real server with the official client (issue 21), on a tiny Qwen3-VL
checkpoint with random weights: forced calls (named, required) are valid for their schemas
whatever the weights, whole and streamed; "none" answers text; tool turns and the developer role
are accepted; "auto" reads the family's hermes calls without flags; bad tool requests are 400s
with OpenAI's error body."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from helpers.server_process import ServerProcess, data_url
from helpers.tiny_models import make_image, make_qwen_checkpoint

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

CLICK = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 1920},
                                          "y": {"type": "integer", "minimum": 0, "maximum": 1080},
                                          "button": {"type": "string", "enum": ["left", "right"]}},
         "required": ["x", "y", "button"], "additionalProperties": False}
TYPE = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 12}}, "required": ["text"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "click", "parameters": CLICK}},
         {"type": "function", "function": {"name": "type_text", "parameters": TYPE}}]
SCHEMAS = {"click": CLICK, "type_text": TYPE}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_qwen_checkpoint(tmp_path_factory.mktemp("tools-server"))
    s = ServerProcess(path, "--served-model-name", "m", "--max-model-len", "1024")
    yield s
    s.stop()


def turn(text: str = "Click the OK button.") -> list[dict]:
    return [{"role": "developer", "content": "You operate a computer through tools."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(make_image(5, (64, 48)))}},
                                         {"type": "text", "text": text}]}]


def ask(client, choice, **extra):
    extra = {"messages": turn(), "max_tokens": 120, "temperature": 0.0, **extra}
    return client.chat.completions.create(model="m", tools=TOOLS, tool_choice=choice, **extra)


def valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_named_call_is_valid_whole_and_streamed(client):
    named = {"type": "function", "function": {"name": "click"}}
    whole = ask(client, named).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "click" and call.id.startswith("call_")
    valid("click", call.function.arguments)
    chunks = list(ask(client, named, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "click" and {d.index for d in deltas} == {0}
    streamed = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(streamed) == json.loads(call.function.arguments)  # greedy: the same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_required_gives_one_valid_call_per_answer_without_parallel_calls(client, stream):
    r = ask(client, "required", parallel_tool_calls=False, stream=stream)
    if stream:
        chunks = list(r)
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    else:
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
    assert len(calls) == 1 and calls[0].function.name in SCHEMAS
    valid(calls[0].function.name, calls[0].function.arguments)


def test_none_answers_text_and_a_follow_up_turn_with_the_tool_result_answers(client):
    r = ask(client, "none", max_tokens=6)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    call = ask(client, {"type": "function", "function": {"name": "click"}}).choices[0].message.tool_calls[0]
    follow = turn() + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": "clicked; a dialog opened"}]
    r = ask(client, "none", messages=follow, max_tokens=6)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 0


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "scroll"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, None),  # refused by the grammar compiler, reported by the engine
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [], "tool_choice": "none"}, "tools"),
    ({"tool_choice": "required", "extra_body": {"guided_choice": ["a", "b"]}}, "guided_choice"),
])
def test_bad_tool_requests_are_400s(client, extra, param):
    body = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=turn(), max_tokens=4, **body)
    assert e.value.body["param"] == param and e.value.body["message"]


def test_a_tool_turn_without_its_call_and_choice_without_tools_are_400s(client):
    orphan = turn() + [{"role": "tool", "tool_call_id": "call_nope", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model="m", messages=orphan, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model="m", messages=turn(), max_tokens=4, tool_choice="required")


def test_auto_reads_the_familys_hermes_calls_without_flags(server, client):
    """tools with no tool_choice (what agent frameworks send) on a server started without parser
    flags: Qwen's known format (hermes) is used, and the start-up log says so."""
    r = client.chat.completions.create(model="m", messages=turn(), tools=TOOLS, max_tokens=8, temperature=0.0)
    message = r.choices[0].message  # random weights: text, parsed for calls (none here)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert (message.content or "") + "".join(c.function.name for c in message.tool_calls or [])
    assert 'tool_choice "auto" reads hermes tool calls' in server.output()
