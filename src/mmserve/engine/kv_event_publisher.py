"""One engine core's KV event publisher: a PUB socket fed by a thread, a replay endpoint served by another.

The engine step hands its records to a bounded queue (`publish`, never blocking); the publishing
thread turns them into vLLM's batches (`kv_events.py`), numbers them (0, 1, 2, ... from the core's
start: a restarted core starts at 0 again) and sends them. Batch 0 is `AllBlocksCleared`, and the
first batch of changes opens with another one, sent no sooner than `JOIN_GRACE_S` after the start
(the changes wait in the queue meanwhile), so a subscriber that joins after the start (ZMQ's slow
joiner, a router's SUB socket reconnecting after the core's restart: every 100 ms by default)
still drops what the core's previous life held before it reads the new blocks.

Replay (vLLM's protocol, with a `replay_endpoint`): a ROUTER socket, served by its own thread so
a client that reaches it never delays live events, answers (client, b"", 8-byte sequence number)
with every kept batch from that number on, then (-1, b""). The kept batches (`ReplayBuffer`) are
bounded by `buffer_steps` and by `buffer_bytes` of payload; batch 0 is kept apart, so a replay from
0 always starts with `AllBlocksCleared`. Without a replay endpoint nothing is kept.

Failure: if the publishing thread dies, it logs why and KV events are off for this core (later
records are dropped); the engine serves on and `shutdown` does not wait on it. ipc:// addresses
this publisher bound are removed at `shutdown`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any

import msgspec

from mmserve.engine.kv_events import AllBlocksCleared, EventBatch, KVEventLog, Record, to_events
from mmserve.kv_events_config import KVEventsConfig

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.1  # how often the threads check that they should stop
JOIN_GRACE_S = 1.0  # the first change waits this long after the start for subscribers to (re)connect


class ReplayBuffer:
    """The last batches for replay, within `max_batches` and `max_bytes` of payload; thread-safe.

    Oldest dropped first; batch 0 (`AllBlocksCleared`) is kept apart, outside both bounds."""

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._first: bytes | None = None
        self._batches: deque[tuple[int, bytes]] = deque()
        self._lock = threading.Lock()

    def add(self, seq: int, payload: bytes) -> None:
        with self._lock:
            if seq == 0:
                self._first = payload
                return
            self._batches.append((seq, payload))
            self.used_bytes += len(payload)
            while len(self._batches) > self.max_batches or self.used_bytes > self.max_bytes:
                self.used_bytes -= len(self._batches.popleft()[1])

    def since(self, first: int) -> list[tuple[int, bytes]]:
        """The kept batches numbered `first` or later, in order."""
        with self._lock:
            head = [(0, self._first)] if first <= 0 and self._first is not None else []
            return head + [(seq, payload) for seq, payload in self._batches if seq >= first]


def _is_bound(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or local address is bound, another is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes one rank's batches from a thread: PUB socket, optional ROUTER for replay."""

    def __init__(self, config: KVEventsConfig, rank: int, data_parallel_size: int, block_size: int) -> None:
        import zmq

        self.rank = rank
        self.block_size = block_size
        self.positional = config.event_encoding == "array"
        endpoint, replay, topic = config.for_rank(rank, data_parallel_size)
        self.topic = topic.encode()
        self._queue: queue.Queue[list[Record] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._stop = threading.Event()
        self.failed = threading.Event()  # the publishing thread died: events are off
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._bound = [endpoint] if _is_bound(endpoint) else []
        (self._pub.bind if self._bound else self._pub.connect)(endpoint)
        self.buffer: ReplayBuffer | None = None
        self._threads = [threading.Thread(target=self._run, name="kv-events", daemon=True)]
        if replay is not None:
            self.buffer = ReplayBuffer(config.buffer_steps, config.buffer_bytes)
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay)
            self._bound.append(replay)
            self._threads.append(threading.Thread(target=self._serve_replay, name="kv-events-replay", daemon=True))
        for thread in self._threads:
            thread.start()
        logger.info("publishing KV events on %s (topic %r)", endpoint, topic)

    def publish(self, records: list[Record]) -> None:
        """Queue one step's records (dropped, with a warning, when the queue is full)."""
        try:
            self._queue.put_nowait(records)
        except queue.Full:
            logger.warning("KV events queue full: %d records dropped", len(records))

    def shutdown(self) -> None:
        """Stop both threads (neither is waited on past 2 s), close the sockets, remove bound ipc files."""
        self._stop.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # the thread sees `_stop` within `_POLL_S`
        for thread in self._threads:
            thread.join(timeout=2.0)
        self._ctx.destroy(linger=0)
        for address in self._bound:
            if address.startswith("ipc://") and os.path.exists(address[len("ipc://"):]):
                os.unlink(address[len("ipc://"):])

    def _run(self) -> None:
        try:
            self._publish_loop()
        except Exception:
            logger.exception("the KV events publisher of rank %d failed: KV events are off for this engine core, "
                             "which serves on", self.rank)
            self.failed.set()  # after the log line: whoever waits on it finds the reason logged

    def _publish_loop(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = count()
        self._send(encoder, next(seq), [AllBlocksCleared()])  # a new engine core holds nothing yet
        joined_by = time.monotonic() + JOIN_GRACE_S
        cleared_again = False
        while not self._stop.is_set():
            try:
                records = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if records is None:
                return
            events: list[Any] = to_events(records, self.block_size)
            if not cleared_again:  # for subscribers that joined after batch 0
                self._stop.wait(max(0.0, joined_by - time.monotonic()))
                events.insert(0, AllBlocksCleared())
                cleared_again = True
            self._send(encoder, next(seq), events)

    def _send(self, encoder: msgspec.msgpack.Encoder, seq: int, events: list[Any]) -> None:
        if self.positional:
            events = [[type(e).__name__, *msgspec.structs.astuple(e)] for e in events]
        payload = encoder.encode(EventBatch(time.time(), events, self.rank))
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        if self.buffer is not None:
            self.buffer.add(seq, payload)

    def _serve_replay(self) -> None:
        assert self.buffer is not None
        try:
            while not self._stop.is_set():
                if not self._replay.poll(int(_POLL_S * 1000)):
                    continue
                frames = self._replay.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue
                client, _, start = frames
                for seq, payload in self.buffer.since(int.from_bytes(start, "big", signed=True)):
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                self._replay.send_multipart((client, b"", END_SEQ, b""))
        except Exception:  # the context was destroyed under it (shutdown), or a socket failed
            if not self._stop.is_set():
                logger.exception("the KV events replay endpoint of rank %d failed", self.rank)


class KVEvents:
    """An engine core's KV events: the log the scheduler and pool write, the rank's publisher."""

    def __init__(self, config: KVEventsConfig, rank: int, data_parallel_size: int, block_size: int) -> None:
        self.log = KVEventLog(block_size)
        self.publisher = ZmqEventPublisher(config, rank, data_parallel_size, block_size)

    def end_step(self) -> None:
        """Hand the step's records to the publisher thread (nothing when there are none or it died)."""
        records = self.log.take()
        if records and not self.publisher.failed.is_set():
            self.publisher.publish(records)

    def shutdown(self) -> None:
        self.end_step()
        self.publisher.shutdown()


def make_kv_events(config: KVEventsConfig | None, rank: int, data_parallel_size: int,
                   block_size: int) -> KVEvents | None:
    """The engine core's KV events, or None when none are published."""
    if config is None or not config.publishes:
        return None
    return KVEvents(config, rank, data_parallel_size, block_size)
