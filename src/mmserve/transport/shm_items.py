"""The shared-memory object store as the multimodal cache (`--mm-cache-type shm`).

P0 (`ShmItemWriter`: each API server) writes each processed item once and sends its handle in
place of the tensors; an item too big for the store, or one that finds it full, goes inline. Entries are
pinned for the request that uses them until P0 calls `finish`. P1 (`ShmItemReader`) maps each
handle's tensors in place (zero-copy, read-only views) and holds their leases until the request
ends; a stale handle (the entry was evicted or the store cleared) is reported missing, and P0
then resends the request with the item inline.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from mmserve.ipc.messages import CacheStats, EngineCoreRequest
from mmserve.ipc.items import ShmStoreInfo
from mmserve.item_store.node_store import NodeStoreClient
from mmserve.item_store.shm_store import ShmStore
from mmserve.item_store.shm_store_reader import ShmLease, ShmStoreReader
from mmserve.ipc.items import MultiModalItem


class ShmItemWriter:
    """P0's side of the shm transport: writes items, sends handles.

    P0's side: writes through `store`, its own (one API server: the single writer) or, with
    several API servers, the node's (`NodeStoreClient`: the launcher owns it, every server writes)."""

    def __init__(self, store: ShmStore | NodeStoreClient) -> None:
        self.store = store

    @property
    def info(self) -> bytes:
        """What P1 attaches with (holds the handle secret: never log it)."""
        return msgspec.msgpack.encode(self.store.info)

    def to_wire(self, request: EngineCoreRequest, inline: bool = False,
                written: list[str] | None = None) -> list[MultiModalItem]:
        """The request's items as they cross to P1: by handle where the store takes them.

        The keys of entries written for it are appended to `written` (for `discard`).
        """
        items = []
        for item in request.mm_items:
            handle = None
            if not inline and item.data is not None:
                handle = self.store.lookup(item.mm_hash, request.request_id)
                if handle is None:
                    handle = self.store.put(item.mm_hash, item.data, request.request_id)
                    if handle is not None and written is not None:
                        written.append(item.mm_hash)
            items.append(item if handle is None else
                         msgspec.structs.replace(item, data=None, shm_handle=handle))
        return items

    def discard(self, keys: list[str]) -> None:
        """Drop entries written for a request that was never sent (the undo of `to_wire`)."""
        for key in keys:
            self.store.discard(key)

    def finish(self, request_id: str) -> None:
        """Unpin the request's entries (after its last output, an abort or an error)."""
        self.store.finish_request(request_id)

    def stats(self) -> CacheStats:
        s = self.store.stats
        return CacheStats(s.queries, s.hits, s.evictions, s.bytes_saved, s.entries, s.bytes_used, s.fallbacks)

    def close(self) -> None:
        self.store.close()


class ShmItemReader:
    """A reader's side of the shm transport: maps items from handles.

    A reader's side (P1, and each tensor-parallel rank): restores items from handles, holding
    each request's leases until `release`."""

    def __init__(self, info: ShmStoreInfo) -> None:
        self.reader = ShmStoreReader(info)
        self._leases: dict[str, list[ShmLease]] = {}

    def attach(self, request_id: str, items: Sequence[MultiModalItem]) -> list[str]:
        """Map the request's items in place; the hashes whose handles went stale (then nothing is held)."""
        leases: list[ShmLease] = []
        missing: list[str] = []
        self._leases[request_id] = leases  # released below (or by the caller) whatever happens next
        try:
            for item in items:
                if item.shm_handle is None:
                    continue
                lease = self.reader.get(item.shm_handle)
                if lease is None:
                    missing.append(item.mm_hash)
                else:
                    leases.append(lease)
                    item.data = lease.data
        except BaseException:
            self.release(request_id)  # a later handle failed: the leases taken so far go back
            raise
        if missing:
            self.release(request_id)
        return missing

    def release(self, request_id: str) -> None:
        for lease in self._leases.pop(request_id, ()):
            lease.release()

    def close(self) -> None:
        for request_id in list(self._leases):
            self.release(request_id)
        self.reader.close()
