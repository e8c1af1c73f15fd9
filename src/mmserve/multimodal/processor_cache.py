"""P0's processor cache: processed items by mm_hash, LRU by bytes (`cache.py: LruBytes`)."""

from __future__ import annotations

from typing import Any

from mmserve.multimodal.cache import LruBytes, LruCache, item_size


class ProcessorCache(LruCache):
    """P0's processed items by mm_hash, so the HF image processor never runs twice on one item.

    `get` counts a query (and a hit) and refreshes the entry; `put` stores an item unless it is
    larger than the whole cache. Capacity 0 turns it off (every `get` misses, nothing is kept).
    """

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(LruBytes(capacity_bytes))

    @property
    def enabled(self) -> bool:
        return self._lru.capacity > 0

    def get(self, mm_hash: str) -> dict[str, Any] | None:
        with self._lock:
            self._lru.stats.queries += 1
            if mm_hash not in self._lru:
                return None
            self._lru.stats.hits += 1
            return self._lru.touch(mm_hash)

    def peek(self, mm_hash: str) -> dict[str, Any] | None:
        """The held item, or None; counts nothing and refreshes nothing."""
        with self._lock:
            return self._lru.peek(mm_hash) if mm_hash in self._lru else None

    def put(self, mm_hash: str, data: dict[str, Any]) -> None:
        if self.enabled:
            with self._lock:
                self._lru.put(mm_hash, item_size(data), data)

    def count_shared_hit(self) -> None:
        """The last `get` missed, but another API server's processor output answered it (the node's
        store, several API servers): it counts as a hit of the processor cache."""
        with self._lock:
            self._lru.stats.hits += 1
