"""n > 1 through AsyncLLM: a completion that a stop string ends in P0 (the engine core does not
match stop strings) is aborted in P1 at once under its own id (`request#index`), so the engine stops
decoding it while its siblings run on."""

from __future__ import annotations

import asyncio

import pytest

from helpers.tiny_models import make_checkpoint
from mmserve import SamplingParams
from mmserve.config import EngineConfig
from mmserve.frontend.async_llm import AsyncLLM

pytestmark = pytest.mark.slow  # spawns the engine core (deselect with -m 'not slow')

PROMPT = {"prompt": "the quick brown fox jumps over the lazy dog"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = AsyncLLM(EngineConfig.from_kwargs(model=make_checkpoint(tmp_path_factory.mktemp("sib"))))
    yield e
    e.shutdown()


async def texts(engine: AsyncLLM, rid: str, params: SamplingParams) -> list[str]:
    outs = [out async for out in engine.generate(rid, PROMPT, params)]
    return [c.text for c in outs[-1].outputs]


async def running_after_the_stop(engine: AsyncLLM, params: SamplingParams) -> int:
    """The fewest requests the engine core runs once completion 1 has stopped and 0 runs on."""
    fewest = 2
    async for out in engine.generate("long", PROMPT, params):
        first, second = out.outputs
        if second.finish_reason == "stop" and first.finish_reason is None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20.0
            while fewest > 1 and loop.time() < deadline:
                await asyncio.sleep(0.01)
                if (stats := engine.stats()) is not None:
                    fewest = min(fewest, stats.num_running)
            await engine.abort("long")
            return fewest
    pytest.fail("completion 0 finished before completion 1's stop string")


def test_a_stop_string_ends_its_completion_in_the_engine_core(engine):
    probe = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8)
    first, second = asyncio.run(texts(engine, "probe", probe))
    stop = second[2:6]
    assert stop and stop not in first
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=1500, ignore_eos=True, stop=[stop])
    assert asyncio.run(running_after_the_stop(engine, params)) == 1
