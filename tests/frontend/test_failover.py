"""A request is never failed for a rank that died while the request was on its way to it: it
waits for the restart (CI saw a 503 "no engine rank is serving" when an engine core died between
the request's liveness check and its send, while its image was being processed)."""

from __future__ import annotations

import os
import signal

import pytest

from helpers.mm_prompts import generate, one
from mmserve.config import EngineConfig
from mmserve.frontend.async_llm import AsyncLLM
from helpers.tiny_models import make_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')


@pytest.mark.parametrize("mm_cache_type", ["lru", "shm"])
def test_a_rank_dying_while_a_request_resolves_is_waited_for(tmp_path_factory, mm_cache_type):
    path = make_checkpoint(tmp_path_factory.mktemp("failover"))
    engine = AsyncLLM(EngineConfig.from_kwargs(model=path, mm_cache_type=mm_cache_type, mm_shm_cache_gb=0.01))
    try:
        want = generate(engine, one(1), "first")
        real = engine.input_processor.process
        victim = engine.client.engine

        def process_then_die(*args):
            resolved = real(*args)  # the request passed the liveness check before this
            assert victim.process is not None and victim.process.pid is not None
            os.kill(victim.process.pid, signal.SIGKILL)
            victim.join(30)  # beside the thread that retires the dead rank
            assert victim.describe_exit() == "killed by SIGKILL"
            return resolved

        engine.input_processor.process = process_then_die  # type: ignore[method-assign]
        try:
            got = generate(engine, one(1), "during the restart")  # the same image: sent by hash before
        finally:
            engine.input_processor.process = real  # type: ignore[method-assign]
        assert got == want
        assert engine.ranks.restarts == [1] and engine.ranks.live() == [0]
        assert generate(engine, one(2), "after") == generate(engine, one(2), "after, again")
    finally:
        engine.shutdown()
