"""Shared-memory item store: P0 writes each item once; P1 and every TP worker read it in place by handle.

`--mm-cache-type shm`.

Contract.
- `ShmStore` is the single writer (P0). `put(key, item)` lays an absent key's tensors out in one
  `ShmRing` chunk (`u32 meta length | msgpack [[name, dtype, shape, offset, nbytes], ...] |
  tensor bytes`, each tensor 64-byte aligned) and returns a `ShmHandle`; a present key returns
  its handle without writing (a key names its content: same key, same bytes). With several API
  servers the store lives in the launcher and the servers write through it (`item_store/node_store.py`):
  `reserve` allocates a pinned chunk the asking process fills, `seal` makes it an entry.
- `lookup(key)` is the counted query (`peek`: an uncounted one); a hit gives the entry a CLOCK second chance (up to
  `MAX_HITS`), so entries that keep getting hits outlive cold ones (policy: see shm_ring).
- `put` / `lookup` with a `request_id` pin the entry until `finish_request(request_id)`: a pinned
  entry is neither evicted nor moved, so the handles an in-flight request carries stay valid.
  Entries nobody pins or reads are evicted by the ring's hand when room is needed.
- `put` returns None when the item exceeds `max_object_bytes` or no contiguous run can be freed
  (pins everywhere); the caller sends the item inline. A refused put may have evicted cold
  entries on its way; it writes nothing.
- Handles carry `tag` = keyed BLAKE2b (a MAC, like HMAC) of (offset, chunk id, nbytes, key) under
  a per-store secret that readers get in `ShmStoreInfo` at attach time and that is never written
  to the segment. A reader raises ShmHandleError for a tag that does not verify (forged,
  tampered, another store's) and returns None for a stale handle (entry evicted, moved or
  cleared): the chunk header must hold the same id and tag, which no other allocation can.
- `ShmStoreReader.get(handle)` returns a `ShmLease`: zero-copy, read-only tensor views, valid
  until `release()`; the reader's lock keeps the chunk alive until then. Clone what you keep.
- `clear()` invalidates every handle and drops every pin; chunks a reader holds are freed after.

Not thread-safe: one thread per store / reader.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import Counter
from collections.abc import Mapping

import torch

from mmserve.ipc.items import ShmHandle, ShmStoreInfo
from mmserve.item_store.shm_layout import layout, write_payload
from mmserve.item_store.shm_store_reader import ShmLease, ShmStoreReader, sign
from mmserve.item_store.shm_ring import ALIGN, HEADER_BYTES, MAX_HITS, Chunk, ShmRing


@dataclasses.dataclass
class ShmStoreStats:
    """The writer's counters since start and its current size (metrics layer "shm")."""

    queries: int = 0  # lookup() calls
    hits: int = 0  # lookup() calls that found the key
    puts: int = 0  # items written
    bytes_written: int = 0  # payload bytes put() wrote
    bytes_saved: int = 0  # payload bytes of every handle handed out: kept off the P0 -> P1 wire
    evictions: int = 0  # entries the hand evicted or clear() dropped
    relocations: int = 0  # hot entries re-inserted at the tail
    fallbacks_oversize: int = 0  # put() refused: over max_object_bytes
    fallbacks_full: int = 0  # put() refused: no contiguous room could be freed
    entries: int = 0
    bytes_used: int = 0  # chunk bytes of the entries, headers included

    @property
    def fallbacks(self) -> int:
        return self.fallbacks_oversize + self.fallbacks_full

class ShmStore:
    """The single writer: keys -> entries in a shared-memory ring of `capacity_bytes`."""

    def __init__(self, capacity_bytes: int, max_object_bytes: int | None = None) -> None:
        capacity = capacity_bytes // ALIGN * ALIGN
        self._secret = secrets.token_bytes(32)
        self.max_object_bytes = min(capacity - HEADER_BYTES, capacity if max_object_bytes is None else max_object_bytes)
        self._entries: dict[str, Chunk] = {}
        self._sealing: dict[str, Chunk] = {}  # reserved, being written by another process
        self._requests: dict[str, list[Chunk]] = {}  # request id -> entries it pins
        self._stats = ShmStoreStats()
        self._ring = ShmRing(capacity, self._sign_chunk, self._on_evict)
        self._reader: ShmStoreReader | None = None

    @classmethod
    def from_flags(cls, mm_shm_cache_gb: float, mm_shm_max_object_mb: float) -> ShmStore:
        """Sized by `--mm-shm-cache-gb` (GiB) and `--mm-shm-max-object-mb` (MiB)."""
        return cls(int(mm_shm_cache_gb * 2**30), int(mm_shm_max_object_mb * 2**20))

    @property
    def info(self) -> ShmStoreInfo:
        return ShmStoreInfo(self._ring.name, self._ring.capacity, self._secret)

    def contains(self, key: str) -> bool:
        """Whether `key` has an entry; counts nothing, touches nothing."""
        return key in self._entries

    def lookup(self, key: str, request_id: str | None = None) -> ShmHandle | None:
        """The handle of `key` (a hit: one more second chance), pinned for `request_id`; or None."""
        self._stats.queries += 1
        chunk = self._entries.get(key)
        if chunk is None:
            return None
        self._stats.hits += 1
        chunk.hits = min(chunk.hits + 1, MAX_HITS)
        return self._hand_out(chunk, request_id)

    def peek(self, key: str) -> ShmHandle | None:
        """The handle of `key`, or None; counts nothing, gives no hit, pins nothing."""
        chunk = self._entries.get(key)
        return None if chunk is None else _handle(chunk)

    def put(self, key: str, item: Mapping[str, torch.Tensor], request_id: str | None = None) -> ShmHandle | None:
        """Write `item` under `key` unless present; its handle, or None (too big, or no room)."""
        chunk = self._entries.get(key)
        if chunk is not None:
            return self._hand_out(chunk, request_id)
        meta, placements, nbytes = layout(item)
        chunk = self._allocate(key, nbytes)
        if chunk is None:
            return None
        write_payload(self._ring.payload(chunk), meta, placements)
        self._sealing[key] = chunk
        self.seal(key)
        return self._hand_out(chunk, request_id)

    def reserve(self, key: str, nbytes: int, request_id: str) -> tuple[ShmHandle | None, bool]:
        """`put` for a writer in another process.

        `put` for a writer in another process (`item_store/node_store.py`), which fills the payload itself:
        `(handle, True)` for a new chunk of `nbytes` pinned for `request_id`, to write and then
        `seal`; `(handle, False)` for a present key; `(None, False)` when the item is too big, no
        room can be freed, or another writer is filling the key now. Until sealed, lookups miss."""
        chunk = self._entries.get(key)
        if chunk is not None:
            return self._hand_out(chunk, request_id), False
        if key in self._sealing or (chunk := self._allocate(key, nbytes)) is None:
            return None, False
        self._sealing[key] = chunk
        return self._hand_out(chunk, request_id), True

    def seal(self, key: str, ok: bool = True) -> None:
        """End a reservation: written (an entry) or abandoned (an orphan).

        The reserved `key`'s payload is written (`ok`: it becomes an entry) or abandoned (its
        chunk becomes an orphan). An unknown key is ignored."""
        chunk = self._sealing.pop(key, None)
        if chunk is None:
            return
        if not ok:
            self._ring.orphan(chunk)
            return
        self._entries[key] = chunk
        self._stats.puts += 1
        self._stats.bytes_written += chunk.nbytes

    def discard(self, key: str) -> None:
        """Drop `key`'s entry, written for a request that was never sent.

        Drop `key`'s entry (written for a request that then never reached a reader): the chunk
        becomes an orphan that the hand frees; handles to it no longer resolve."""
        chunk = self._entries.pop(key, None)
        if chunk is not None:
            self._ring.orphan(chunk)

    def finish_request(self, request_id: str) -> None:
        """Unpin what `request_id` pinned.

        Unpin what `request_id` pinned, abandoning a chunk it reserved and never sealed (its
        writer failed); an unknown id is ignored (finish and abort may both call)."""
        for chunk in self._requests.pop(request_id, ()):
            chunk.pins -= 1
            if chunk.key is not None and self._sealing.get(chunk.key) is chunk:
                self.seal(chunk.key, ok=False)

    def drop_unused(self) -> int:
        """Drop every entry no request pins (a cache reset); the number dropped. A pinned entry
        stays for its requests (an item being written, too)."""
        unused = [key for key, chunk in self._entries.items() if chunk.pins == 0]
        for key in unused:
            self.discard(key)
        return len(unused)

    def pinned_requests(self) -> list[str]:
        """The ids of the requests that pin entries now (none once every request finished)."""
        return sorted(self._requests)

    def get(self, handle: ShmHandle) -> ShmLease | None:
        """Read through this process's own reader (tests, P0); see `ShmStoreReader.get`."""
        if self._reader is None:
            self._reader = ShmStoreReader(self.info)
        return self._reader.get(handle)

    def reader(self) -> ShmStoreReader:
        """A new reader of this store (its own open file, so its own locks)."""
        return ShmStoreReader(self.info)

    def clear(self) -> None:
        """Drop every entry and pin; every handle made so far is stale from now on."""
        self._stats.evictions += len(self._entries)
        self._entries.clear()
        self._sealing.clear()
        self._requests.clear()
        self._ring.clear()

    @property
    def stats(self) -> ShmStoreStats:
        """A snapshot."""
        return dataclasses.replace(self._stats, relocations=self._ring.num_relocations,
                                   entries=len(self._entries),
                                   bytes_used=sum(chunk.size for chunk in self._entries.values()))

    def close(self) -> None:
        """Unlink the segment (readers keep what they mapped)."""
        if self._reader is not None:
            self._reader.close()
        self._ring.close()

    def __enter__(self) -> ShmStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_integrity(self) -> None:
        self._ring.check_integrity()
        live = {chunk.key: chunk for chunk in self._ring.chunks() if chunk.live and chunk.key is not None}
        assert not self._entries.keys() & self._sealing.keys()
        assert live.keys() == self._entries.keys() | self._sealing.keys(), (live.keys(), self._entries.keys())
        pins = Counter(id(chunk) for chunks in self._requests.values() for chunk in chunks)
        for key, chunk in {**self._entries, **self._sealing}.items():
            assert live[key] is chunk and chunk.tag == self._sign_chunk(chunk), key
            assert chunk.pins == pins.pop(id(chunk), 0), key
        assert not pins, "a request pins an entry that is gone"

    def _allocate(self, key: str, nbytes: int) -> Chunk | None:
        if nbytes > self.max_object_bytes:
            self._stats.fallbacks_oversize += 1
            return None
        chunk = self._ring.allocate(nbytes, key)
        if chunk is None:
            self._stats.fallbacks_full += 1
        return chunk

    def _hand_out(self, chunk: Chunk, request_id: str | None) -> ShmHandle:
        if request_id is not None:
            chunk.pins += 1
            self._requests.setdefault(request_id, []).append(chunk)
        self._stats.bytes_saved += chunk.nbytes
        return _handle(chunk)

    def _sign_chunk(self, chunk: Chunk) -> bytes:
        assert chunk.key is not None and chunk.chunk_id is not None
        return sign(self._secret, chunk.key, chunk.offset, chunk.chunk_id, chunk.nbytes)

    def _on_evict(self, chunk: Chunk) -> None:
        key = chunk.key  # the ring tells keyed chunks only; a reserved one is pinned until sealed
        if self._entries.pop(key, None) is None:  # type: ignore[arg-type]
            self._sealing.pop(key, None)  # type: ignore[arg-type]
        self._stats.evictions += 1

def _handle(chunk: Chunk) -> ShmHandle:
    assert chunk.key is not None and chunk.chunk_id is not None
    return ShmHandle(chunk.key, chunk.offset, chunk.chunk_id, chunk.nbytes, chunk.tag)
