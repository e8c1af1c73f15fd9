"""The Responses events of a streamed answer, from its text deltas (no server): the hermes parser's
calls in "auto" become function_call items (their text never streamed as text), deltas add up to
the done events and the completed response, and sequence numbers count every event."""

from __future__ import annotations

import asyncio
import json

from mmserve.entrypoints.openai.choices import ChoiceDelta
from mmserve.entrypoints.openai.protocol import UsageInfo
from mmserve.entrypoints.openai.protocol_responses import ResponsesRequest
from mmserve.entrypoints.openai.responses_output import ResponseShape
from mmserve.entrypoints.openai.responses_stream import ResponsesStream
from mmserve.entrypoints.openai.tool_calls import tool_mode
from mmserve.entrypoints.openai.tool_parsers import tool_parser

TOOLS = [{"type": "function", "function": {"name": "click", "parameters": {"type": "object"}}}]
TEXT = 'I will click.\n<tool_call>\n{"name": "click", "arguments": {"x": 1, "y": 2}}\n</tool_call>'


def events_of(chunks: list[str], finish: str = "stop") -> list[dict]:
    kept: list[list[dict]] = []

    async def keep(items: list[dict]) -> None:
        kept.append(items)

    stream = ResponsesStream("resp_1", "m", None, None, None, True, 0,
                             shape=ResponseShape("resp_1", "m", ResponsesRequest(input="x")),
                             tools=tool_mode(TOOLS, None, None, "hermes"), on_done=keep)
    out = stream._open()
    for i, chunk in enumerate(chunks):
        out += stream._delta(ChoiceDelta(0, chunk, [], None, finish if i == len(chunks) - 1 else None))
    out.append(stream._usage(UsageInfo.of(10, 5, 4)))
    asyncio.run(stream._finished())
    events = [json.loads(line[len("data: "):]) for text in out for line in text.splitlines()
              if line.startswith("data: ")]
    assert kept and kept[0] == events[-1]["response"]["output"]  # what previous_response_id replays
    return events


def test_auto_calls_become_function_call_items_in_every_split():
    for size in (1, 3, 7, len(TEXT)):
        events = events_of([TEXT[i:i + size] for i in range(0, len(TEXT), size)])
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        kinds = [e["type"] for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == tool_parser("hermes").extract(TEXT).content == "I will click."  # streamed = whole
        args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        assert json.loads(args) == {"x": 1, "y": 2}
        final = events[-1]["response"]
        assert final["status"] == "completed" and [i["type"] for i in final["output"]] == ["message", "function_call"]
        assert final["output"][1]["name"] == "click" and json.loads(final["output"][1]["arguments"]) == {"x": 1, "y": 2}
        assert final["usage"]["input_tokens_details"] == {"cached_tokens": 4} and final["usage"]["total_tokens"] == 15


def test_a_cut_answer_is_incomplete_and_an_empty_one_is_an_empty_message():
    cut = events_of(["Hello"], finish="length")[-1]["response"]
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    empty = events_of([""])[-1]["response"]
    assert [item["type"] for item in empty["output"]] == ["message"] and empty["output"][0]["content"][0]["text"] == ""


def test_a_failure_mid_stream_ends_with_response_failed():
    """Regression: it ended with an unnamed `data: {"error": ...}` that OpenAI's client does not read."""
    import time

    from mmserve.entrypoints.openai.serving_chat import RequestRecord
    from mmserve.frontend.engine_client.core_client import EngineDeadError
    from mmserve.metrics import ServerMetrics
    from mmserve.outputs import CompletionOutput, RequestOutput

    def output(text: str) -> RequestOutput:
        return RequestOutput("resp_2", None, [1, 2], [CompletionOutput(0, text, [3], delta_text=text)])

    async def outputs():
        yield output("Hello")
        raise EngineDeadError("engine rank 0 died")

    async def never(items: list[dict]) -> None:
        raise AssertionError("a failed response is not kept")

    async def run() -> list[dict]:
        gen = outputs()
        first = await anext(gen)
        stream = ResponsesStream("resp_2", "m", gen, first, RequestRecord(ServerMetrics(), time.perf_counter()),
                                 True, 0, shape=ResponseShape("resp_2", "m", ResponsesRequest(input="x")),
                                 tools=None, on_done=never)
        text = "".join([chunk async for chunk in stream.events()])
        return [json.loads(line[len("data: "):]) for line in text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]

    events = asyncio.run(run())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "engine_dead" and "died" in failed["response"]["error"]["message"]
    assert failed["response"]["output"][0]["type"] == "message" and failed["response"]["id"] == "resp_2"
