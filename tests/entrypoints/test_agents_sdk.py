"""An agent framework end to end (issue 21): the OpenAI Agents SDK, unchanged, runs a computer-use
style agent against the real server on a tiny Qwen3-VL — its first turn forced to call a function
tool (`tool_choice` set), the SDK runs the tool, and the next turn (the SDK resets tool_choice to
"auto", parsed by hermes) finishes the run."""

from __future__ import annotations

import pytest

from helpers.server_process import ServerProcess
from helpers.tiny_models import make_qwen_checkpoint

agents = pytest.importorskip("agents")
pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')


def test_the_agents_sdk_runs_a_forced_tool_call_then_finishes(tmp_path_factory):
    from openai import AsyncOpenAI

    path = make_qwen_checkpoint(tmp_path_factory.mktemp("agents"))
    server = ServerProcess(path, "--served-model-name", "m", "--enable-auto-tool-choice",
                           "--tool-call-parser", "hermes")
    clicks: list[tuple[int, int]] = []

    @agents.function_tool
    def click(x: int, y: int) -> str:
        """Click at a screen point."""
        clicks.append((x, y))
        return "clicked"

    try:
        agents.set_tracing_disabled(True)
        client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        agent = agents.Agent(
            name="operator", instructions="You operate a computer through tools.", tools=[click],
            model=agents.OpenAIChatCompletionsModel(model="m", openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="click", max_tokens=48, temperature=0.0))
        result = agents.Runner.run_sync(agent, "Click the OK button.", max_turns=3)
    finally:
        server.stop()
    assert len(clicks) == 1 and all(isinstance(v, int) for v in clicks[0])  # the SDK parsed and ran the call
    assert isinstance(result.final_output, str)
