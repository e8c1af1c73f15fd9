"""Backpressure (issue 40, item 4): outputs a caller has not read are merged, not queued one
cumulative copy per step, and a request whose caller reads nothing past `--stalled-stream-abort-s`
is aborted (a stream nobody read made P0 grow by ~1 GB in 30 s)."""

from __future__ import annotations

import asyncio
import time

import pytest

from mmserve import SamplingParams
from mmserve.config import EngineConfig
from mmserve.errors import ClientError
from mmserve.frontend.async_llm import AsyncLLM
from helpers.tiny_models import make_checkpoint

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

LONG = SamplingParams(temperature=1.0, seed=3, max_tokens=400, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("backpressure"))
    e = AsyncLLM(EngineConfig.from_kwargs(model=path, stalled_stream_abort_s=0.5))
    yield e
    e.shutdown()


def test_a_slow_reader_gets_merged_outputs_that_add_up(engine):
    async def run() -> tuple[str, str, int, int]:
        text, reads, final = "", 0, None
        async for out in engine.generate("slow", "USER: hi ASSISTANT:", LONG):
            assert engine.requests.queues["slow"].empty()  # one output waited, not a backlog
            text += out.outputs[0].delta_text
            reads, final = reads + 1, out
            await asyncio.sleep(0.05)  # slower than the engine steps
        assert final is not None
        return text, final.outputs[0].text, reads, len(final.outputs[0].token_ids)

    joined, whole, reads, tokens = asyncio.run(run())
    assert joined == whole
    assert tokens == 400 and reads < tokens  # several steps' outputs were merged while unread


def test_a_stream_nobody_reads_is_aborted(engine):
    params = SamplingParams(max_tokens=engine.max_model_len - 8, ignore_eos=True, logprobs=5)

    async def run() -> Exception | None:
        outputs = engine.generate("stalled", "USER: hi ASSISTANT:", params)
        await outputs.__anext__()
        queue = engine.requests.queues["stalled"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "stalled" in engine.output_processor.states:
            await asyncio.sleep(0.1)  # the client reads nothing while the engine steps
        try:
            await outputs.__anext__()
        except ClientError as e:
            assert e.code == "stream_stalled" and queue.empty()
            return e
        finally:
            await outputs.aclose()
        return None

    assert asyncio.run(run()) is not None
    assert not engine.output_processor.has_unfinished_requests()
