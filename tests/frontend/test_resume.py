"""A streamed request resumes after its engine core dies (issue 49): its text goes on without a
duplicated or lost token and equals an undisturbed run's; a request in flight at a second death
is failed as the likely poison, with one log line naming it; a streamed request that cannot
resume exactly (a grammar) still fails at once."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from helpers.mm_prompts import one
from helpers.tiny_models import make_checkpoint
from mmserve import SamplingParams
from mmserve.config import EngineConfig
from mmserve.errors import EngineRequestError
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.frontend.request.open_request import resumable
from mmserve.frontend.engine_client.core_client import EngineDeadError
from mmserve.structured_outputs import StructuredOutputsParams

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')

SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=120, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("resume"))
    e = AsyncLLM(EngineConfig.from_kwargs(model=path, engine_restart_limit=5))
    yield e
    e.shutdown()


def kill(engine: AsyncLLM) -> None:
    process = engine.client.engine.process
    assert process is not None and process.pid is not None
    os.kill(process.pid, signal.SIGKILL)


async def stream(engine: AsyncLLM, request_id: str, params: SamplingParams, kill_after: list[int]) -> tuple[str, list]:
    """The request's text and tokens, streamed; the engine core is killed once `kill_after[0]`, then
    `kill_after[1]`, ... tokens have come."""
    deltas, final = [], None
    async for out in engine.generate(request_id, one(5), params):
        deltas.append(out.outputs[0].delta_text)
        final = out
        if kill_after and len(out.outputs[0].token_ids) >= kill_after[0]:
            kill_after.pop(0)
            kill(engine)
    assert final is not None and final.finished
    assert "".join(deltas) == final.outputs[0].text  # no delta duplicated or lost
    return final.outputs[0].text, final.outputs[0].token_ids


def test_a_seeded_stream_resumes_exactly(engine):
    async def run() -> None:
        want = await stream(engine, "calm", SEEDED, [])
        got = await stream(engine, "killed", SEEDED, [10])
        assert got == want and len(got[1]) == SEEDED.max_tokens

    asyncio.run(run())


def test_in_flight_at_a_second_death_is_failed_as_the_likely_poison(engine, caplog):
    async def run() -> None:
        with pytest.raises(EngineRequestError, match="not sent again"):
            await stream(engine, "twice", SEEDED, [5, 40])
        assert "request twice was on 2 engine ranks that died" in caplog.text
        assert engine.is_healthy
        await engine.failover.wait_for_live_rank()  # the restart runs on this loop: let it end here

    asyncio.run(run())


def test_a_stream_that_cannot_resume_exactly_fails(engine):
    assert not resumable(SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)))
    assert not resumable(SamplingParams(n=2)) and resumable(SEEDED)
    penalised = SamplingParams(frequency_penalty=0.5, max_tokens=120, ignore_eos=True)

    async def run() -> None:
        with pytest.raises(EngineDeadError):
            await stream(engine, "penalised", penalised, [5])

    asyncio.run(run())
