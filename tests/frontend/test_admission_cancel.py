"""A request cancelled while its images are being resolved (the client left mid-processing)
leaves nothing in P0 once the worker thread ends (regression: the thread went on, parked the
request's processed items as pending and nobody took them back — held in memory and in flight
for good).

A request resolves in a worker thread only while another is in flight (alone, it resolves on the
event loop, where no cancellation can come in the middle): the test keeps one running."""

from __future__ import annotations

import asyncio
import threading

import pytest

from helpers.mm_prompts import PARAMS, generate, one
from mmserve import SamplingParams
from mmserve.config import EngineConfig
from mmserve.frontend.async_llm import AsyncLLM
from helpers.tiny_models import make_checkpoint

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')


@pytest.fixture(scope="module", params=["lru", "shm"])
def engine(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("admission_cancel"))
    e = AsyncLLM(EngineConfig.from_kwargs(model=path, mm_cache_type=request.param, mm_shm_cache_gb=0.01))
    yield e
    e.shutdown()


def p0_leftovers(engine: AsyncLLM) -> dict:
    processor = engine.input_processor
    return {"pending": {r.request_id: r.pending for r in engine.requests.values() if r.pending},
            "inflight": dict(processor.items.inflight.futures),
            "queues": dict(engine.requests.queues), "outputs": engine.output_processor.has_unfinished_requests()}


def test_cancelled_while_resolving_leaves_nothing(engine):
    real, entered, release = engine.input_processor.process, threading.Event(), threading.Event()
    resolved_on: dict[str, threading.Thread] = {}

    def slow_process(request_id, *args):
        resolved_on[request_id] = threading.current_thread()
        if request_id == "left":
            entered.set()
            release.wait(10)  # the client leaves while this thread works
        return real(request_id, *args)

    async def run() -> None:
        running = asyncio.Event()

        async def keep_busy() -> None:  # in flight all along while "left" is resolved
            async for _ in engine.generate("busy", one(8), SamplingParams(max_tokens=2000, ignore_eos=True)):
                running.set()

        async def consume() -> None:
            async for _ in engine.generate("left", one(7), PARAMS):
                pass

        busy = asyncio.ensure_future(keep_busy())
        await running.wait()
        task = asyncio.ensure_future(consume())
        await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not busy.done()
        busy.cancel()
        release.set()
        for _ in range(200):  # the thread ends, then the undo runs on the loop
            await asyncio.sleep(0.01)
            if p0_leftovers(engine) == empty:
                return

    empty = {"pending": {}, "inflight": {}, "queues": {}, "outputs": False}
    engine.input_processor.process = slow_process
    try:
        asyncio.run(run())
    finally:
        engine.input_processor.process = real
    assert resolved_on["busy"] is not threading.main_thread()  # alone too: the event loop only routes
    assert resolved_on["left"] is not threading.main_thread()
    assert p0_leftovers(engine) == empty
    assert generate(engine, one(7), "again")  # the image is processed afresh, not waited for
