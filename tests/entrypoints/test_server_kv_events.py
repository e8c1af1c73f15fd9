"""KV events in vLLM's wire format (issue 41): a ZMQ subscriber decodes the server's batches with
its own msgspec types (vLLM's, written here from its format), sees the blocks of two requests with
the same image carry that image's hash in their extra keys, and sees evictions published; with
data parallelism each rank publishes on its own endpoint under its own topic."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from mmserve.multimodal.hasher import ItemHasher
from mmserve.multimodal.processing import create_processor
from helpers.server_process import ServerProcess, data_url
from helpers.tiny_models import make_checkpoint, make_image

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # maps, as vLLM since #42892
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def chat(server: ServerProcess, system: str, url: str, **headers: str) -> None:
    body = {"model": "m", "max_tokens": 2, "temperature": 0.0, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]}]}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60, headers=headers)
    assert r.status_code == 200


def receive(sub: zmq.Socket, decoder: msgspec.msgpack.Decoder, quiet_s: float = 1.0, topic: bytes = b"kv-events",
            rank: int = 0) -> list[Any]:
    """Every event until none has come for `quiet_s`, checking the frames and sequence numbers."""
    events, seqs = [], []
    while sub.poll(int(quiet_s * 1000)):
        got, seq, payload = sub.recv_multipart()
        assert got == topic
        seqs.append(int.from_bytes(seq, "big"))
        batch = decoder.decode(payload)
        assert batch.data_parallel_rank == rank and batch.ts > 0
        events += batch.events
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True
    return events


def subscribe(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(endpoint)
    return sub


def test_blocks_carry_their_images_hash_and_evictions_are_published(tmp_path):
    model = make_checkpoint(tmp_path / "model")
    endpoint = f"ipc://{tmp_path}/kv-events"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv-events"}
    ctx = zmq.Context()
    server = ServerProcess(model, "--served-model-name", "m", "--max-model-len", "256", "--num-kv-blocks", "20",
                           "--kv-events-config", json.dumps(config))
    sub = subscribe(ctx, endpoint)
    try:
        time.sleep(0.5)  # ZMQ's slow joiner: the subscription reaches the publisher
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        url = data_url(make_image(1))
        chat(server, "First.", url)
        chat(server, "Second, a longer system turn.", url)
        stored = [e for e in receive(sub, decoder) if isinstance(e, BlockStored)]
        raw = base64.b64decode(url.split(",", 1)[1])
        want = ItemHasher(model, create_processor(model).settings()).hash_item("image", raw)
        for event in stored:
            assert len(event.block_hashes) == len(event.extra_keys) and event.block_size == 16
            assert len(event.token_ids) == 16 * len(event.block_hashes)
        mm_keys = [key for e in stored for keys in e.extra_keys if keys for key in keys if key[0] == "mm"]
        assert {key[1] for key in mm_keys} == {want}  # both requests' image blocks, keyed by the image
        starts = [e for e in stored if e.parent_block_hash is None]  # each prompt's blocks, stored in one step
        assert len(starts) == 2 and all(any(k and k[0][0] == "mm" for k in e.extra_keys) for e in starts)
        later: list[Any] = []
        for seed in range(2, 12):  # new images until the 20 blocks must be reused
            chat(server, "Another.", data_url(make_image(seed)))
            later += receive(sub, decoder, 0.3)
            if any(isinstance(e, BlockRemoved) for e in later):
                break
        removed = {h for e in later if isinstance(e, BlockRemoved) for h in e.block_hashes}
        ever_stored = {h for e in stored + later if isinstance(e, BlockStored) for h in e.block_hashes}
        assert removed and removed <= ever_stored
    finally:
        server.stop()
        sub.close(linger=0)
        ctx.term()


def test_each_data_parallel_rank_publishes_its_own_events(tmp_path):
    model = make_checkpoint(tmp_path / "model")
    endpoint = f"ipc://{tmp_path}/kv-events"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv-events"}
    ctx = zmq.Context()
    server = ServerProcess(model, "--served-model-name", "m", "--max-model-len", "256", "--data-parallel-size", "2",
                           "--kv-events-config", json.dumps(config))
    subs = [subscribe(ctx, endpoint), subscribe(ctx, endpoint + "_dp1")]
    try:
        time.sleep(0.5)
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        for rank, sub in enumerate(subs):
            chat(server, f"Rank {rank}.", data_url(make_image(20 + rank)), **{"X-Data-Parallel-Rank": str(rank)})
            events = receive(sub, decoder, topic=f"kv-events.dp{rank}".encode(), rank=rank)
            assert any(isinstance(e, BlockStored) for e in events)
        assert not subs[0].poll(300)  # rank 1's request published nothing on rank 0's socket
    finally:
        server.stop()
        for sub in subs:
            sub.close(linger=0)
        ctx.term()


def test_a_restarted_engine_core_tells_subscribers_to_clear_before_its_new_blocks(tmp_path):
    """Regression (issue 49): after kill -9 of the engine core, the restarted core's AllBlocksCleared
    went out before the subscriber had reconnected, so a router kept the dead core's blocks."""
    import os
    import signal

    from helpers.server_process import children_titled

    model = make_checkpoint(tmp_path / "model")
    endpoint = f"ipc://{tmp_path}/kv-events"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv-events"}
    ctx = zmq.Context()
    server = ServerProcess(model, "--served-model-name", "m", "--max-model-len", "256",
                           "--kv-events-config", json.dumps(config))
    sub = subscribe(ctx, endpoint)
    try:
        time.sleep(0.5)
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        chat(server, "Before.", data_url(make_image(30)))
        assert any(isinstance(e, BlockStored) for e in receive(sub, decoder))
        victim = children_titled(server, "engine_dp0")["mmserve::engine_dp0"]
        os.kill(victim, signal.SIGKILL)
        chat(server, "After.", data_url(make_image(31)))  # waits for the restart
        events = receive(sub, decoder)
        kinds = [type(e).__name__ for e in events]
        assert "AllBlocksCleared" in kinds and "BlockStored" in kinds, kinds
        assert kinds.index("AllBlocksCleared") < kinds.index("BlockStored")
    finally:
        server.stop()
        sub.close(linger=0)
        ctx.term()
    assert not os.path.exists(endpoint[len("ipc://"):])  # removed at a normal stop
