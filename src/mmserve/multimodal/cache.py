"""The multimodal input caches: the IPC cache's two mirrored halves here, P0's processor cache in
`processor_cache.py`, and what they share (`LruBytes`, `LruCache`, `item_size`).

All three are LRU by bytes over `item_size` (tensor bytes plus a fixed per-entry overhead).

The IPC cache: the sender (P0) holds keys and sizes only, the receiver (P1) holds the items.
Both have the same capacity and size function and are updated with the same calls in the same
order (one call per request, in the order P0 sends the requests), so the sender knows what the
receiver holds without asking, and an item it holds crosses P0 -> P1 as its hash alone. The
rule both apply, per request, item by item: a key present is touched (moved to the MRU end);
a key absent is inserted after evicting least recently used entries — never one of this
request's own items — and is skipped (sent inline, not kept) when it cannot fit that way.
Drift (a lost update, a reset, sizes that disagree) shows as a hash the receiver lacks; the
frontend then resends the items and both sides start a new epoch from empty (see async_llm).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Generic, Iterable, TypeVar

import msgspec

from mmserve.errors import ClientError
from mmserve.ipc.messages import CacheStats
from mmserve.ipc.items import MultiModalItem

ENTRY_OVERHEAD_BYTES = 512  # per entry: key, bookkeeping, tensor headers
_GIB = 1 << 30

V = TypeVar("V")


def item_size(data: dict[str, Any]) -> int:
    """Bytes an item counts for in every cache: its tensors' bytes plus the entry overhead."""
    return ENTRY_OVERHEAD_BYTES + sum(int(t.nbytes) for t in data.values())


def gib_to_bytes(gb: float) -> int:
    return int(gb * _GIB)


class LruBytes(Generic[V]):
    """Keys with sizes (and optional values) in LRU order, bounded by `capacity` bytes.

    Invariant: `used == sum of sizes <= capacity`. `put` evicts from the LRU end, never a key in
    `protected`; it keeps nothing and returns False when the entry cannot fit that way.
    `digest` is the XOR of `key_digest` over the keys held (O(1) per change): two caches hold the
    same keys exactly when their digests agree (up to a 2**-64 chance), which is how P0's IPC
    sender and P1's receiver are compared without shipping their keys.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.digest = 0
        self._entries: OrderedDict[str, tuple[int, V | None]] = OrderedDict()
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def size_of(self, key: str) -> int:
        return self._entries[key][0]

    def peek(self, key: str) -> V | None:
        """The value of a present key, without refreshing it."""
        return self._entries[key][1]

    def touch(self, key: str) -> V | None:
        """Move `key` (present) to the MRU end and return its value."""
        self._entries.move_to_end(key)
        return self._entries[key][1]

    def put(self, key: str, size: int, value: V | None = None, protected: Iterable[str] = ()) -> bool:
        if key in self._entries:
            self.touch(key)
            return True
        if size > self.capacity:
            return False
        keep = set(protected)
        victims, freed = [], 0
        for k, (s, _) in self._entries.items():
            if self.used - freed + size <= self.capacity:
                break
            if k not in keep:
                victims.append(k)
                freed += s
        if self.used - freed + size > self.capacity:
            return False
        for k in victims:
            self.used -= self._entries.pop(k)[0]
            self.digest ^= key_digest(k)
        self.stats.evictions += len(victims)
        self._entries[key] = (size, value)
        self.used += size
        self.digest ^= key_digest(key)
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.used = self.digest = 0

    def save(self) -> tuple[list[tuple[str, tuple[int, V | None]]], int, CacheStats]:
        """Everything `restore` needs to undo later calls (O(entries): for rare undo paths)."""
        return list(self._entries.items()), self.used, msgspec.structs.replace(self.stats)

    def restore(self, state: tuple[list[tuple[str, tuple[int, V | None]]], int, CacheStats]) -> None:
        entries, self.used, self.stats = state
        self._entries = OrderedDict(entries)
        self.digest = _digest_of(self._entries)

    def snapshot(self) -> CacheStats:
        s = self.stats
        return CacheStats(s.queries, s.hits, s.evictions, s.bytes_saved, len(self._entries), self.used,
                          keys_digest=self.digest)

    def check_integrity(self) -> None:
        assert self.used == sum(s for s, _ in self._entries.values()), "byte accounting drifted"
        assert self.used <= self.capacity, "over capacity"
        assert self.digest == _digest_of(self._entries), "key digest drifted"


def key_digest(key: str) -> int:
    """A 64-bit digest of one key (blake2b), XOR-ed into `LruBytes.digest`."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def _digest_of(keys: Iterable[str]) -> int:
    digest = 0
    for key in keys:
        digest ^= key_digest(key)
    return digest


class LruCache:
    """What the three caches share: an `LruBytes` as `_lru`, its keys, stats and integrity.

    Thread safety: P0 resolves requests in worker threads while the event loop updates the IPC
    sender, so every public method of a cache holds `_lock` (re-entrant) for its whole call; no
    caller touches `_lru` directly."""

    _lru: LruBytes[Any]
    _lock: threading.RLock

    def __init__(self, lru: LruBytes[Any]) -> None:
        self._lru = lru
        self._lock = threading.RLock()

    def keys(self) -> list[str]:
        with self._lock:
            return self._lru.keys()

    def stats(self) -> CacheStats:
        with self._lock:
            return self._lru.snapshot()

    def clear(self) -> int:
        """Drop every entry (a cache reset); the number dropped. The counts stay."""
        with self._lock:
            count = len(self._lru.keys())
            self._lru.clear()
            return count

    def check_integrity(self) -> None:
        with self._lock:
            self._lru.check_integrity()


class IpcSenderCache(LruCache):
    """P0's half of the IPC cache: keys and sizes only, mirroring the receiver (module docstring).

    `update(items)` applies one request: it returns, per item, whether the receiver will hold it
    when this request arrives — those cross as their hash alone. Items without data (known
    only by hash) must already be held; the caller checks `__contains__` first.
    """

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(LruBytes(capacity_bytes))  # value: the item's placeholder count
        self.epoch = 0

    @property
    def enabled(self) -> bool:
        return self._lru.capacity > 0

    def __contains__(self, mm_hash: str) -> bool:
        with self._lock:
            return mm_hash in self._lru

    def num_tokens(self, mm_hash: str) -> int | None:
        """The placeholder count of a held item (for uuid-only parts)."""
        with self._lock:
            return self._lru.peek(mm_hash) if mm_hash in self._lru else None

    def update(self, items: list[MultiModalItem]) -> list[bool]:
        """Raises ValueError, changing nothing, when an item without data is not held (a
        uuid-only item evicted since it was resolved): the request must send the image again."""
        if not self.enabled:
            return [False] * len(items)
        with self._lock:
            lost = [item.mm_hash for item in items if item.data is None and item.mm_hash not in self._lru]
            if lost:
                raise ClientError("an image given by uuid alone was evicted before the request was sent: send the "
                                 "image again together with its uuid")
            return self._update(items)

    def _update(self, items: list[MultiModalItem]) -> list[bool]:
        keys = [item.mm_hash for item in items]
        cached = []
        for item in items:
            self._lru.stats.queries += 1
            if item.mm_hash in self._lru:
                self._lru.touch(item.mm_hash)
                self._lru.stats.hits += 1
                self._lru.stats.bytes_saved += self._lru.size_of(item.mm_hash) - ENTRY_OVERHEAD_BYTES
                cached.append(True)
            else:
                assert item.data is not None  # `lost` above: an item not held comes with its data
                self._lru.put(item.mm_hash, item_size(item.data), item.placeholder.length, protected=keys)
                cached.append(False)
        return cached

    def reset(self) -> None:
        """Start a new epoch from empty; the receiver empties itself when it sees the epoch."""
        with self._lock:
            self._lru.clear()
            self.epoch += 1

    def checkpoint(self) -> tuple[int, Any]:
        """A token for `rollback`: taken right before an `update` whose message may not be sent."""
        with self._lock:
            return self.epoch, self._lru.save()

    def rollback(self, token: tuple[int, Any]) -> None:
        """Undo every update since `checkpoint` (the receiver never saw them)."""
        with self._lock:
            self.epoch, state = token
            self._lru.restore(state)


class IpcReceiverCache(LruCache):
    """P1's half of the IPC cache: the items themselves, updated exactly as the sender is.

    `update(items, epoch)` applies one request: items sent by hash alone get their data back;
    the hashes it does not hold are returned (and then nothing is changed), so the caller can
    ask P0 to resend. A newer `epoch` empties the cache first.
    """

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(LruBytes(capacity_bytes))
        self.epoch = 0

    @property
    def enabled(self) -> bool:
        return self._lru.capacity > 0

    def start_epoch(self, epoch: int) -> None:
        """Empty the cache when `epoch` is not the one it is in (the sender reset)."""
        if epoch != self.epoch:
            self._lru.clear()
            self.epoch = epoch

    def update(self, items: list[MultiModalItem], epoch: int) -> list[str]:
        self.start_epoch(epoch)
        arriving = {item.mm_hash for item in items if item.data is not None}
        missing = [item.mm_hash for item in items
                   if item.data is None and item.mm_hash not in self._lru and item.mm_hash not in arriving]
        if missing or self._lru.capacity == 0:
            return missing
        keys = [item.mm_hash for item in items]
        for item in items:
            self._lru.stats.queries += 1
            if item.mm_hash in self._lru:
                data = self._lru.touch(item.mm_hash)
                self._lru.stats.hits += 1
                if item.data is None:
                    item.data = data
            else:  # not held: its data came (the sender sends an item's data before its hash alone)
                assert item.data is not None
                self._lru.put(item.mm_hash, item_size(item.data), item.data, protected=keys)
        return []
