"""The paged KV cache's bookkeeping: which blocks each request owns.

The tensors live in the model runner ([num_blocks, block_size, Hkv, Dh] per layer); this file
decides block ids only. A request's tokens 0..n-1 sit in its blocks in order: token i in
block `blocks[i // block_size]` at offset `i % block_size`.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """`num_blocks` blocks, each free or referenced.

    Invariant: a block is in the free queue exactly when its ref count is 0. The queue is
    FIFO: blocks are handed out in the order they were freed (least recently used first).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each). The caller checks `num_free_blocks` first."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the free queue's end."""
        for b in blocks:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is queued twice"
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has ref count {rc}"
            assert (rc == 0) == (b in free), f"block {b}: ref count {rc} but free={b in free}"


class KVCacheManager:
    """Owns each request's block list; `allocate_slots` grows it, `free` returns it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        """True when the request's first `num_tokens` tokens can have slots."""
        have = len(self.req_to_blocks.get(request_id, ()))
        return self.blocks_needed(num_tokens) - have <= self.pool.num_free_blocks

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's blocks to hold `num_tokens` tokens in all; return the new block ids,
        or None (and change nothing) when too few blocks are free."""
        if not self.can_allocate(request_id, num_tokens):
            return None
        blocks = self.req_to_blocks.setdefault(request_id, [])
        new = self.pool.allocate(max(0, self.blocks_needed(num_tokens) - len(blocks)))
        blocks.extend(new)
        return new

    def free(self, request_id: str) -> None:
        """Release all the request's blocks, last block first (so tail blocks are reused first)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.pool.free(blocks[::-1])

    def check_integrity(self) -> None:
        """Every block is free or owned; ref counts equal the number of owners."""
        self.pool.check_integrity()
        owners = [0] * self.pool.num_blocks
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                owners[b] += 1
        assert owners == self.pool.ref_counts, "ref counts disagree with request ownership"
