"""The KV event publisher under faults (issue 49): `AllBlocksCleared` reaches a subscriber that
joined after the engine core started (regression: only batch 0, sent before anyone could join,
carried it, so a router kept a restarted core's old blocks); replay is kept only with a replay
endpoint and within `buffer_bytes`, answered by its own thread and always from `AllBlocksCleared`;
a publishing thread that dies turns events off without hanging `shutdown` (regression: the queue
filled and `shutdown`'s blocking put waited for good); bound ipc files go at `shutdown`."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import zmq

from mmserve.engine.kv_event_publisher import END_SEQ, ZmqEventPublisher
from mmserve.engine.kv_events import REMOVED, STORED, KVEventBatch
from mmserve.kv_events_config import KVEventsConfig

BS = 4
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def config(tmp_path, **extra) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp_path}/ev", **extra)


def names(payload: bytes) -> list[str]:
    return [type(e).__name__ for e in DECODER.decode(payload).events]


def test_a_subscriber_that_joins_after_the_start_is_told_to_clear(tmp_path):
    publisher = ZmqEventPublisher(config(tmp_path), 0, 1, BS)
    ctx = zmq.Context()
    try:
        time.sleep(0.3)  # batch 0 has gone to nobody
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{tmp_path}/ev")
        time.sleep(0.3)  # the subscription reaches the publisher
        publisher.publish([(STORED, b"\x01" * 32, None, [1, 2, 3, 4], ())])
        assert sub.poll(5000)
        _, seq, payload = sub.recv_multipart()
        assert int.from_bytes(seq, "big") == 1 and names(payload) == ["AllBlocksCleared", "BlockStored"]
        publisher.publish([(REMOVED, b"\x01" * 32)])
        assert sub.poll(5000) and names(sub.recv_multipart()[2]) == ["BlockRemoved"]  # once, not every batch
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    got = []
    while sock.poll(5000):
        _, seq, payload = sock.recv_multipart()
        if seq == END_SEQ:
            break
        got.append((int.from_bytes(seq, "big"), payload))
    sock.close(linger=0)
    return got


def test_replay_is_bounded_in_bytes_and_starts_with_a_clear(tmp_path):
    replay_at = f"ipc://{tmp_path}/replay"
    publisher = ZmqEventPublisher(config(tmp_path, replay_endpoint=replay_at, buffer_bytes=4000), 0, 1, BS)
    ctx = zmq.Context()
    try:
        for i in range(100):  # each batch ~200 bytes: 20,000 in all
            publisher.publish([(STORED, bytes([i]) * 32, None, list(range(40)), ())])
        deadline = time.monotonic() + 5
        while (not publisher.buffer.since(100)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 0 < publisher.buffer.used_bytes <= 4000
        got = replay(ctx, replay_at, 0)
        seqs = [seq for seq, _ in got]
        assert seqs[0] == 0 and names(got[0][1]) == ["AllBlocksCleared"]
        assert seqs[-1] == 100 and seqs[1:] == list(range(seqs[1], 101)) and len(seqs) < 40
        assert [seq for seq, _ in replay(ctx, replay_at, 99)] == [99, 100]
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)
    assert not os.path.exists(f"{tmp_path}/ev") and not os.path.exists(f"{tmp_path}/replay")


def test_nothing_is_kept_without_a_replay_endpoint(tmp_path):
    publisher = ZmqEventPublisher(config(tmp_path), 0, 1, BS)
    try:
        assert publisher.buffer is None
    finally:
        publisher.shutdown()


def test_a_dead_publishing_thread_turns_events_off_and_shutdown_does_not_hang(tmp_path, caplog):
    replay_at = f"ipc://{tmp_path}/replay"
    publisher = ZmqEventPublisher(config(tmp_path, replay_endpoint=replay_at, max_queue_size=2), 0, 1, BS)
    ctx = zmq.Context()
    publisher.publish([(STORED, b"\x02" * 32, None, [object()], ())])  # cannot be encoded: the thread dies
    assert publisher.failed.wait(5)
    assert "KV events are off" in caplog.text
    for _ in range(10):
        publisher.publish([(REMOVED, b"\x02" * 32)])  # a full queue drops; never blocks
    assert [seq for seq, _ in replay(ctx, replay_at, 0)] == [0]  # replay has its own thread: it still answers
    stopper = threading.Thread(target=publisher.shutdown)
    stopper.start()
    stopper.join(10)
    assert not stopper.is_alive()
    ctx.destroy(linger=0)
