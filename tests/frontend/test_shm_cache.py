"""`--mm-cache-type shm`: items cross P0 -> P1 by shared-memory handle, through a real engine core."""

from __future__ import annotations

import pytest

from mmserve.config import EngineConfig
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.transport.shm_items import ShmItemReader, ShmItemWriter
from mmserve.item_store.shm_store import ShmStore
from helpers.mm_prompts import PARAMS, TWO, generate, one, url
from helpers.tiny_models import make_checkpoint
from helpers.shm_listing import shm_listing

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')



@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mmcache"))


def run_all(engine: AsyncLLM) -> list[list[int]]:
    two = {"prompt": TWO, "multi_modal_data": {"image": [url(1), url(2)]}}
    return [generate(engine, one(1), "a"), generate(engine, one(1), "b"), generate(engine, two, "c")]


@pytest.fixture(scope="module")
def lru_tokens(path):
    engine = AsyncLLM(EngineConfig.from_kwargs(model=path))
    try:
        return run_all(engine)
    finally:
        engine.shutdown()


def test_shm_gives_the_same_tokens_as_lru_and_cleans_up(path, lru_tokens):
    engine = AsyncLLM(EngineConfig.from_kwargs(model=path, mm_cache_type="shm", mm_shm_cache_gb=0.02,
                                               mm_processor_cache_gb=0))
    segment = engine.transport.shm.store.info.name  # (other servers on this machine may add their own)
    try:
        assert segment in shm_listing()
        assert run_all(engine) == lru_tokens
        shm = engine.stats().caches["shm"]
        assert (shm.queries, shm.hits) == (4, 2)  # image 1 written once, then found twice
        assert shm.bytes_saved > 0 and shm.fallbacks == 0
        assert engine.stats().caches["ipc"].queries == 0  # shm replaces the IPC cache
    finally:
        engine.shutdown()
    assert segment not in shm_listing()


def test_with_processor_and_ipc_caches_off_shm_and_encoder_cache_still_hit_across_requests(path, lru_tokens):
    """Hashing is decided by every layer that keys on content: with the processor cache at 0,
    no IPC cache (shm) and prefix caching off, items still get their content hash, so the shm
    store and the encoder cache find the repeated image of the next request."""
    engine = AsyncLLM(EngineConfig.from_kwargs(model=path, mm_cache_type="shm", mm_shm_cache_gb=0.02,
                                               mm_processor_cache_gb=0, enable_prefix_caching=False))
    try:
        assert run_all(engine) == lru_tokens
        caches = engine.stats().caches
        assert (caches["shm"].queries, caches["shm"].hits) == (4, 2)
        assert (caches["encoder"].queries, caches["encoder"].hits) == (4, 2)
        assert caches["ipc"].queries == 0 and caches["prefix"].hits == 0
    finally:
        engine.shutdown()


def test_items_the_store_cannot_take_go_inline(path, lru_tokens):
    engine = AsyncLLM(EngineConfig.from_kwargs(model=path, mm_cache_type="shm", mm_shm_cache_gb=0.02,
                                               mm_shm_max_object_mb=0.001))  # smaller than any item
    try:
        assert run_all(engine) == lru_tokens
        assert engine.stats().caches["shm"].fallbacks == 4
    finally:
        engine.shutdown()


def test_a_stale_handle_is_reported_missing_not_misread(path):
    from mmserve.config import EngineConfig as Cfg
    from mmserve.frontend.input_processor import InputProcessor
    from mmserve.models.hf_config import eos_token_id

    inputs = InputProcessor(Cfg.from_kwargs(model=path), path, 512, eos_token_id(path))
    request = inputs.process("r", one(3), PARAMS)
    writer = ShmItemWriter(ShmStore.from_flags(0.01, 16))
    try:
        reader = ShmItemReader(writer.store.info)
        wire = request.__class__(**{f: getattr(request, f) for f in request.__struct_fields__})
        wire.mm_items = writer.to_wire(request)
        assert wire.mm_items[0].shm_handle is not None and wire.mm_items[0].data is None
        writer.store.clear()
        assert reader.attach(wire.request_id, wire.mm_items) == [request.mm_items[0].mm_hash]
        wire.mm_items = writer.to_wire(request)  # written again: a fresh handle reads back
        assert reader.attach(wire.request_id, wire.mm_items) == []
        assert wire.mm_items[0].data["pixel_codes"].equal(request.mm_items[0].data["pixel_codes"])
        reader.release("r")
        reader.close()
    finally:
        writer.close()


def test_store_larger_than_dev_shm_is_a_clear_error():
    with pytest.raises(Exception, match="mm-shm-cache-gb"):
        ShmStore.from_flags(100_000, 16)
