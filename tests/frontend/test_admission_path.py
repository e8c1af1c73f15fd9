"""The event loop only routes: a request's resolution (template, decode, processor, tokenizing)
runs in a worker thread even when the request is alone (issue 40: a request alone, image and all,
was resolved on the event loop, so /health waited behind its decode and processor)."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time

import numpy as np
import pytest
from PIL import Image

from mmserve import SamplingParams
from mmserve.config import EngineConfig
from mmserve.frontend.async_llm import AsyncLLM
from helpers.tiny_models import make_checkpoint

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')


def big_image_url(side: int = 2400) -> str:
    """A noisy PNG (slow to decode and resize) as a data URL."""
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_a_request_alone_resolves_off_the_event_loop(tmp_path_factory):
    engine = AsyncLLM(EngineConfig.from_kwargs(model=make_checkpoint(tmp_path_factory.mktemp("path"))))
    threads: dict[str, int] = {}
    real_process = engine.input_processor.process
    real_template = engine.input_processor.processor.apply_chat_template

    def process(*args):
        threads["process"] = threading.get_ident()
        return real_process(*args)

    def template(*args, **kwargs):
        threads["template"] = threading.get_ident()
        return real_template(*args, **kwargs)

    engine.input_processor.process = process  # type: ignore[method-assign]
    engine.input_processor.processor.apply_chat_template = template  # type: ignore[method-assign]
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": big_image_url()}},
                                             {"type": "text", "text": "What is this?"}]}]

    async def run() -> float:
        loop_thread = threading.get_ident()
        worst, done = 0.0, asyncio.Event()

        async def probe() -> None:  # what /health would wait: the longest the loop went without a turn
            nonlocal worst
            while not done.is_set():
                start = time.perf_counter()
                await asyncio.sleep(0.005)
                worst = max(worst, time.perf_counter() - start - 0.005)

        ticker = asyncio.create_task(probe())
        await asyncio.sleep(0.02)  # the probe is ticking before the request arrives
        prompt = await engine.build_prompt(messages)
        async for _ in engine.generate("alone", prompt, SamplingParams(max_tokens=2, ignore_eos=True)):
            pass
        done.set()
        await ticker
        assert threads["template"] != loop_thread and threads["process"] != loop_thread
        return worst

    try:
        worst = asyncio.run(run())
    finally:
        engine.shutdown()
    print(f"longest event-loop stall while a large image resolved: {worst * 1000:.1f} ms")
    assert worst < 1.0  # generous (2 shared cores); the thread identities above are the real check


def test_the_node_stores_round_trips_run_off_the_event_loop(tmp_path_factory):
    """With several API servers each store lookup and put is a round trip to the launcher: they run
    in the resolving thread (`ItemTransport.prepare`), not at the send on the event loop."""
    path = make_checkpoint(tmp_path_factory.mktemp("store"))
    engine = AsyncLLM(EngineConfig.from_kwargs(model=path, mm_cache_type="shm", mm_shm_cache_gb=0.01))
    assert engine.transport.shm is not None
    store = engine.transport.shm.store
    engine.transport.store_round_trips = True  # as a `NodeStoreClient` is: a round trip per call
    asked_on: list[int] = []
    real_lookup, real_put = store.lookup, store.put

    def lookup(*args, **kwargs):
        asked_on.append(threading.get_ident())
        return real_lookup(*args, **kwargs)

    def put(*args, **kwargs):
        asked_on.append(threading.get_ident())
        return real_put(*args, **kwargs)

    store.lookup, store.put = lookup, put  # type: ignore[method-assign]
    prompt = {"prompt": "USER: <image>\nWhat? ASSISTANT:", "multi_modal_data": {"image": big_image_url(64)}}

    async def run() -> int:
        final = None
        for rid in ("first", "again"):  # a put, then a hit
            async for out in engine.generate(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True)):
                final = out
        assert final is not None and len(final.outputs[0].token_ids) == 2
        return threading.get_ident()

    try:
        loop_thread = asyncio.run(run())
        assert asked_on and loop_thread not in asked_on
        assert engine.figures.stats() is not None
        assert not store.pinned_requests()
    finally:
        engine.shutdown()
