"""P1's half of the IPC cache (issue 14, case 6): under `--mm-cache-type shm` P1 builds none, so
it keeps neither the items sent inline nor views of shared memory it released (it built a 4 GiB
receiver and kept both); with lru, P1 reports its keys' digest, and it equals P0's sender's
after requests that hit, miss, evict and fail."""

from __future__ import annotations

import asyncio

import pytest

from helpers.mm_prompts import generate, one
from mmserve import SamplingParams
from mmserve.config import EngineConfig
from mmserve.transport.api_server_channels import ApiServerChannels
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.multimodal.cache import ENTRY_OVERHEAD_BYTES
from helpers.tiny_models import TINY_VISION_CONFIG, llava_item_bytes, make_checkpoint

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

ITEM_BYTES = llava_item_bytes(TINY_VISION_CONFIG["image_size"]) + ENTRY_OVERHEAD_BYTES


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("p1_ipc"))


def receivers(servers: int, **engine_args):
    config = EngineConfig.from_kwargs(api_server_count=servers, **engine_args)
    return ApiServerChannels([object()] * servers, config.ipc_cache_bytes_per_server).receivers  # type: ignore[list-item]


def test_p1_builds_an_ipc_receiver_only_when_items_cross_through_it():
    assert receivers(1, mm_cache_type="shm", mm_ipc_cache_gb=4) is None
    assert receivers(1, mm_ipc_cache_gb=0) is None
    one_server = receivers(1, mm_ipc_cache_gb=1)
    assert one_server is not None and len(one_server) == 1 and one_server[0].enabled
    assert one_server[0]._lru.capacity == 1 << 30


def test_each_api_server_gets_its_own_receiver_and_a_share_of_the_budget():
    three = receivers(3, mm_ipc_cache_gb=3)
    assert three is not None and len(three) == 3
    assert len({id(r) for r in three}) == 3 and all(r._lru.capacity == 1 << 30 for r in three)


async def settled(engine: AsyncLLM, want: bool, timeout_s: float = 10.0) -> dict:
    """P1's latest stats once the receiver layer is (or is not) there and its digest matches P0's."""
    engine.start()
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        caches = engine.stats().caches
        receiver = caches.get("ipc_receiver")
        done = receiver is None if not want else (receiver is not None
                                                   and receiver.keys_digest == caches["ipc"].keys_digest)
        if done or asyncio.get_running_loop().time() > deadline:
            return caches
        await asyncio.sleep(0.05)


def test_p0_and_p1_hold_the_same_ipc_keys(path):
    engine = AsyncLLM(EngineConfig.from_kwargs(model=path, mm_ipc_cache_gb=2.5 * ITEM_BYTES / (1 << 30)))
    try:
        for i, seed in enumerate([1, 2, 1, 3, 4, 2, 5, 1]):  # hits, misses, evictions
            generate(engine, one(seed), f"r{i}")
        with pytest.raises(ValueError):  # refused in P0 before anything is sent
            asyncio.run(_run(engine, one(6), SamplingParams(max_tokens=10**9)))
        caches = asyncio.run(settled(engine, want=True))
        sender, receiver = caches["ipc"], caches["ipc_receiver"]
        assert sender.evictions > 0 and sender.entries >= 1
        assert (receiver.keys_digest, receiver.entries, receiver.bytes_used) == (
            sender.keys_digest, sender.entries, sender.bytes_used)
        assert sender.keys_digest != 0
    finally:
        engine.shutdown()


def test_under_shm_p1_reports_no_ipc_receiver(path):
    engine = AsyncLLM(EngineConfig.from_kwargs(model=path, mm_cache_type="shm", mm_shm_cache_gb=0.01,
                                               mm_shm_max_object_mb=0.001))  # every item inline
    try:
        for seed in range(6):
            generate(engine, one(seed), f"s{seed}")
        caches = asyncio.run(settled(engine, want=False))
        assert "ipc_receiver" not in caches and caches["shm"].fallbacks == 6
    finally:
        engine.shutdown()


async def _run(engine: AsyncLLM, prompt: dict, params: SamplingParams) -> None:
    async for _ in engine.generate("bad", prompt, params):
        pass

