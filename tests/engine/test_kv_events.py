"""KV events without a server: the log the KV cache manager writes (one story per key), the
events it becomes, the wire format as an independent decoder reads it, and per-rank addresses."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq

from mmserve.config import EngineConfig
from mmserve.engine.block_hash import BlockHasher
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.kv_event_publisher import ZmqEventPublisher
from mmserve.engine.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventLog,
                                     to_events)
from mmserve.engine.request import Request
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.kv_events_config import KVEventsConfig
from mmserve.sampling_params import SamplingParams

BS = 4


def request(rid: str, tokens: list[int], items: list[MultiModalItem] = ()) -> Request:
    hasher = BlockHasher(BS)
    hasher.keep_extra_keys = True
    return Request(rid, tokens, list(items), SamplingParams(max_tokens=1), None, 0.0, cache_salt="s",
                   block_hasher=hasher)


def managed(num_blocks: int) -> tuple[KVCacheManager, KVEventLog]:
    kv, log = KVCacheManager(num_blocks, BS), KVEventLog(BS)
    kv.attach_events(log)
    return kv, log


def store(kv: KVCacheManager, log: KVEventLog, req: Request) -> None:
    kv.allocate_slots(req.request_id, req.num_tokens)
    stored = kv.cache_full_blocks(req.request_id, req.block_hashes, req.num_tokens)
    if stored:
        log.stored(req, stored)


def test_stored_blocks_carry_the_hashers_extra_keys_and_chain():
    item = MultiModalItem("image", "h1", None, PlaceholderRange(offset=2, length=5))
    kv, log = managed(8)
    req = request("a", list(range(12)), [item])
    store(kv, log, req)
    (event,) = to_events(log.take(), BS)
    assert isinstance(event, BlockStored) and event.parent_block_hash is None
    assert event.block_hashes == req.block_hashes and event.token_ids == list(range(12))
    assert len(req.block_extra_keys) == 3 and event.extra_keys == [k or None for k in req.block_extra_keys]
    first, second, third = event.extra_keys
    assert first[0][:3] == ("mm", "h1", 2) and first[-1] == ("salt", "s")  # as hashed (a position key may follow)
    assert second[0][:3] == ("mm", "h1", -2) and third is None  # no item and no salt in the third block


def test_one_stored_and_one_removed_per_key():
    kv, log = managed(4)
    a, b = request("a", [1, 2, 3, 4, 5, 6, 7, 8]), request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    store(kv, log, a)
    kv.allocate_slots("b", 8)  # the same prompt computed at once: its own blocks, same keys
    assert kv.cache_full_blocks("b", b.block_hashes, 8) == []  # no key is new: nothing to publish
    kv.free("a")
    kv.free("b")
    kv.allocate_slots("c", 16)  # takes every block: both blocks of each key
    events = to_events(log.take(), BS)
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert len([e for e in events if isinstance(e, BlockStored)]) == 1
    assert sorted(removed) == sorted(a.block_hashes)  # each key once, when its last block went
    kv.check_integrity()


def test_a_prefix_reset_drops_every_key_as_one_clear_and_a_running_request_keeps_its_blocks():
    kv, log = managed(6)
    a, b = request("a", list(range(8))), request("b", list(range(100, 108)))
    store(kv, log, a)
    store(kv, log, b)
    kv.free("b")  # a runs on; b's blocks are free but keyed
    log.take()
    assert kv.reset_prefix_cache() == 4 and kv.pool.num_evictions == 0  # a reset is not an eviction
    assert to_events(log.take(), BS) == [AllBlocksCleared()]  # one clear, no BlockRemoved per key
    assert kv.find_cached_prefix(a.block_hashes, 2) == [] and kv.find_cached_prefix(b.block_hashes, 2) == []
    assert kv.get_block_ids("a") == [0, 1] and kv.pool.num_cached_blocks == 0
    kv.check_integrity()  # a's registered blocks lost their keys: allowed for a request kept over a reset
    more = request("a", list(range(12)))  # a's next block, completed after the reset
    kv.allocate_slots("a", 12)
    assert kv.cache_full_blocks("a", more.block_hashes, 12) == [2]  # only the new block is registered
    assert kv.find_cached_prefix(more.block_hashes, 3) == []  # unreachable: its first blocks have no key
    kv.check_integrity()
    kv.free("a")
    kv.check_integrity()


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


@pytest.mark.parametrize("encoding, removed", [
    ("map", {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"}),  # vLLM since #42892
    ("array", ["BlockRemoved", [b"\x01" * 32], "GPU"]),  # vLLM before it
])
def test_the_wire_format_is_vllms_positional_batch_of_tagged_events(tmp_path, encoding, removed):
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp_path}/ev",
                            topic="kv", event_encoding=encoding)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    publisher = ZmqEventPublisher(config, 1, 2, BS)
    try:
        sub.connect(config.for_rank(1, 2)[0])
        frames: list[list[bytes]] = []
        while sum(b"BlockRemoved" in f[2] for f in frames) < 2:  # the first opens with AllBlocksCleared
            publisher.publish([(1, b"\x01" * 32)])  # until they arrive (the subscription takes a moment)
            while sub.poll(200):
                frames.append(sub.recv_multipart())
        topic, seq, payload = [f for f in frames if b"BlockRemoved" in f[2]][-1]
        batch = msgspec.msgpack.decode(payload, type=Batch)
        assert topic == b"kv.dp1" and len(seq) == 8 and batch.data_parallel_rank == 1
        assert batch.events == [removed]
        if encoding == "map":
            assert msgspec.msgpack.decode(payload, type=KVEventBatch).events == [BlockRemoved([b"\x01" * 32], "GPU")]
    finally:
        publisher.shutdown()
        sub.close(linger=0)
        ctx.term()


def test_ranks_get_their_own_endpoint_and_topic():
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5557", topic="kv-events")
    assert config.for_rank(0, 1) == ("tcp://*:5557", None, "kv-events")
    assert config.for_rank(2, 4) == ("tcp://*:5559", None, "kv-events.dp2")
    ipc = KVEventsConfig(endpoint="ipc:///tmp/x", replay_endpoint="ipc:///tmp/r")
    assert ipc.for_rank(1, 2) == ("ipc:///tmp/x_dp1", "ipc:///tmp/r_dp1", "dp1")


@pytest.mark.parametrize("bad", [{"enable_kv_cache_events": True, "publsher": "zmq"}, {"publisher": "kafka"},
                                 {"endpoint": "http://x"}])
def test_a_bad_config_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="kv_events_config"):
        EngineConfig.from_kwargs(kv_events_config=bad)
