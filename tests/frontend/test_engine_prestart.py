"""`mmserve serve` spawns its engine core before its own heavy imports (`prestart_engine_core`):
P1 imports torch and the model code beside P0's imports, then takes its arguments from the first
`LocalEngineProcess.start`. An unused one exits quietly when P0 lets it go."""

from __future__ import annotations

import asyncio

import pytest

from mmserve import SamplingParams
from mmserve.config import EngineConfig
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.frontend.engine_client import engine_process
from mmserve.frontend.engine_client.engine_process import discard_prestarted, prestart_engine_core
from helpers.server_process import pid_alive
from helpers.tiny_models import make_checkpoint

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')


async def first_text(engine: AsyncLLM) -> str:
    final = None
    async for out in engine.generate("r1", "Hello there", SamplingParams(max_tokens=4, temperature=0)):
        final = out
    assert final is not None
    return final.outputs[0].text


def test_the_engine_takes_the_prestarted_process_and_it_serves(tmp_path):
    path = make_checkpoint(tmp_path)
    prestart_engine_core()
    prestarted = engine_process._PRESTARTED[-1][0]
    engine = AsyncLLM(EngineConfig.from_kwargs(model=path))
    try:
        assert not engine_process._PRESTARTED  # taken, not left waiting
        process = engine.client.engine
        assert isinstance(process, engine_process.LocalEngineProcess) and process.process is prestarted
        text = asyncio.run(first_text(engine))
    finally:
        engine.shutdown()
    assert text and prestarted.exitcode == 0 and not pid_alive(prestarted.pid)
    fresh = AsyncLLM(EngineConfig.from_kwargs(model=path))  # none prestarted: spawned as before, same answer
    try:
        assert fresh.client.engine.process is not prestarted
        assert asyncio.run(first_text(fresh)) == text
    finally:
        fresh.shutdown()


def test_an_unused_prestarted_engine_core_exits_quietly(capfd):
    prestart_engine_core()
    process = engine_process._PRESTARTED[-1][0]
    discard_prestarted()  # e.g. the server failed before it started an engine
    assert not engine_process._PRESTARTED and process.exitcode == 0 and not pid_alive(process.pid)
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Error" not in out + err, out + err
