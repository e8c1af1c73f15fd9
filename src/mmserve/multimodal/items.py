"""P0: each image of a request -> its `mm_hash` and processed tensors, the processor run only
on processor-cache misses.

Order per item: read the source's bytes (no decoding yet), hash them, look the hash up in the
processor cache (with several API servers, then in the node's store: another server may have
processed it), and only on a miss decode and run the Hugging Face image processor. A client
uuid replaces the content hash; a uuid part with no image is served from what P0 still holds
(the processor cache, else the IPC cache's record of what P1 holds).

With `bypass` (the cache verifier's shadow run) every item is processed again from its source: the
cache is neither read nor written, and no in-flight item is shared.

Nothing is stored while a request is being resolved: `commit` puts the fresh items into the
processor cache once the whole request has been accepted, so a rejected request leaves no entry.
Requests are resolved in worker threads; an item that another request is processing, or has
processed but not committed yet, is taken from that request (waited for), not processed twice: a
burst of requests with one new image runs the processor once. The in-flight entry lives until
the owner's request is committed or released.
"""

from __future__ import annotations

import threading
import uuid as uuid_lib
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from mmserve.errors import ClientError
from mmserve.multimodal.processor_cache import ProcessorCache
from mmserve.multimodal.hasher import ItemHasher
from mmserve.multimodal.media import MediaLimits, decode_image, read_image_source
from mmserve.multimodal.processing import MultiModalProcessor


@dataclass
class ResolvedItem:
    mm_hash: str
    data: dict[str, Any] | None  # None: known to P1 by hash alone (a uuid-only part)
    num_tokens: int
    fresh: bool  # processed for this request; goes into the processor cache on commit
    hit: bool | None = None  # found in the processor cache (or the node's store); None: not looked up


class ItemResolver:
    """Turns image sources (+ optional uuids, salt) into `ResolvedItem`s.

    `hashing` False (no cache layer needs the content hash) gives each item a random id instead.
    `known_tokens(mm_hash)` answers the placeholder count of an item P1 holds, else None.
    `fetch(mm_hash)` answers an item another API server processed (the node's store), else None;
    it is asked on a processor-cache miss, and a hit there counts as the processor cache's.
    """

    def __init__(self, model_id: str, processor: MultiModalProcessor, cache: ProcessorCache, limits: MediaLimits,
                 hashing: bool, known_tokens: Callable[[str], int | None] = lambda h: None,
                 fetch: Callable[[str], dict[str, Any] | None] = lambda h: None) -> None:
        self.processor = processor
        self.cache = cache
        self.limits = limits
        self.hashing = hashing
        self.known_tokens = known_tokens
        self.fetch = fetch
        self.hasher = ItemHasher(model_id, processor.settings())
        self.num_processed = 0  # image processor runs since start
        self._inflight: dict[str, Future[dict[str, Any]]] = {}  # mm_hash -> the thread processing it
        self._lock = threading.Lock()

    def resolve(self, sources: list[Any], uuids: list[str | None], salt: str | None,
                mm_kwargs: dict[str, Any] | None = None, bypass: bool = False) -> list[ResolvedItem]:
        """Every item, or an error (and then nothing of this request stays in flight).
        `mm_kwargs`: the request's processor settings; they are part of every item's hash."""
        done: list[ResolvedItem] = []
        mm_kwargs = self.processor.check_mm_kwargs(mm_kwargs)
        try:
            for source, uid in zip(sources, uuids):
                done.append(self._reprocess(source, uid, salt, mm_kwargs) if bypass
                            else self._resolve_one(source, uid, salt, mm_kwargs))
        except BaseException:
            self.release(done)
            raise
        return done

    def commit(self, items: list[ResolvedItem]) -> None:
        """Keep the request's freshly processed items (call once the request is accepted)."""
        for item in items:
            if item.fresh and item.data is not None:
                self.cache.put(item.mm_hash, item.data)
        self.release(items)

    def release(self, items: list[ResolvedItem]) -> None:
        """End the in-flight entries of the request's processed items (commit calls it; call it
        alone for a request that was rejected after `resolve`)."""
        with self._lock:
            for item in items:
                pending = self._inflight.get(item.mm_hash)
                if item.fresh and pending is not None and pending.done():
                    del self._inflight[item.mm_hash]

    def _resolve_one(self, source: Any, uid: str | None, salt: str | None, mm_kwargs: dict[str, Any]) -> ResolvedItem:
        if uid is not None:
            mm_hash = self.hasher.hash_uuid("image", uid, salt, mm_kwargs)
            if source is None:
                return self._from_uuid_alone(mm_hash, uid)
            raw = read_image_source(source, self.limits)
        else:
            raw = read_image_source(source, self.limits)
            mm_hash = (self.hasher.hash_item("image", raw, salt, mm_kwargs) if self.hashing
                       else uuid_lib.uuid4().hex)
        data = self.cache.get(mm_hash) if self.cache.enabled else None
        if data is not None:
            return ResolvedItem(mm_hash, data, self.processor.num_placeholder_tokens(data), fresh=False, hit=True)
        data = self._fetch(mm_hash)
        hit = data is not None if self.cache.enabled else None
        if data is None:
            data = self._process_once(mm_hash, raw, mm_kwargs)
        return ResolvedItem(mm_hash, data, self.processor.num_placeholder_tokens(data), fresh=True, hit=hit)

    def _reprocess(self, source: Any, uid: str | None, salt: str | None, mm_kwargs: dict[str, Any]) -> ResolvedItem:
        """The item processed again from `source`, under the hash the cached path gives it; kept
        nowhere (a ValueError for a uuid part without its image: there is nothing to process)."""
        if source is None:
            raise ClientError("an image given by uuid alone cannot be processed again")
        raw = read_image_source(source, self.limits)
        mm_hash = (self.hasher.hash_uuid("image", uid, salt, mm_kwargs) if uid is not None
                   else self.hasher.hash_item("image", raw, salt, mm_kwargs) if self.hashing else uuid_lib.uuid4().hex)
        image = raw if not isinstance(raw, (bytes, bytearray)) else decode_image(bytes(raw), self.limits)
        data = self.processor.process_image(image, mm_kwargs)
        self.num_processed += 1
        return ResolvedItem(mm_hash, data, self.processor.num_placeholder_tokens(data), fresh=False)

    def _fetch(self, mm_hash: str) -> dict[str, Any] | None:
        """After a processor-cache miss: the item as another API server processed it (kept here on
        commit, like a fresh one), counted as a hit; else None."""
        data = self.fetch(mm_hash) if self.cache.enabled else None
        if data is not None:
            self.cache.count_shared_hit()
        return data

    def _process_once(self, mm_hash: str, raw: Any, mm_kwargs: dict[str, Any]) -> dict[str, Any]:
        """Decode and process `raw`, unless another request holds the same item in flight: then
        wait for its result (or its error: the same content fails the same way)."""
        with self._lock:
            pending = self._inflight.get(mm_hash)
            if pending is None:
                self._inflight[mm_hash] = future = Future[dict[str, Any]]()
        if pending is not None:
            return pending.result()
        try:
            image = raw if not isinstance(raw, (bytes, bytearray)) else decode_image(bytes(raw), self.limits)
            data = self.processor.process_image(image, mm_kwargs)
            self.num_processed += 1
            future.set_result(data)
            return data
        except BaseException as e:
            future.set_exception(e)
            with self._lock:
                del self._inflight[mm_hash]
            raise

    def _from_uuid_alone(self, mm_hash: str, uid: str) -> ResolvedItem:
        data = self.cache.get(mm_hash) if self.cache.enabled else None
        if data is not None:
            return ResolvedItem(mm_hash, data, self.processor.num_placeholder_tokens(data), fresh=False, hit=True)
        if (data := self._fetch(mm_hash)) is not None:
            return ResolvedItem(mm_hash, data, self.processor.num_placeholder_tokens(data), fresh=True, hit=True)
        num_tokens = self.known_tokens(mm_hash)
        if num_tokens is None:
            raise ClientError(f"the image with uuid {uid!r} is not cached (any more): send the image again "
                             "together with its uuid")
        return ResolvedItem(mm_hash, None, num_tokens, fresh=False)
