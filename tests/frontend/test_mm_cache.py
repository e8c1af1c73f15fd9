"""The multimodal input caches through a real engine-core process (AsyncLLM <-> P1)."""

from __future__ import annotations


import pytest

from helpers.mm_prompts import PARAMS, PROMPT, TWO, generate, one, url
from mmserve import LLM
from mmserve.config import EngineConfig
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from helpers.tiny_models import llava_item_bytes, make_checkpoint

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mmcache"))


@pytest.fixture(scope="module")
def expected(path):
    """Greedy tokens of the offline engine (no IPC, processor cache off) per prompt key."""
    llm = LLM(model=path, mm_processor_cache_gb=0)
    prompts = {"a": one(1), "b": one(2), "ab": {"prompt": TWO, "multi_modal_data": {"image": [url(1), url(2)]}}}
    outs = llm.generate(list(prompts.values()), PARAMS)
    return {k: o.outputs[0].token_ids for k, o in zip(prompts, outs)}


@pytest.mark.parametrize("processor_gb, ipc_gb", [(4, 4), (0, 4), (4, 0), (0, 0)])
def test_every_combination_gives_the_same_tokens(path, expected, processor_gb, ipc_gb):
    engine = AsyncLLM(EngineConfig.from_kwargs(model=path, mm_processor_cache_gb=processor_gb,
                                               mm_ipc_cache_gb=ipc_gb))
    try:
        assert generate(engine, one(1), "r1") == expected["a"]
        assert generate(engine, one(1), "r2") == expected["a"]
        two = {"prompt": TWO, "multi_modal_data": {"image": [url(1), url(2)]}}
        assert generate(engine, two, "r3") == expected["ab"]
        stats = engine.stats().caches
        processed = engine.input_processor.items.num_processed  # image processor runs
        assert processed == (2 if processor_gb else 4)  # cached: image 1 once, image 2 once
        sent_by_hash = stats["ipc"].hits
        assert sent_by_hash == (2 if ipc_gb else 0)  # image 1 in r2 and r3 crossed as its hash
        if ipc_gb:
            assert stats["ipc"].bytes_saved == 2 * llava_item_bytes(42)  # two 42 x 42 images
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def engine(path):
    e = AsyncLLM(EngineConfig.from_kwargs(model=path))
    yield e
    e.shutdown()


def test_drift_from_a_lost_update_heals(engine, expected):
    fake = MultiModalItem("image", "", None, PlaceholderRange(0, 1))
    request = engine.input_processor.process("probe", one(2), PARAMS)
    fake.mm_hash, fake.data = request.mm_items[0].mm_hash, request.mm_items[0].data
    engine.transport.sender.update([fake])  # P0 now believes P1 holds image 2; P1 never got it
    assert generate(engine, one(2), "lost") == expected["b"]
    assert engine.transport.sender.keys() == [fake.mm_hash]  # a new epoch, with just the resent item


def test_drift_from_a_cleared_engine_core_cache_heals(engine, expected):
    assert generate(engine, one(1), "warm") == expected["a"]
    probe = EngineCoreRequest("clear-p1", [1, 2], [], PARAMS, None, 0.0, ipc_epoch=engine.transport.sender.epoch + 5)
    engine.client.add_request(probe)  # P1 empties its cache for an epoch P0 is not in
    hits = engine.transport.sender.stats().hits
    assert generate(engine, one(1), "after-clear") == expected["a"]
    assert engine.transport.sender.stats().hits == hits + 1  # sent by hash, missed in P1, resent in full


def test_uuid_replaces_hashing_and_alone_reuses_the_image(engine, expected):
    first = {"prompt": PROMPT, "multi_modal_data": {"image": url(1)}, "multi_modal_uuids": {"image": ["cat"]}}
    assert generate(engine, first, "u1") == expected["a"]
    alone = {"prompt": PROMPT, "multi_modal_data": {"image": [None]}, "multi_modal_uuids": {"image": ["cat"]}}
    assert generate(engine, alone, "u2") == expected["a"]
    unknown = {"prompt": PROMPT, "multi_modal_data": {"image": [None]}, "multi_modal_uuids": {"image": ["dog"]}}
    with pytest.raises(ValueError, match="send the image again"):
        generate(engine, unknown, "u3")


def test_salt_isolates_tenants(engine, expected):
    before = engine.stats().caches["processor"]
    assert generate(engine, one(1, cache_salt="tenant-a"), "s1") == expected["a"]
    assert generate(engine, one(1, cache_salt="tenant-b"), "s2") == expected["a"]
    assert generate(engine, one(1, cache_salt="tenant-a"), "s3") == expected["a"]
    after = engine.stats().caches["processor"]
    assert (after.queries - before.queries, after.hits - before.hits) == (3, 1)


def test_a_rejected_request_leaves_no_cache_entry(engine):
    before = engine.stats().caches["processor"].entries
    too_long = {"prompt": PROMPT + " word" * 5000, "multi_modal_data": {"image": url(77)}}
    with pytest.raises(ValueError, match="max_model_len"):
        generate(engine, too_long, "bad")
    assert engine.stats().caches["processor"].entries == before


def test_a_burst_of_one_new_image_runs_the_processor_once(path):
    from concurrent.futures import ThreadPoolExecutor

    from mmserve.frontend.input_processor import InputProcessor
    from mmserve.models.hf_config import eos_token_id

    inputs = InputProcessor(EngineConfig.from_kwargs(model=path), path, 512, eos_token_id(path))
    with ThreadPoolExecutor(8) as pool:
        requests = list(pool.map(lambda i: inputs.process(f"r{i}", one(321), PARAMS), range(8)))
    assert inputs.items.num_processed == 1
    assert all(r.mm_items[0].data["pixel_codes"].equal(requests[0].mm_items[0].data["pixel_codes"])
               for r in requests)
    with pytest.raises(ValueError):  # a bad image fails every waiter, and nothing is left in flight
        list(ThreadPoolExecutor(4).map(lambda i: inputs.process(f"b{i}", {
            "prompt": PROMPT, "multi_modal_data": {"image": "data:image/png;base64,aGVsbG8="}}, PARAMS), range(4)))
    assert inputs.items.inflight.futures == {}
    too_long = {"prompt": PROMPT + " word" * 5000, "multi_modal_data": {"image": url(322)}}
    with pytest.raises(ValueError, match="max_model_len"):
        inputs.process("long", too_long, PARAMS)
    assert inputs.items.inflight.futures == {}  # a rejected request releases what it processed
