"""The Responses API's pieces without a server: input items to chat messages, tools to chat's
shape, and the store of finished responses (LRU by bytes)."""

from __future__ import annotations

import msgspec
import pytest

from mmserve.entrypoints.openai.protocol import ParameterError
from mmserve.entrypoints.openai.protocol_responses import ResponsesRequest, input_items_to_messages
from mmserve.entrypoints.openai.response_store import ResponseStore
from mmserve.entrypoints.openai.responses_output import history_turn


def test_items_become_chat_turns_and_consecutive_calls_join_one_assistant_turn():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                          {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\":1}"},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"},
             {"type": "reasoning", "summary": []},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]
    messages = input_items_to_messages(items)
    assert messages[0] == {"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"] and messages[1]["content"] is None
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    assert messages[3] == {"role": "assistant", "content": [{"type": "text", "text": "done"}]}
    assert len(messages) == 4


@pytest.mark.parametrize("item", [
    {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]},
    {"role": "user", "content": [{"type": "input_file", "file_data": "x"}]},
    {"type": "web_search_call"},
])
def test_unsupported_items_name_the_input(item):
    with pytest.raises(ParameterError) as e:
        input_items_to_messages([item])
    assert e.value.param == "input"


def test_tools_and_tool_choice_take_chats_shape():
    r = ResponsesRequest(input="x", tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                         tool_choice={"type": "function", "name": "f"})
    assert r.chat_tools() == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert r.chat_tool_choice() == {"type": "function", "function": {"name": "f"}}
    with pytest.raises(ParameterError):
        ResponsesRequest(input="x", tools=[{"type": "web_search"}]).chat_tools()


def test_an_answer_replays_as_one_assistant_turn():
    items = [{"type": "message", "content": [{"type": "output_text", "text": "a"}]},
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    assert history_turn(items) == {"role": "assistant", "content": "a", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_the_store_evicts_the_least_recently_used_by_bytes():
    turn = msgspec.json.encode([{"role": "user", "content": "x" * 100}])
    store = ResponseStore(3 * ResponseStore.entry_bytes("a", turn))
    for name in "abc":
        store.put(name, turn)
    assert store.get("a") == turn  # a is now the most recent
    store.put("d", turn)
    assert store.get("b") is None and store.get("a") == turn and len(store) == 3
    store.put("huge", b"x" * 1000)  # larger than the store: not kept
    assert store.get("huge") is None and len(store) == 3
    store.check_integrity()
