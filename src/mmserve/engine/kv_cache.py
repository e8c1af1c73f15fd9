"""The paged KV cache's bookkeeping: which blocks each request owns, and the prefix cache.

The tensors live in the model runner ([num_blocks, block_size, Hkv, Dh] per layer); this file
decides block ids only. A request's tokens 0..n-1 sit in its blocks in order: token i in
block `blocks[i // block_size]` at offset `i % block_size`. The pool (blocks, LRU free queue,
hash map) is in `block_pool.py`; how block hashes are made is in `block_hash.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from mmserve.engine.block_hash import BlockHash
from mmserve.engine.block_pool import BlockPool, KVBlock
from mmserve.engine.partial_prefix import PartialPrefixIndex

if TYPE_CHECKING:
    from mmserve.engine.kv_events import KVEventLog

__all__ = ["BlockPool", "KVBlock", "KVCacheManager"]


class KVCacheManager:
    """Owns each request's block list: `find_cached_prefix` looks up, `allocate_slots` grows,
    `cache_full_blocks` registers computed blocks, `free` returns them. With `cache_last_blocks`,
    `cache_last_block` also registers a prompt's computed last block and `find_last_block` finds
    one to copy (the scheduler asks the runner for the copy). With `cache_partial_blocks`, `partial`
    indexes the computed blocks the pool keeps by their leading tokens (`partial_prefix.py`; the
    pool tells it when a block loses its keys). `reset_prefix_cache` drops every key at once.

    Invariants: a request's blocks are never shared for writing — a cache hit covers whole
    blocks that the request only reads, and a last-block or partial-block hit is copied into a
    block of its own; its first `num_cached_blocks[id]` blocks are registered in the pool under
    the request's block hashes. With `enable_caching` False nothing is looked up or registered, and the pool is a
    plain LRU free list.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 cache_last_blocks: bool = True, cache_partial_blocks: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.cache_last_blocks = enable_caching and cache_last_blocks
        self.pool = BlockPool(num_blocks)
        self.partial = PartialPrefixIndex() if enable_caching and cache_partial_blocks else None
        if self.partial is not None:
            self.pool.on_block_dropped = self.partial.drop
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # request id -> its blocks registered so far
        self.events: KVEventLog | None = None  # told of new and dropped keys (`attach_events`)
        self._kept_over_reset: set[str] = set()  # requests that held blocks at a prefix-cache reset

    def attach_events(self, events: KVEventLog) -> None:
        """Tell `events` of every key the pool gains (the scheduler passes the request's blocks)
        and loses (an eviction of the last block holding it)."""
        self.events = events
        self.pool.on_key_removed = events.removed

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def find_cached_prefix(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[KVBlock]:
        """The longest run of cached blocks matching `block_hashes` from the first, at most
        `max_blocks` long. Changes nothing: `allocate_slots` takes them."""
        hits: list[KVBlock] = []
        if not self.enable_caching:
            return hits
        for block_hash in block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, request_id: str, num_tokens: int, computed: Sequence[KVBlock] = ()) -> bool:
        """True when the request's first `num_tokens` tokens can have slots, `computed` (cache
        hits for a request without blocks) covering the first of them."""
        have = len(self.req_to_blocks.get(request_id, ())) + len(computed)
        # hits that leave the free queue (no generator for a running request's step: it has none)
        taken_from_free = sum(1 for b in computed if b.ref_cnt == 0) if computed else 0
        return self.blocks_needed(num_tokens) - have + taken_from_free <= self.pool.num_free_blocks

    def allocate_slots(self, request_id: str, num_tokens: int,
                       computed: Sequence[KVBlock] = ()) -> list[int] | None:
        """Grow the request's blocks to hold `num_tokens` tokens in all, starting with the cache
        hits `computed` (only for a request that owns no blocks yet). Return the ids of the newly
        allocated blocks (not the hits), or None (and change nothing) when too few are free."""
        if not self.can_allocate(request_id, num_tokens, computed):
            return None
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if computed:
            assert not blocks, "cache hits are only taken by a request without blocks"
            self.pool.touch(computed)
            blocks.extend(computed)
            self.num_cached_blocks[request_id] = len(computed)
        needed = self.blocks_needed(num_tokens) - len(blocks)
        if needed <= 0:  # most decode steps: the last block has room
            return []
        new = self.pool.allocate(needed)
        blocks.extend(new)
        return [b.block_id for b in new]

    def cache_full_blocks(self, request_id: str, block_hashes: Sequence[BlockHash],
                          num_computed_tokens: int) -> list[int]:
        """Register the request's blocks that `num_computed_tokens` fill (and that have a hash),
        so that later requests hit them. The K/V of the last ones may be computed in the step
        being scheduled: a request admitted later in the same step reads them only after that
        step's cache writes (each layer writes all of the step's K/V before attending).
        Returns the indices of the blocks whose hash is new to the pool (for KV events)."""
        new_keys: list[int] = []
        if not self.enable_caching:
            return new_keys
        blocks = self.req_to_blocks[request_id]
        done = self.num_cached_blocks.get(request_id, 0)
        full = min(num_computed_tokens // self.block_size, len(block_hashes), len(blocks))
        for i in range(done, full):
            if self.pool.cache_block(blocks[i], block_hashes[i]):
                new_keys.append(i)
        self.num_cached_blocks[request_id] = max(done, full)
        return new_keys

    def find_last_block(self, last_hash: BlockHash | None) -> KVBlock | None:
        """A block holding a prompt's last tokens under `last_hash` (see `BlockPool`), to copy;
        None when there is none or last blocks are not cached. Changes nothing."""
        if not self.cache_last_blocks or last_hash is None:
            return None
        return self.pool.get_last_block(last_hash)

    def cache_last_block(self, request_id: str, num_tokens: int, last_hash: BlockHash | None) -> None:
        """Register the request's block holding token `num_tokens - 1`, whose K/V up to that token
        are computed, under `last_hash` (of those tokens)."""
        if self.cache_last_blocks and last_hash is not None:
            self.pool.cache_last_block(self.req_to_blocks[request_id][(num_tokens - 1) // self.block_size], last_hash)

    def forget_from(self, request_id: str, first_token: int) -> None:
        """Unregister the request's blocks from the one holding `first_token` on: a step that
        failed registered them before writing their K/V, so no later request may hit them."""
        keep = first_token // self.block_size
        for block in self.req_to_blocks.get(request_id, [])[keep:]:
            self.pool.drop_hash(block)
        if request_id in self.num_cached_blocks:
            self.num_cached_blocks[request_id] = min(self.num_cached_blocks[request_id], keep)

    def reset_prefix_cache(self) -> int:
        """Drop every block's keys (and the partial-block index with them); the number of blocks
        that had keys. A running request keeps its blocks and its count of registered ones, so it
        registers only the blocks it completes from now on."""
        dropped = self.pool.drop_all_keys()
        if self.partial is not None:
            self.partial.clear()
        self._kept_over_reset.update(self.req_to_blocks)
        if self.events is not None:
            self.events.cleared()
        return dropped

    def free(self, request_id: str) -> None:
        """Release all the request's blocks, last block first: freed blocks keep their hashes, and
        the request's tail blocks are evicted before its head blocks."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self._kept_over_reset.discard(request_id)
        self.pool.free(reversed(blocks))

    def check_integrity(self) -> None:
        """The pool is sound; ref counts equal the number of owners; registered blocks have hashes."""
        self.pool.check_integrity()
        if self.partial is not None:
            self.partial.check_integrity()
        owners = [0] * self.pool.num_blocks
        for rid, blocks in self.req_to_blocks.items():
            for b in blocks:
                owners[b.block_id] += 1
            cached = self.num_cached_blocks.get(rid, 0)
            assert cached <= len(blocks), f"{rid}: {cached} cached blocks of {len(blocks)}"
            assert rid in self._kept_over_reset or all(b.block_hash is not None for b in blocks[:cached]), \
                f"{rid}: a registered block lost its hash"
        assert owners == [b.ref_cnt for b in self.pool.blocks], "ref counts disagree with request ownership"
        assert set(self.num_cached_blocks) <= set(self.req_to_blocks), "cached-block count of a request without blocks"
