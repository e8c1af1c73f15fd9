"""One item store per node, written by every API server (`--mm-cache-type shm`, several API servers).

The `ShmStore` (allocation, index, pins, eviction) lives once, in the launcher, and one
`NodeStoreServer` thread there applies every change to it, in the order the API servers' messages
arrive (ZMQ ROUTER over ipc://). Each API server holds a `NodeStoreClient`, which has the store's
interface (`lookup`, `put`, `discard`, `finish_request`, `stats`, `info`) and writes payloads
itself: `put` asks the owner to `reserve` a chunk (one round trip), writes the tensors through its
own writable mapping of the segment, and seals the chunk (a second round trip: once `put` returns,
every server finds the key). No payload byte crosses a socket. Engine cores and TP workers read
entries in place, as with one writer.

Many writers. The owner serialises every allocation and index change; a key being written is
invisible to lookups and refused to a second writer (which sends its item inline) until sealed,
and its chunk is pinned for the writer's request, so it is neither evicted nor moved meanwhile.
Pins are per (server, request): a server's request ids are prefixed with its index.

The processor cache, shared. `fetch(key)` copies out an entry some server wrote (an uncounted
`peek`: the asking server's processor cache counts it), so a repeat that lands on another API
server skips the image processor. One budget for the node: `--mm-shm-cache-gb`, not × M.

Failure. An ask the owner fails on is answered with the error (`StoreAnswer.error`): the asker
raises at once instead of waiting out `_ANSWER_TIMEOUT_S`. A server that dies between reserve
and seal leaves that chunk pinned; the launcher stops every process once an API server dies, so
the leak never outlives the store.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Mapping

import msgspec
import torch

from mmserve.ipc.items import ShmHandle, ShmStoreInfo
from mmserve.ipc.launcher_messages import (StoreAnswer, StoreDiscard, StoreDropUnused, StoreFinish, StoreInput,
                                           StoreLookup, StoreReserve, StoreSeal, StoreStatsAsk)
from mmserve.ipc.queues import ipc_address
from mmserve.ipc.round_trips import Asker, ServiceThread
from mmserve.item_store.shm_layout import layout, write_payload
from mmserve.item_store.shm_ring import HEADER_BYTES
from mmserve.ipc.shm_segment import open_segment, unmap_segment
from mmserve.item_store.shm_store import ShmStore, ShmStoreStats
from mmserve.item_store.shm_store_reader import ShmLease, ShmStoreReader


_ANSWER_TIMEOUT_S = 10.0


class NodeStoreServer:
    """The node store's owner, a thread in the launcher.

    The store's owner (in the launcher): binds `address` in `ipc_dir`; `start()` runs the
    thread (`ipc/round_trips.py: ServiceThread`), `close()` stops it and unlinks the segment."""

    def __init__(self, store: ShmStore, ipc_dir: str) -> None:
        self.store = store
        self._service = ServiceThread(ipc_address(ipc_dir, "node_store"), msgspec.msgpack.Decoder(StoreInput),
                                      self.handle, lambda seq, error: StoreAnswer(seq, error=error),
                                      "mmserve-node-store")
        self.address = self._service.address

    @property
    def info(self) -> bytes:
        """What readers and writers attach with (holds the handle secret: never log it)."""
        return msgspec.msgpack.encode(self.store.info)

    def start(self) -> None:
        self._service.start()

    def close(self) -> None:
        self._service.close()
        self.store.close()

    def handle(self, msg: StoreInput) -> StoreAnswer | None:
        """Apply one message to the store; the answer to send back, if it asks for one."""
        store = self.store
        if isinstance(msg, StoreLookup):
            handle = store.peek(msg.key) if msg.peek else store.lookup(msg.key, msg.request_id)
            return StoreAnswer(msg.seq, handle)
        if isinstance(msg, StoreReserve):
            handle, fresh = store.reserve(msg.key, msg.nbytes, msg.request_id)
            return StoreAnswer(msg.seq, handle, fresh)
        if isinstance(msg, StoreSeal):
            store.seal(msg.key, msg.ok)
            return StoreAnswer(msg.seq)
        if isinstance(msg, StoreDiscard):
            for key in msg.keys:
                store.discard(key)
        elif isinstance(msg, StoreFinish):
            store.finish_request(msg.request_id)
        elif isinstance(msg, StoreStatsAsk):
            return StoreAnswer(msg.seq, stats=list(dataclasses.astuple(store.stats)))
        elif isinstance(msg, StoreDropUnused):
            return StoreAnswer(msg.seq, dropped=store.drop_unused())
        return None


class NodeStoreClient:
    """An API server's writer and reader of the node's store.

    An API server's side: the `ShmStore` interface `ShmItemWriter` uses, answered by the owner
    at `address`, plus `fetch` for the processor cache. Thread-safe (the asker's lock around the
    socket, one around the reader: worker threads fetch while the event loop looks up and puts)."""

    def __init__(self, address: str, info: ShmStoreInfo, server_index: int) -> None:
        self.info = info
        self._prefix = f"s{server_index}:"
        self._asker = Asker(address, StoreAnswer, "the node's item store", _ANSWER_TIMEOUT_S)
        self._fd, self._map = open_segment(info.name, writable=True)
        self._buf = memoryview(self._map)
        self._reader = ShmStoreReader(info)
        self._lock = threading.Lock()  # around the reader

    def lookup(self, key: str, request_id: str | None = None) -> ShmHandle | None:
        """The handle of `key` (a counted query), pinned for `request_id`; or None."""
        return self._ask(lambda seq: StoreLookup(seq, key, self._pin(request_id))).handle

    def put(self, key: str, item: Mapping[str, torch.Tensor], request_id: str) -> ShmHandle | None:
        """Write `item` under `key` unless some server did.

        Write `item` under `key` unless some server did: its handle, or None (too big, no room,
        or another server is writing it now)."""
        meta, placements, nbytes = layout(item)
        answer = self._ask(lambda seq: StoreReserve(seq, key, nbytes, self._prefix + request_id))
        handle = answer.handle
        if handle is not None and answer.fresh:
            begin = handle.offset + HEADER_BYTES
            try:
                write_payload(self._buf[begin:begin + handle.nbytes], meta, placements)
            except BaseException:
                self._send(StoreSeal(0, key, ok=False))
                raise
            self._ask(lambda seq: StoreSeal(seq, key))
        return handle

    def fetch(self, key: str) -> dict[str, torch.Tensor] | None:
        """Private copies of the tensors of `key`'s entry (written by any server), or None."""
        handle = self._ask(lambda seq: StoreLookup(seq, key, peek=True)).handle
        if handle is None:
            return None
        with self._lock:
            lease = self._reader.get(handle)
            if lease is None:  # evicted since
                return None
            try:
                return lease.clone()
            finally:
                lease.release()

    def get(self, handle: ShmHandle) -> ShmLease | None:
        """Map an entry in place (tests); see `ShmStoreReader.get`."""
        with self._lock:
            return self._reader.get(handle)

    def discard(self, key: str) -> None:
        self._send(StoreDiscard([key]))

    def finish_request(self, request_id: str) -> None:
        self._send(StoreFinish(self._prefix + request_id))

    def drop_unused(self) -> int:
        """Drop every entry of the node's store that no request of any server pins (one round trip)."""
        return self._ask(StoreDropUnused).dropped

    @property
    def stats(self) -> ShmStoreStats:
        """The node's store: every server's queries, hits and writes (one round trip)."""
        return ShmStoreStats(*self._ask(StoreStatsAsk).stats or ())

    def close(self) -> None:
        with self._lock:
            self._reader.close()
            unmap_segment(self._buf, self._map)
            os.close(self._fd)
        self._asker.close()

    def _pin(self, request_id: str | None) -> str | None:
        return None if request_id is None else self._prefix + request_id

    def _send(self, msg: StoreInput) -> None:
        self._asker.send(msg)

    def _ask(self, make: Callable[[int], StoreInput]) -> StoreAnswer:
        """One round trip; RuntimeError if the owner fails or does not answer within `_ANSWER_TIMEOUT_S`."""
        return self._asker.ask(make)
