"""P0: each item of a request (an image, a video) -> its `mm_hash` and processed tensors, one
pipeline for every modality, the processor run only on processor-cache misses.

Order per item: read the source's bytes (no decoding yet), hash them with the request's settings,
look the hash up in the processor cache (with several API servers, then in the node's store:
another server may have processed it), size it from what is known before the work (an image's
header size, a video's container metadata: `Modality.plan` refuses an item over a limit), and
only then decode and process it. The first steps run for every item of the request before any
item is decoded, so a request is refused before any of its work is done; its misses are then
decoded and processed together, on the pipeline's threads. A client uuid replaces the
content hash; a uuid part with no source is served from what P0 still holds (the processor cache,
else the IPC cache's record of what P1 holds).

A `Modality` (`ImageModality` in multimodal/image_items.py, `VideoModality` in
multimodal/video_items.py) says how its items are read, hashed, sized and processed;
`ItemPipeline` does the rest the same way for all.

With `bypass` (the cache verifier's shadow run) every item is processed again from its source: the
cache is neither read nor written, and no in-flight item is shared.

Nothing is stored while a request is being resolved: `commit` puts the fresh items into the
processor cache once the whole request has been accepted, so a rejected request leaves no entry.
Requests are resolved in worker threads; an item that another request is processing, or has
processed but not committed yet, is taken from that request (waited for), not processed twice: a
burst of requests with one new image or video runs the processor once. The in-flight entry lives
until the owner's request is committed or released; the table is shared by every modality's
pipeline, so one `commit` / `release` covers a request's images and videos.
"""

from __future__ import annotations

import os
import threading
import uuid as uuid_lib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol, TypeVar

from mmserve.errors import ClientError
from mmserve.multimodal.hasher import ItemHasher
from mmserve.multimodal.processor_cache import ProcessorCache


T = TypeVar("T")
# P0's processing threads (a request's misses, an offline batch's prompts): the image processor,
# the decoders and the tokenizer release the GIL; two at least, so work overlaps even on one core
PROCESSING_THREADS = max(2, min(8, os.cpu_count() or 1))


def settled(futures: list[Future[T]]) -> tuple[list[T], BaseException | None]:
    """Waits for every future: the results of those that succeeded, in order, and the first
    fault in order (None when none failed), so that a caller can undo the others' work."""
    results: list[T] = []
    fault: BaseException | None = None
    for future in futures:
        try:
            results.append(future.result())
        except BaseException as exc:
            fault = fault or exc
    return results, fault


@dataclass
class ResolvedItem:
    mm_hash: str
    data: dict[str, Any] | None  # None: known to P1 by hash alone (a uuid-only part)
    num_tokens: int
    fresh: bool  # processed for this request; goes into the processor cache on commit
    hit: bool | None = None  # found in the processor cache (or the node's store); None: not looked up


class Modality(Protocol):
    """How one modality's items are read, hashed, sized and processed (no state across requests
    but counters)."""

    kind: str  # "image" / "video": the hash's modality tag and the word error messages use

    def settings(self, requested: Any) -> Any:
        """The request's settings for this modality, validated (ValueError) before any item is read."""
        ...

    def hashed_settings(self, settings: Any) -> dict[str, Any]:
        """What of `settings` the item hash covers."""
        ...

    def read(self, source: Any) -> Any:
        """The item's encoded content (or in-memory pixels), size-checked, not decoded."""
        ...

    def hash_key(self, raw: Any) -> Any:
        """What of `raw` the content hash covers."""
        ...

    def plan(self, index: int, raw: Any, settings: Any) -> Any:
        """The request's `index`-th item of this modality sized from its header or metadata alone,
        refused (ValueError / MediaError) when it would break a limit once processed: before
        anything is decoded. What it returns is handed to `process`."""
        ...

    def process(self, raw: Any, settings: Any, plan: Any, salt: str | None) -> dict[str, Any]:
        """Decode and process `raw` as `plan` sized it (ValueError / MediaError for the client);
        `salt` is the request's cache salt (for hashes the data carries)."""
        ...

    def num_tokens(self, data: dict[str, Any]) -> int:
        """Placeholder tokens of one processed item (for a video: of one temporal group)."""
        ...


@dataclass
class Miss:
    """An item none of the caches holds, read, hashed and sized (`plan`), to be processed."""

    index: int
    mm_hash: str
    raw: Any
    plan: Any
    hit: bool | None  # False: the processor cache was asked; None: it is off


class InFlight:
    """Items being processed (or processed, not committed): mm_hash -> the future of its data."""

    def __init__(self) -> None:
        self.futures: dict[str, Future[dict[str, Any]]] = {}
        self.lock = threading.Lock()


class ItemPipeline:
    """Turns one modality's sources (+ optional uuids, salt, settings) into `ResolvedItem`s.

    `hashing` False (no cache layer needs the content hash) gives each item a random id instead.
    `known_tokens(mm_hash)` answers the placeholder count of an item P1 holds, else None.
    `fetch(mm_hash)` answers an item another API server processed (the node's store), else None;
    it is asked on a processor-cache miss, and a hit there counts as the processor cache's.
    """

    def __init__(self, modality: Modality, hasher: ItemHasher, cache: ProcessorCache, hashing: bool,
                 known_tokens: Callable[[str], int | None] = lambda h: None,
                 fetch: Callable[[str], dict[str, Any] | None] = lambda h: None,
                 inflight: InFlight | None = None) -> None:
        self.modality = modality
        self.hasher = hasher
        self.cache = cache
        self.hashing = hashing
        self.known_tokens = known_tokens
        self.fetch = fetch
        self.inflight = InFlight() if inflight is None else inflight
        self.num_processed = 0  # processor runs since start
        # a request's misses, processed at once (the image processor and decoders release the GIL)
        self._workers = ThreadPoolExecutor(PROCESSING_THREADS, thread_name_prefix="mmserve-items")

    def resolve(self, sources: list[Any], uuids: list[str | None], salt: str | None,
                requested: Any = None, bypass: bool = False) -> list[ResolvedItem]:
        """Every item, or an error (and then nothing of this request stays in flight).
        `requested`: the request's settings for the modality; they are part of every item's hash.

        Two passes: every item read, hashed, looked up and (a miss) sized, in order, so that a
        request is refused before any of its items is decoded; then the misses decoded and
        processed, several at once on the pipeline's threads."""
        settings = self.modality.settings(requested)
        if bypass:
            done: list[ResolvedItem] = []
            try:
                for index, (source, uid) in enumerate(zip(sources, uuids)):
                    done.append(self._reprocess(index, source, uid, salt, settings))
            except BaseException:
                self.release(done)
                raise
            return done
        looked = [self._look_up(index, source, uid, salt, settings)
                  for index, (source, uid) in enumerate(zip(sources, uuids))]
        return self._process_misses(looked, settings, salt)

    def commit(self, items: list[ResolvedItem]) -> None:
        """Keep the request's freshly processed items (call once the request is accepted)."""
        for item in items:
            if item.fresh and item.data is not None:
                self.cache.put(item.mm_hash, item.data)
        self.release(items)

    def release(self, items: list[ResolvedItem]) -> None:
        """End the in-flight entries of the request's processed items (commit calls it; call it
        alone for a request that was rejected after `resolve`)."""
        with self.inflight.lock:
            for item in items:
                pending = self.inflight.futures.get(item.mm_hash)
                if item.fresh and pending is not None and pending.done():
                    del self.inflight.futures[item.mm_hash]

    def _hash(self, raw: Any, uid: str | None, salt: str | None, settings: Any) -> str:
        kind, hashed = self.modality.kind, self.modality.hashed_settings(settings)
        if uid is not None:
            return self.hasher.hash_uuid(kind, uid, salt, hashed)
        if not self.hashing:
            return uuid_lib.uuid4().hex
        return self.hasher.hash_item(kind, self.modality.hash_key(raw), salt, hashed)

    def _look_up(self, index: int, source: Any, uid: str | None, salt: str | None,
                 settings: Any) -> ResolvedItem | Miss:
        """The item as the caches (or P1, for a uuid alone) hold it, else a sized `Miss`."""
        if uid is not None and source is None:
            return self._from_uuid_alone(self._hash(None, uid, salt, settings), uid)
        raw = self.modality.read(source)
        mm_hash = self._hash(raw, uid, salt, settings)
        data = self.cache.get(mm_hash) if self.cache.enabled else None
        if data is not None:
            return self._item(mm_hash, data, fresh=False, hit=True)
        data = self._fetch(mm_hash)
        if data is not None:
            return self._item(mm_hash, data, fresh=True, hit=True)
        return Miss(index, mm_hash, raw, self.modality.plan(index, raw, settings),
                    hit=False if self.cache.enabled else None)

    def _process_misses(self, looked: list[ResolvedItem | Miss], settings: Any,
                        salt: str | None) -> list[ResolvedItem]:
        """`looked` with each miss processed (on the pipeline's threads when there are several);
        on a fault, what the others processed leaves the in-flight table and the first fault (in
        order) raises."""
        misses = [miss for miss in looked if isinstance(miss, Miss)]

        def process(miss: Miss) -> ResolvedItem:
            data = self._process_once(miss.mm_hash, miss.raw, settings, miss.plan, salt)
            return self._item(miss.mm_hash, data, fresh=True, hit=miss.hit)

        if len(misses) <= 1:
            return [process(item) if isinstance(item, Miss) else item for item in looked]
        processed, fault = settled([self._workers.submit(process, miss) for miss in misses])
        if fault is not None:
            self.release(processed)
            raise fault
        done = iter(processed)
        return [next(done) if isinstance(item, Miss) else item for item in looked]

    def _reprocess(self, index: int, source: Any, uid: str | None, salt: str | None,
                   settings: Any) -> ResolvedItem:
        """The item processed again from `source`, under the hash the cached path gives it; kept
        nowhere (a ValueError for a uuid part without its source: there is nothing to process)."""
        if source is None:
            article = "an" if self.modality.kind[0] in "aeiou" else "a"
            raise ClientError(f"{article} {self.modality.kind} given by uuid alone cannot be processed again")
        raw = self.modality.read(source)
        mm_hash = self._hash(raw, uid, salt, settings)
        data = self.modality.process(raw, settings, self.modality.plan(index, raw, settings), salt)
        self._count_processed()
        return self._item(mm_hash, data, fresh=False)

    def _item(self, mm_hash: str, data: dict[str, Any], fresh: bool, hit: bool | None = None) -> ResolvedItem:
        return ResolvedItem(mm_hash, data, self.modality.num_tokens(data), fresh=fresh, hit=hit)

    def _fetch(self, mm_hash: str) -> dict[str, Any] | None:
        """After a processor-cache miss: the item as another API server processed it (kept here on
        commit, like a fresh one), counted as a hit; else None."""
        data = self.fetch(mm_hash) if self.cache.enabled else None
        if data is not None:
            self.cache.count_shared_hit()
        return data

    def _process_once(self, mm_hash: str, raw: Any, settings: Any, plan: Any, salt: str | None) -> dict[str, Any]:
        """Decode and process `raw` (sized: `plan`), unless another request holds the same item in
        flight: then wait for its result (or its error: the same content fails the same way)."""
        table = self.inflight
        with table.lock:
            pending = table.futures.get(mm_hash)
            # committed since this request's lookup (commit puts, then ends the in-flight entry)
            committed = self.cache.peek(mm_hash) if pending is None else None
            if pending is None and committed is None:
                table.futures[mm_hash] = future = Future[dict[str, Any]]()
        if committed is not None:
            return committed
        if pending is not None:
            return pending.result()
        try:
            data = self.modality.process(raw, settings, plan, salt)
            self._count_processed()
            future.set_result(data)
            return data
        except BaseException as e:
            future.set_exception(e)
            with table.lock:
                del table.futures[mm_hash]
            raise

    def _count_processed(self) -> None:
        with self.inflight.lock:  # items are processed on several threads
            self.num_processed += 1

    def _from_uuid_alone(self, mm_hash: str, uid: str) -> ResolvedItem:
        data = self.cache.get(mm_hash) if self.cache.enabled else None
        if data is not None:
            return self._item(mm_hash, data, fresh=False, hit=True)
        if (data := self._fetch(mm_hash)) is not None:
            return self._item(mm_hash, data, fresh=True, hit=True)
        num_tokens = self.known_tokens(mm_hash)
        if num_tokens is None:
            kind = self.modality.kind
            raise ClientError(f"the {kind} with uuid {uid!r} is not cached (any more): send the {kind} again "
                             f"together with its uuid")
        return ResolvedItem(mm_hash, None, num_tokens, fresh=False)
