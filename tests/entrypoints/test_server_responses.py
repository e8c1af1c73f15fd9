"""`POST /v1/responses` through the real server with the official client (issue 41), on a tiny
Qwen3-VL: the answer equals chat's for the same conversation, whole and streamed (the client
assembles the events); images as data URLs (a file id is a 400); forced tool calls valid for
their schemas; text.format json_schema; previous_response_id continues a kept conversation (its
prefix served by the cache; an unknown id is a 404); and the OpenAI Agents SDK's default model
class runs a tool-calling agent against it."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from helpers.server_process import ServerProcess, data_url, labelled
from helpers.tiny_models import make_image, make_qwen_checkpoint

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

CLICK = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 1920},
                                          "y": {"type": "integer", "minimum": 0, "maximum": 1080}},
         "required": ["x", "y"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "click", "description": "Click a point.", "parameters": CLICK}]
INSTRUCTIONS = "You describe screenshots."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_qwen_checkpoint(tmp_path_factory.mktemp("responses"))
    s = ServerProcess(path, "--served-model-name", "m", "--max-model-len", "1024")
    yield s
    s.stop()


def user_turn(seed: int = 3, text: str = "What is on the screen?") -> dict:
    return {"role": "user", "content": [{"type": "input_image", "image_url": data_url(make_image(seed, (64, 48)))},
                                        {"type": "input_text", "text": text}]}


def chat_answer(client, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0.0)
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_whole_and_streamed_answers_equal_chat(server, client):
    chat_messages = [{"role": "system", "content": INSTRUCTIONS},
                     {"role": "user", "content": [
                         {"type": "image_url", "image_url": {"url": data_url(make_image(3, (64, 48)))}},
                         {"type": "text", "text": "What is on the screen?"}]}]
    want, prompt_tokens = chat_answer(client, chat_messages, 12)
    args = dict(model="m", input=[user_turn()], instructions=INSTRUCTIONS, max_output_tokens=12, temperature=0.0)
    hits = labelled(server, "mmserve_cache_hits_total", "processor")
    whole = client.responses.create(**args)
    assert labelled(server, "mmserve_cache_hits_total", "processor") == hits + 1  # chat's processed image
    assert whole.status in ("completed", "incomplete") and whole.output_text == want
    assert whole.usage.input_tokens == prompt_tokens and whole.usage.output_tokens > 0
    assert whole.usage.input_tokens_details.cached_tokens > 0  # chat's request left its prefix cached
    raw = client.responses.with_raw_response.create(**args)  # the per-request cache report, as chat's
    assert "processor=1/1" in raw.headers["x-mmserve-cache"] and "prefix=" in raw.headers["x-mmserve-cache"]
    events = list(client.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == want and events[-1].response.usage.input_tokens == prompt_tokens
    with client.responses.stream(**args) as stream:  # the client's own assembly of the events
        assert stream.get_final_response().output_text == want


def test_forced_calls_and_json_schema_are_valid_whole_and_streamed(client):
    named = {"type": "function", "name": "click"}
    whole = client.responses.create(model="m", input="Click OK.", tools=TOOLS, tool_choice=named,
                                    max_output_tokens=80, temperature=0.0)
    call = next(item for item in whole.output if item.type == "function_call")
    assert call.name == "click" and call.call_id
    jsonschema.validate(json.loads(call.arguments), CLICK)
    events = list(client.responses.create(model="m", input="Click OK.", tools=TOOLS, tool_choice=named,
                                          max_output_tokens=80, temperature=0.0, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(streamed) == json.loads(call.arguments)
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == json.loads(call.arguments)
    schema = {"type": "object", "properties": {"label": {"type": "string", "enum": ["cat", "dog"]}},
              "required": ["label"], "additionalProperties": False}
    r = client.responses.create(model="m", input="Label it.", max_output_tokens=40, temperature=0.0,
                                text={"format": {"type": "json_schema", "name": "label", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_previous_response_id_continues_the_kept_conversation(client):
    first = client.responses.create(model="m", input=[user_turn(7)], max_output_tokens=6, temperature=0.0)
    second = client.responses.create(model="m", input="And now?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0.0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16  # the first turn's image blocks, from the cache
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="m", input="Hi", previous_response_id="resp_unknown", max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("part, param", [
    ({"type": "input_image", "file_id": "file-123"}, "input"),
    ({"type": "input_file", "file_id": "file-123"}, "input"),
])
def test_unsupported_inputs_are_400s(client, part, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input=[{"role": "user", "content": [part]}], max_output_tokens=4)
    assert e.value.body["param"] == param and e.value.body["message"]


def test_a_priority_without_priority_scheduling_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:  # as in vLLM: the server runs fcfs
        client.responses.create(model="m", input="Hi", max_output_tokens=4, extra_body={"priority": 2})
    assert e.value.body["param"] == "priority" and "--scheduling-policy priority" in e.value.body["message"]
    assert client.responses.create(model="m", input="Hi", max_output_tokens=2, extra_body={"priority": 0}).output


def test_the_agents_sdk_default_model_runs_a_tool_call_then_finishes(server):
    agents = pytest.importorskip("agents")
    clicks: list[tuple[int, int]] = []

    @agents.function_tool
    def click(x: int, y: int) -> str:
        """Click at a screen point."""
        clicks.append((x, y))
        return "clicked"

    agents.set_tracing_disabled(True)

    def operator() -> agents.Agent:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        return agents.Agent(
            name="operator", instructions="You operate a computer through tools.", tools=[click],
            model=agents.OpenAIResponsesModel(model="m", openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="click", max_tokens=48, temperature=0.0),
            # random weights never stop a free answer (a Responses answer cut by max_output_tokens is
            # "incomplete", which the SDK raises on): the run ends with the tool's result
            tool_use_behavior="stop_on_first_tool")

    result = agents.Runner.run_sync(operator(), "Click the OK button.", max_turns=3)
    assert len(clicks) == 1 and all(isinstance(v, int) for v in clicks[0])  # the SDK parsed and ran the call
    assert result.final_output == "clicked"

    async def streamed() -> object:
        run = agents.Runner.run_streamed(operator(), "Click the Cancel button.", max_turns=3)
        async for _ in run.stream_events():
            pass
        return run.final_output

    assert asyncio.run(streamed()) == "clicked" and len(clicks) == 2  # the SDK assembled the streamed events
