"""A reasoning model's thinking apart from its answer (entrypoints/openai/reasoning.py): the
splitter's rule on every shape of output, cut anywhere across deltas, and chat's
`reasoning_content` whole and streamed over the HTTP layer (a fake engine scripting the text)."""

from __future__ import annotations

import json
import random

import pytest
from fastapi.testclient import TestClient

from helpers.fake_engine import MODEL, FakeEngine, post
from mmserve.entrypoints.openai.app import build_app
from mmserve.entrypoints.openai.reasoning import ReasoningSplitter
from mmserve.entrypoints.openai.serving_base import ServingOptions

OPENED = "<|im_start|>assistant\n<think>\n"  # a Thinking model's template opens the block
PLAIN = "<|im_start|>assistant\n"
CASES = [
    (OPENED, "plan it</think>\n\nThe answer.", ("plan it", "The answer.")),
    (PLAIN, "<think>plan</think>\n\nAns", ("plan", "Ans")),  # the model opens it
    (PLAIN, "  <think>plan</think>Ans", ("plan", "Ans")),
    (PLAIN + "<think>\n\n</think>\n\n", "Just answer", (None, "Just answer")),  # thinking switched off
    (PLAIN, "Just answer <think>x</think>", (None, "Just answer <think>x</think>")),
    (OPENED, "cut off in thou", ("cut off in thou", "")),  # max_tokens inside the thinking
    (OPENED, "cut </thi", ("cut </thi", "")),
    (PLAIN, "<thi", (None, "<thi")),
    (PLAIN, "   ", (None, "   ")),
    (OPENED, "</think>", ("", "")),
]


@pytest.mark.parametrize("prompt, text, want", CASES)
def test_the_split_is_the_same_whole_or_cut_anywhere(prompt, text, want):
    assert ReasoningSplitter(prompt).split(text) == want
    rng = random.Random(text)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        splitter, thinking, answer = ReasoningSplitter(prompt), "", ""
        for piece in (text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])):
            more_thinking, more_answer = splitter.feed(piece)
            thinking, answer = thinking + more_thinking, answer + more_answer
        rest_thinking, rest_answer = splitter.finish()
        assert (thinking + rest_thinking if splitter.reasoned else None, answer + rest_answer) == want


@pytest.fixture
def engine() -> FakeEngine:
    engine = FakeEngine()
    engine.pieces = ["<thi", "nk>Let me ", "see.</th", "ink>\n\nA c", "at."]
    return engine


def chat(client: TestClient, stream: bool = False, **body) -> dict | list[dict]:
    r = post(client, {"model": MODEL, "messages": [{"role": "user", "content": "What is it?"}], "max_tokens": 9,
                      "stream": stream, **body})
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["message"]
    return [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
            if line.startswith("data: {") and json.loads(line[6:])["choices"]]


def test_chat_answers_the_thinking_apart_whole_and_streamed(engine):
    client = TestClient(build_app(engine, [MODEL], options=ServingOptions(reasoning_parser="qwen3")))
    assert chat(client) == {"role": "assistant", "content": "A cat.", "reasoning_content": "Let me see."}
    deltas = chat(client, stream=True)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me see."
    assert "".join(d.get("content") or "" for d in deltas) == "A cat."
    assert not any("reasoning_content" in d and "content" in d and d["content"] for d in deltas)
    # tags that are not single tokens (no tokenizer here): a structured answer is constrained from
    # its first token, nothing to split off
    structured = chat(client, response_format={"type": "json_object"})
    assert structured["content"] == "<think>Let me see.</think>\n\nA cat." and "reasoning_content" not in structured
    assert engine.params[-1].structured_outputs.after_thinking is None


def tagged(engine: FakeEngine) -> tuple[int, int]:
    """Gives `engine` a tokenizer with `<think>` and `</think>` as single tokens; returns their ids."""
    from mmserve.models.builtin_qwen_vl import build_qwen_tokenizer

    tokenizer = build_qwen_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    engine.tokenizer = tokenizer
    return tuple(tokenizer.convert_tokens_to_ids(["<think>", "</think>"]))


def test_with_single_token_tags_a_structured_answer_binds_after_the_thinking(engine):
    """The grammar waits for `</think>` (the ids go to the engine; tests/engine/test_grammar_after_thinking.py
    runs them) and the thinking is split off as for a free answer; a forced tool call's grammar too."""
    tags = tagged(engine)
    client = TestClient(build_app(engine, [MODEL], options=ServingOptions(reasoning_parser="qwen3")))
    structured = chat(client, response_format={"type": "json_object"})
    assert structured == {"role": "assistant", "content": "A cat.", "reasoning_content": "Let me see."}
    assert engine.params[-1].structured_outputs.after_thinking == tags
    tool = {"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}
    chat(client, tools=[tool], tool_choice="required")
    assert engine.params[-1].structured_outputs.after_thinking == tags
    plain = TestClient(build_app(engine, [MODEL]))  # no reasoning parser: the grammar binds at once
    assert chat(plain, response_format={"type": "json_object"})["content"].startswith("<think>")
    assert engine.params[-1].structured_outputs.after_thinking is None


def test_a_prompt_that_opens_the_thinking_starts_the_answer_inside_it():
    engine = FakeEngine()  # its prompt is the messages' text: this one ends as a Thinking template's
    engine.pieces = ["Let me ", "see.</think>", "A cat."]
    client = TestClient(build_app(engine, [MODEL], options=ServingOptions(reasoning_parser="qwen3")))
    opened = {"messages": [{"role": "user", "content": "What is it?<think>\n"}]}
    assert chat(client, **opened) == {"role": "assistant", "content": "A cat.", "reasoning_content": "Let me see."}


def test_without_the_parser_the_tags_stay_in_the_content(engine):
    client = TestClient(build_app(engine, [MODEL]))
    assert chat(client) == {"role": "assistant", "content": "<think>Let me see.</think>\n\nA cat."}


def test_an_answer_that_does_not_think_has_no_reasoning_content():
    engine = FakeEngine()
    client = TestClient(build_app(engine, [MODEL], options=ServingOptions(reasoning_parser="deepseek_r1")))
    assert chat(client) == {"role": "assistant", "content": "Hello world"}


def test_the_responses_api_answers_the_thinking_as_a_reasoning_item(engine):
    """Whole: a `reasoning` item (its text as `reasoning_text`) before the message; streamed:
    `response.reasoning_text.delta`s, then the same items; a later turn's history carries the
    thinking as the assistant's `reasoning_content`. The items parse as the openai client's types."""
    from openai.types.responses import ResponseOutputMessage, ResponseReasoningItem

    client = TestClient(build_app(engine, [MODEL], options=ServingOptions(reasoning_parser="qwen3")))
    whole = client.post("/v1/responses", json={"model": MODEL, "input": "What is it?", "max_output_tokens": 9})
    assert whole.status_code == 200, whole.text
    body = whole.json()
    reasoning, message = body["output"]
    ResponseReasoningItem.model_validate(reasoning), ResponseOutputMessage.model_validate(message)
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text",
                                                                          "text": "Let me see."}]
    assert message["content"][0]["text"] == "A cat." and body["id"]
    later = client.post("/v1/responses", json={"model": MODEL, "input": "And?", "previous_response_id": body["id"]})
    assert later.status_code == 200, later.text
    turn = engine.prompts[-1]["messages"][1]
    assert turn["role"] == "assistant" and turn["reasoning_content"] == "Let me see." and turn["content"] == "A cat."

    streamed = client.post("/v1/responses", json={"model": MODEL, "input": "What is it?", "max_output_tokens": 9,
                                                  "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    kinds = [e["type"] for e in events]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Let me see."
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.done")
    done = events[-1]["response"]
    ResponseReasoningItem.model_validate(done["output"][0])
    assert [item["type"] for item in done["output"]] == ["reasoning", "message"]
    assert done["output"][0]["content"] == reasoning["content"] and done["output"][1]["content"][0]["text"] == "A cat."


def test_the_responses_usage_counts_the_thinking_tokens(engine):
    """`output_tokens_details.reasoning_tokens`: the tokens up to and with `</think>`, whole and
    streamed; 0 when the tags are not single tokens (the split is the text's alone)."""
    engine.pieces = ["<think>", "Let me ", "see.", "</think>", "\n\nA c", "at."]
    body = {"model": MODEL, "input": "What is it?", "max_output_tokens": 9}
    untagged = TestClient(build_app(engine, [MODEL], options=ServingOptions(reasoning_parser="qwen3")))
    assert untagged.post("/v1/responses", json=body).json()["usage"]["output_tokens_details"] == {
        "reasoning_tokens": 0}
    start, end = tagged(engine)
    engine.piece_ids = [start, 7, 8, end, 9, 10]
    client = TestClient(build_app(engine, [MODEL], options=ServingOptions(reasoning_parser="qwen3")))
    usage = client.post("/v1/responses", json=body).json()["usage"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": 4} and usage["output_tokens"] == 6
    streamed = client.post("/v1/responses", json={**body, "stream": True})
    done = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")][-1]
    assert done["response"]["usage"]["output_tokens_details"] == {"reasoning_tokens": 4}
    engine.pieces, engine.piece_ids = ["Just ", "an answer"], [7, 8]
    assert client.post("/v1/responses", json=body).json()["usage"]["output_tokens_details"] == {
        "reasoning_tokens": 0}
