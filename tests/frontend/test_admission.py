"""The request path is all-or-nothing: a request that fails anywhere between resolving its images
and reaching P1 leaves no trace in P0 (issue: integers past 64 bits failed at encoding after the
items were pinned in shm and their keys added to the IPC sender, and left queues behind), and a
uuid-only item evicted before its send is a clean 400, not an AttributeError."""

from __future__ import annotations

import asyncio

import pytest

from helpers.mm_prompts import generate, one
from mmserve import SamplingParams
from mmserve.config import EngineConfig
from mmserve.frontend.async_llm import AsyncLLM
from helpers.tiny_models import make_checkpoint

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("admission"))


@pytest.fixture(scope="module", params=["lru", "shm"])
def engine(request, path):
    e = AsyncLLM(EngineConfig.from_kwargs(model=path, mm_cache_type=request.param, mm_shm_cache_gb=0.01))
    yield e
    e.shutdown()


def p0_state(engine: AsyncLLM) -> dict:
    """Everything of P0 a request could leave behind."""
    store = engine.transport.shm.store if engine.transport.shm is not None else None
    return {
        "ipc": (engine.transport.sender.keys(), engine.transport.sender.epoch),
        "processor": engine.input_processor.processor_cache.keys(),
        "inflight": dict(engine.input_processor.items.inflight.futures),
        "pending": {r.request_id: r.pending for r in engine.requests.values() if r.pending},
        "queues": dict(engine.requests.queues), "flights": engine.requests.ids(),
        "outputs": engine.output_processor.has_unfinished_requests(),
        "pins": None if store is None else {k: c.pins for k, c in store._entries.items()},
        "pinned_requests": None if store is None else dict(store._requests),
    }


def test_a_request_failing_at_its_send_leaves_nothing(engine):
    assert generate(engine, one(1), "warm")  # image 1 is cached in every layer
    before = p0_state(engine)

    def broken(message):
        raise OverflowError("integer out of range")  # what msgpack raised for 2**64 before validation

    real, engine.client.add_request = engine.client.add_request, broken
    try:
        with pytest.raises(OverflowError):
            generate(engine, one(2), "fails")  # a new image: processed, pinned / keyed, then the send fails
    finally:
        engine.client.add_request = real
    assert p0_state(engine) == before
    tokens = generate(engine, one(1), "after")  # the warm image still crosses by hash / handle
    assert tokens and engine.transport.sender.epoch == before["ipc"][1]
    assert generate(engine, one(2), "retry")  # the same new image now goes through


def test_integers_past_64_bits_are_refused_before_anything_happens(engine):
    for bad in (dict(max_tokens=2**64), dict(top_k=2**64), dict(stop_token_ids=[2**64]), dict(seed=2**64)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    before = p0_state(engine)
    too_long = SamplingParams(max_tokens=10**9)
    not_a_token = SamplingParams(stop_token_ids=[10**6])

    async def run(params: SamplingParams) -> None:
        async for _ in engine.generate("bad", one(3), params):
            pass

    for params in (too_long, not_a_token):
        with pytest.raises(ValueError):
            asyncio.run(run(params))
    assert p0_state(engine) == before


def test_a_uuid_only_item_evicted_before_its_send_is_a_clean_error(engine):
    if engine.transport.shm is not None:
        pytest.skip("uuid-only items resolve from the IPC sender's keys (lru)")
    assert generate(engine, one(4, multi_modal_uuids={"image": ["u4"]}), "named")
    uuid_only = {"prompt": one(4)["prompt"], "multi_modal_data": {"image": [None]},
                 "multi_modal_uuids": {"image": ["u4"]}}
    engine.input_processor.processor_cache._lru.clear()  # P0 holds it only as an IPC key now
    real = engine.input_processor.process

    def resolve_then_lose_it(*args):
        request = real(*args)
        assert request.mm_items[0].data is None  # resolved from the IPC sender's keys
        engine.transport.sender.reset()  # a concurrent request evicted it between resolve and send
        return request

    before = p0_state(engine)
    engine.input_processor.process = resolve_then_lose_it
    try:
        with pytest.raises(ValueError, match="send the image again"):
            generate(engine, uuid_only, "late")
    finally:
        engine.input_processor.process = real
    after = p0_state(engine)
    assert after.pop("ipc") == ([], before.pop("ipc")[1] + 1)  # the eviction stays, nothing else
    assert after == before
