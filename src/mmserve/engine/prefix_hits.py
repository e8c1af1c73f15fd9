"""What a waiting request takes from the prefix cache, and what a computed prompt leaves in it.

A request being admitted takes the longest run of cached full blocks that match its block hashes.
At least one token is always computed (the hit is capped at `num_tokens - 1`), and a hit never
ends strictly inside the placeholder range of an item whose encoder output is not resident (see
`back_off_from_placeholders`).

Last blocks (`--enable-last-block-caching`): capped like that, a prompt that hits whole would
recompute its last block — up to `block_size` tokens. So once the step that computed a prompt's
last token has run, the block holding it is registered under a key of the tokens it holds (full
or partial, see `block_hash.py`). A later request whose full-block hits reach its own last block
looks that key up; on a hit the runner copies the block into the request's own last block (a
request never writes into a block another may read) and only the last token is computed.
"""

from __future__ import annotations

from typing import Callable, Sequence

from mmserve.engine.kv_cache import KVBlock, KVCacheManager
from mmserve.engine.request import Request
from mmserve.ipc.items import MultiModalItem


class PrefixHits:
    """The prefix-cache side of admission over `kv_cache`; `resident(mm_hash)` says whether an
    item's encoder output is in the encoder cache."""

    def __init__(self, kv_cache: KVCacheManager, resident: Callable[[str], bool]) -> None:
        self.kv_cache = kv_cache
        self.resident = resident

    def hits(self, req: Request) -> tuple[list[KVBlock], KVBlock | None]:
        """The full blocks a waiting request can take, and the last block to copy after them (or
        None). Changes nothing (the encoder planner then references a resident output the hits
        rely on before anything else can evict it)."""
        bs = self.kv_cache.block_size
        hits = self.kv_cache.find_cached_prefix(req.block_hashes, (req.num_tokens - 1) // bs)
        hits = hits[:back_off_from_placeholders(len(hits) * bs, req.mm_items, bs, self.resident) // bs]
        return hits, self._last_block(req, len(hits))

    def _last_block(self, req: Request, num_hits: int) -> KVBlock | None:
        """An identical prompt's computed last block, when `num_hits` full blocks cover every block
        before `req`'s last, that block holds at least two of its tokens (else the copy saves
        nothing), and its last token is not inside the placeholders of an item whose encoder output
        is not resident."""
        bs, last = self.kv_cache.block_size, req.num_tokens - 1
        if not self.kv_cache.cache_last_blocks or num_hits != last // bs or last % bs == 0:
            return None
        if back_off_from_placeholders(last, req.mm_items, bs, self.resident) != last:
            return None
        block = self.kv_cache.find_last_block(req.last_block_hash(req.num_tokens))
        req.count_cache("last_block", int(block is not None), 1)
        return block

    def cache_prompt_last_block(self, req: Request, num_scheduled: int) -> None:
        """After a step of `num_scheduled` tokens of `req` has run: if it computed the prompt's last
        token, register the block holding it (not when it holds that token alone)."""
        n, bs = req.num_prompt_tokens, self.kv_cache.block_size
        if self.kv_cache.cache_last_blocks and (n - 1) % bs and \
                req.num_computed_tokens - num_scheduled < n <= req.num_computed_tokens:
            self.kv_cache.cache_last_block(req.request_id, n, req.last_block_hash(n))


def back_off_from_placeholders(num_tokens: int, mm_items: Sequence[MultiModalItem], block_size: int,
                               resident: Callable[[str], bool] | None = None) -> int:
    """The longest block-aligned prefix of at most `num_tokens` tokens that does not end strictly
    inside the placeholder range of an item that is not `resident(mm_hash)` (`num_tokens` itself
    when it does not end inside one, aligned or not).

    A cached prefix that ends inside an image leaves the rest of its placeholders to compute,
    which needs the image's encoder output. When that output is resident the hit stands (the
    request references the output before anything can evict it, and the runner scatters the
    remaining rows of it); otherwise the hit backs off to the block holding the image's first
    placeholder (and again, should that block boundary fall inside an earlier image).
    """
    changed = True
    while changed:
        changed = False
        for item in mm_items:
            ph = item.placeholder
            if ph.offset < num_tokens < ph.end and not (resident is not None and resident(item.mm_hash)):
                num_tokens = ph.offset // block_size * block_size
                changed = True
    return num_tokens
