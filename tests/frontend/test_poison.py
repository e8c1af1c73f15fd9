"""The engine outlives one request (issue 40, item 6): a request whose step crashes its engine core
is sent again once, then fails with a 500 naming the cause instead of taking down rank after
rank until the restarts are spent; and a request's cleanup unpins its store entries even when
its abort raises."""

from __future__ import annotations

import asyncio

import pytest

from helpers.mm_prompts import generate, one
from mmserve import SamplingParams
from mmserve.config import EngineConfig
from mmserve.engine.poison import ENV
from mmserve.errors import EngineRequestError
from mmserve.frontend.async_llm import AsyncLLM
from helpers.tiny_models import make_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')

POISON_SEED = 424242


async def run_to_end(engine: AsyncLLM, request_id: str, prompt: dict, params: SamplingParams) -> list[int]:
    final = None
    async for out in engine.generate(request_id, prompt, params, stream=False):
        final = out
    assert final is not None
    return final.outputs[0].token_ids


def test_a_poison_request_is_sent_again_once_then_fails_alone(tmp_path_factory, monkeypatch):
    monkeypatch.setenv(ENV, str(POISON_SEED))  # read by the engine cores, which inherit it
    path = make_checkpoint(tmp_path_factory.mktemp("poison"))
    engine = AsyncLLM(EngineConfig.from_kwargs(model=path, engine_restart_limit=3))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    poison = SamplingParams(temperature=0.0, max_tokens=4, seed=POISON_SEED)

    async def scenario() -> None:  # one event loop: the restarts run as its tasks
        want = await run_to_end(engine, "before", one(1), greedy)
        with pytest.raises(EngineRequestError, match="died with it") as failed:
            await run_to_end(engine, "poison", one(2), poison)
        assert "not sent again" in str(failed.value)
        assert engine.is_healthy
        assert await run_to_end(engine, "after", one(1), greedy) == want  # waits for the restart
        assert engine.ranks.restarts == [2]  # the first death and the one resend; the third is kept

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


def test_an_abort_that_raises_leaks_no_pins(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("pins"))
    engine = AsyncLLM(EngineConfig.from_kwargs(model=path, mm_cache_type="shm", mm_shm_cache_gb=0.01))
    assert engine.transport.shm is not None
    store = engine.transport.shm.store

    def broken(request_ids: list[str]) -> None:
        raise RuntimeError("the abort failed")

    async def leave_early() -> None:
        outputs = engine.generate("leaves", one(3), SamplingParams(max_tokens=50, ignore_eos=True))
        await outputs.__anext__()
        await outputs.aclose()  # the client goes after its first output: the cleanup aborts

    try:
        generate(engine, one(4), "warm")
        real, engine.sender.abort = engine.sender.abort, broken  # type: ignore[method-assign]
        try:
            with pytest.raises(RuntimeError, match="the abort failed"):
                asyncio.run(leave_early())
        finally:
            engine.sender.abort = real  # type: ignore[method-assign]
        assert {k: c.pins for k, c in store._entries.items() if c.pins} == {}
        assert not store._requests
        assert "leaves" not in engine.requests
        assert generate(engine, one(4), "after") == generate(engine, one(4), "after, again")
    finally:
        engine.shutdown()
