"""Chat turns with tools (issue 21): the developer role, assistant tool calls and tool results
reach the chat template as transformers passes them, and bad turns are ValueErrors (a 400)."""

from __future__ import annotations

import json

import pytest

from mmserve import LLM, SamplingParams
from mmserve.frontend.request.chat import check_tools, parse_chat_messages
from mmserve.multimodal.processing import create_processor
from helpers.tiny_models import make_image, make_qwen_checkpoint

CLICK_PARAMETERS = {"type": "object", "properties": {"x": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "click", "description": "Click at a point.",
                                            "parameters": CLICK_PARAMETERS}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "click", "arguments": '{"x": 12}'}}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_qwen_checkpoint(tmp_path_factory.mktemp("tools"))


def agent_turns(image) -> list[dict]:
    return [{"role": "developer", "content": "You operate a computer."},
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Open it."}]},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "clicked"}]


def test_tools_and_tool_turns_render_as_the_template_defines(path):
    render = create_processor(path).apply_chat_template
    inputs = parse_chat_messages(agent_turns(make_image(0, (32, 32))))
    assert inputs.conversation[0] == {"role": "system", "content": "You operate a computer."}  # developer
    assert inputs.conversation[2]["tool_calls"][0]["function"]["arguments"] == {"x": 12}  # an object for tojson
    text = render(inputs.conversation, check_tools(TOOLS))
    assert text.startswith("<|im_start|>system\nYou operate a computer.\n\n# Tools")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert '<tool_call>\n{"name": "click", "arguments": {"x": 12}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nclicked\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n") and len(inputs.images) == 1
    plain = render(parse_chat_messages(agent_turns(make_image(0, (32, 32)))[:2]).conversation)
    assert "# Tools" not in plain and plain.startswith("<|im_start|>system\nYou operate a computer.<|im_end|>")


@pytest.mark.parametrize("turns, match", [
    ([{"role": "tool", "tool_call_id": "nope", "content": "x"}], "tool_call_id must name a tool call"),
    ([{"role": "assistant", "content": None}], "content must be a string"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}],
     "arguments is not valid JSON"),
    ([{"role": "critic", "content": "x"}], "role must be one of"),
])
def test_bad_turns_are_value_errors(turns, match):
    with pytest.raises(ValueError, match=match):
        parse_chat_messages(turns)


@pytest.mark.parametrize("tools, match", [
    ([], "non-empty list"), ([{"type": "function", "function": {}}], r"tools\[0\]"),
    ([{"type": "retrieval"}], r"tools\[0\]"), (TOOLS + TOOLS, "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "JSON schema object"),
])
def test_bad_tools_are_value_errors(tools, match):
    with pytest.raises(ValueError, match=match):
        check_tools(tools)


def test_offline_chat_with_tools_generates_from_the_rendered_turns(path):
    llm = LLM(model=path)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    image = make_image(1, (48, 48))
    with_tools = llm.chat(agent_turns(image), params, tools=TOOLS)[0]
    without = llm.chat(agent_turns(image)[:2], params)[0]
    assert len(with_tools.prompt_token_ids) > len(without.prompt_token_ids) + 40  # tools and turns in the prompt
    assert len(with_tools.outputs[0].token_ids) == 4
