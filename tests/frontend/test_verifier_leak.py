"""The cache verifier keeps a first-logits row only while its request is open (regression: a
candidate whose client left mid-prefill had its row stored by `_dispatch` after `finished` had
run, and it stayed for good: vocabulary x 4 bytes per client that timed out)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from helpers.mm_prompts import PARAMS, one
from helpers.tiny_models import make_checkpoint
from mmserve.config import EngineConfig
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.ipc.messages import EngineCoreOutput, EngineCoreOutputs

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("verifier_leak"))
    e = AsyncLLM(EngineConfig.from_kwargs(model=path, cache_verify_rate=1.0))
    yield e
    e.shutdown()


def test_first_logits_of_a_request_that_ended_are_not_kept(engine):
    row = np.zeros(8, dtype=np.float32).tobytes()

    async def run() -> None:
        async for _ in engine.generate("done", one(3), PARAMS):
            pass
        assert engine.verifier.kept == 0
        # the first output of a request whose caller left before it came (cancelled mid-prefill)
        engine._dispatch(0, EngineCoreOutputs([EngineCoreOutput("left", [5], first_logits=row)]))
        assert engine.verifier.kept == 0

    asyncio.run(run())


def test_a_candidate_cancelled_before_its_first_output_leaves_no_row(engine):
    async def run() -> None:
        async def consume() -> None:
            async for _ in engine.generate("gone", one(4), PARAMS):
                pass

        for _ in range(5):
            task = asyncio.ensure_future(consume())
            while getattr(engine.requests.get("gone"), "rank", None) is None and not task.done():
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.3)  # the aborted request's first output, if it was computed, arrives
            assert engine.verifier.kept == 0

    asyncio.run(run())
