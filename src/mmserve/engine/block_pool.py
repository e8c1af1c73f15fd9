"""The KV block pool: reference-counted blocks, an LRU free queue, and the prefix-cache map.

A block is *owned* (ref count > 0: in some running request's block list) or *free* (ref count 0:
in the free queue). A free block may still be *cached*: it keeps its hash and its K/V until the
pool hands it out again, so a later request with the same prefix can take it back from the
middle of the free queue (a hit). Handing a cached block out again drops its hash (an eviction).

A block may also be registered as a prompt's *last block* (`cache_last_block`): its first r
slots hold the K/V of that prompt's last r tokens. A later request with the same prompt copies it
rather than sharing it (it writes its own tokens after those r), so its K/V must already be
computed when it is registered; the registration is dropped with the block's hash.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from mmserve.engine.block_hash import BlockHash


class KVBlock:
    """One block of the paged KV cache: its id, owners, (when full and cached) its hash and (when
    it held a prompt's last tokens) its last-block key.

    `prev_free` / `next_free` link it into the free queue while its ref count is 0.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "last_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.last_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = None if self.block_hash is None else self.block_hash[:4].hex()
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """The free blocks in eviction order: `popleft` takes the head, the least recently freed.

    A doubly linked list threaded through the blocks themselves between two sentinels, so that
    `popleft`, `append` and `remove` (a cache hit on a free block, from anywhere in the queue) are
    all O(1) with no allocation. Order: at start, block ids ascending; afterwards, the order in
    which blocks were freed. Callers free a request's blocks tail first, so that its last blocks
    (the least likely to be shared by another prompt) are evicted before its first ones.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: head.next_free is the first block, tail.prev_free the last
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVBlock:
        """Unlink and return the head; RuntimeError when the queue is empty."""
        if self._len == 0:
            raise RuntimeError("no free KV block")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        """Unlink `block`, which must be in the queue."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVBlock) -> None:
        """Link `block` (not in the queue) at the tail: it will be evicted last."""
        assert block.prev_free is None and block.next_free is None, f"{block} is already queued"
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self._len += 1

    def __iter__(self) -> Iterator[KVBlock]:
        """Head to tail (for tests and `check_integrity`)."""
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free

    def check_integrity(self) -> None:
        """Forward and backward links agree and the length is right."""
        forward = list(self)
        assert len(forward) == self._len, f"free queue has {len(forward)} blocks, counted {self._len}"
        prev = self._head
        for block in forward:
            assert block.prev_free is prev, f"{block}: broken back link"
            prev = block
        assert self._tail.prev_free is prev, "broken tail link"


class BlockPool:
    """`num_blocks` blocks, the free queue, and the map from block hash to cached blocks.

    Invariants (checked by `check_integrity`):
    - a block is in the free queue exactly when its ref count is 0;
    - a block has a hash exactly when it is in `cached[hash]`; an owned block keeps its hash
      (hashes are dropped only when a free block is handed out again);
    - a block has a last-block key exactly when it is in `last_blocks[key]`, and loses it with its
      hash;
    - `cached` (and `last_blocks`) may map one key to several blocks: two requests that compute the same block at
      the same time both register theirs, because a block in a running request's table is never
      swapped for another. A lookup takes any of them; each is evicted on its own.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, dict[int, KVBlock]] = {}
        self.last_blocks: dict[BlockHash, dict[int, KVBlock]] = {}  # last-block key -> blocks
        self.num_cached_blocks = 0  # blocks with a hash, owned or free
        self.num_evictions = 0  # cached blocks handed out again (their hash dropped), since start
        self.on_key_removed: Callable[[BlockHash], None] | None = None  # told when no block holds a key any more
        self.on_block_dropped: Callable[[KVBlock], None] | None = None  # told when a block loses its keys

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out (cached free blocks included)."""
        return len(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """A block holding `block_hash`'s K/V, or None. Changes nothing."""
        blocks = self.cached.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def get_last_block(self, last_hash: BlockHash) -> KVBlock | None:
        """A block registered as a prompt's last block under `last_hash`, or None. Changes nothing."""
        blocks = self.last_blocks.get(last_hash)
        return next(iter(blocks.values())) if blocks else None

    def allocate(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the free queue's head (ref count 1 each, no hash); a cached one
        loses its hash (an eviction). RuntimeError, and no change, when fewer are free."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free_queue)} free")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            self._drop_hash(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one owner to each block (cache hits); a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one owner from each block, in the order given; a block reaching 0 goes to the
        free queue's tail, keeping its hash and contents."""
        for block in blocks:
            assert block.ref_cnt > 0, f"{block} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register an owned, full block under `block_hash`; nothing when it already has it.
        True when no other block held `block_hash` (the pool has a new key)."""
        if block.block_hash is not None:
            assert block.block_hash == block_hash, f"{block} is cached under another hash"
            return False
        block.block_hash = block_hash
        same = self.cached.setdefault(block_hash, {})
        same[block.block_id] = block
        self.num_cached_blocks += 1
        return len(same) == 1

    def cache_last_block(self, block: KVBlock, last_hash: BlockHash) -> None:
        """Register an owned block, whose first slots hold a prompt's last tokens (K/V computed),
        under their last-block key; nothing when it already has it."""
        if block.last_hash is not None:
            assert block.last_hash == last_hash, f"{block} is a last block under another key"
            return
        block.last_hash = last_hash
        self.last_blocks.setdefault(last_hash, {})[block.block_id] = block

    def drop_hash(self, block: KVBlock) -> None:
        """Unregister `block` (its K/V are not what its keys say); nothing when it has none."""
        self._drop_hash(block)

    def _drop_hash(self, block: KVBlock) -> None:
        if self.on_block_dropped is not None and (block.block_hash is not None or block.last_hash is not None):
            self.on_block_dropped(block)
        if block.last_hash is not None:
            _unmap(self.last_blocks, block.last_hash, block.block_id)
            block.last_hash = None
        if block.block_hash is None:
            return
        if _unmap(self.cached, block.block_hash, block.block_id) and self.on_key_removed is not None:
            self.on_key_removed(block.block_hash)
        block.block_hash = None
        self.num_cached_blocks -= 1
        self.num_evictions += 1

    def drop_all_keys(self) -> int:
        """Unregister every block (`reset_prefix_cache`): no lookup finds anything computed so far.
        Owned blocks keep their contents for their owners. Counts no eviction and calls neither
        callback (the caller clears what they feed, at once). The blocks that had keys."""
        keyed = 0
        for block in self.blocks:
            if block.block_hash is not None or block.last_hash is not None:
                block.block_hash = block.last_hash = None
                keyed += 1
        self.cached.clear()
        self.last_blocks.clear()
        self.num_cached_blocks = 0
        return keyed

    def check_integrity(self) -> None:
        self.free_queue.check_integrity()
        queued = {b.block_id for b in self.free_queue}
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"{b} has a negative ref count"
            assert (b.ref_cnt == 0) == (b.block_id in queued), f"{b}: free={b.block_id in queued}"
            if b.block_hash is not None:
                assert self.cached.get(b.block_hash, {}).get(b.block_id) is b, f"{b} missing from the hash map"
            if b.last_hash is not None:
                assert self.last_blocks.get(b.last_hash, {}).get(b.block_id) is b, f"{b} missing from the last map"
        in_map = [(h, i, b) for h, same in self.cached.items() for i, b in same.items()]
        assert all(same for same in self.cached.values()), "an empty entry in the hash map"
        for h, i, b in in_map:
            assert b is self.blocks[i] and b.block_hash == h, f"hash map entry {i} disagrees with {b}"
        assert len(in_map) == self.num_cached_blocks, "num_cached_blocks is off"
        for h, same in self.last_blocks.items():
            assert same and all(b is self.blocks[i] and b.last_hash == h for i, b in same.items()), \
                f"last-block map entry {h[:4].hex()} disagrees with its blocks"


def _unmap(index: dict[BlockHash, dict[int, KVBlock]], key: BlockHash, block_id: int) -> bool:
    """Take block `block_id` out of `index[key]`, and the key out when no block is left (True then)."""
    same = index[key]
    del same[block_id]
    if not same:
        del index[key]
    return not same
