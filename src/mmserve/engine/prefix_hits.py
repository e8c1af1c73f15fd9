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

Partial blocks (`--enable-partial-block-caching`, `partial_prefix.py`): when the last block does
not hit, the tokens after the full-block hits (at most all but the prompt's last) are looked up in
the index of computed blocks under the same parent; the longest reusable leading part of one is
copied likewise, and the prefill starts after it (counted as `partial_block`, when some computed
block follows the same prefix: the tokens copied, of those looked up). Only a request with at least
one full-block hit looks: what the first block of two prompts shares is a chat template's few tokens
(a BOS, a role tag), worth neither a copy nor the noise in the report (a reused token makes the
request cache-served, which the shadow verifier then re-runs). The copied part, like a
hit, never ends strictly inside the placeholders of an item whose encoder output is not resident.
Blocks are filed in the index once the step that computed them has run (`cache_computed`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from mmserve.engine.kv_cache import KVBlock, KVCacheManager
from mmserve.engine.partial_prefix import file_block, find_reusable
from mmserve.engine.request import Request
from mmserve.ipc.items import MultiModalItem

MIN_PARTIAL_TOKENS = 1  # the shortest leading part of a block worth a copy


class PrefixHit(NamedTuple):
    """What admission takes from the prefix cache: the full `blocks` to share, then `copy` (or
    None), a block the runner copies into the request's own block after them; `num_tokens`, the
    prompt tokens whose K/V the two give; `last_block`: `copy` is an identical prompt's last block
    (every prompt token but the last), or, for an embedding whose last token starts its block, the
    full blocks reach that token (nothing to copy: `ends_on_hits`)."""

    blocks: list[KVBlock]
    copy: KVBlock | None = None
    num_tokens: int = 0
    last_block: bool = False


class PrefixHits:
    """The prefix-cache side of admission over `kv_cache`; `resident(mm_hash)` says whether an
    item's encoder output is in the encoder cache."""

    def __init__(self, kv_cache: KVCacheManager, resident: Callable[[str], bool]) -> None:
        self.kv_cache = kv_cache
        self.resident = resident

    def hits(self, req: Request) -> PrefixHit:
        """What a waiting request can take. Changes nothing (the encoder planner then references
        a resident output the hits rely on before anything else can evict it)."""
        bs = self.kv_cache.block_size
        hits = self.kv_cache.find_cached_prefix(req.block_hashes, (req.num_tokens - 1) // bs)
        hits = hits[:back_off_from_placeholders(len(hits) * bs, req.mm_items, bs, self.resident) // bs]
        last = self._last_block(req, len(hits))
        if last is not None:
            return PrefixHit(hits, last, req.num_tokens - 1, last_block=True)
        if self.ends_on_hits(req, len(hits)):
            return PrefixHit(hits, None, req.num_tokens - 1, last_block=True)
        partial, k = self._partial_block(req, len(hits))
        return PrefixHit(hits, partial, len(hits) * bs + k)

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

    def ends_on_hits(self, req: Request, num_hits: int) -> bool:
        """An embedding request (`return_hidden`) whose last prompt token starts a block after
        `num_hits` full hits: the first-token cache may answer it without that token's K/V, which
        it never needs (it ends with its answer); a generation request goes on from that K/V."""
        bs, last = self.kv_cache.block_size, req.num_tokens - 1
        return (req.return_hidden and self.kv_cache.cache_last_blocks and last % bs == 0 and num_hits > 0
                and num_hits == last // bs)

    def _partial_block(self, req: Request, num_hits: int) -> tuple[KVBlock | None, int]:
        """A computed block whose leading part `req`'s block `num_hits` can copy (after at least
        one full hit, before its last token), and that part's length; (None, 0) when none is worth it."""
        index, bs = self.kv_cache.partial, self.kv_cache.block_size
        start = num_hits * bs
        end = min(start + bs - 1, req.num_tokens - 1)
        if index is None or num_hits == 0 or end - start < MIN_PARTIAL_TOKENS:
            return None, 0
        found = find_reusable(index, req, num_hits, start, end)
        if found is None:
            return None, 0  # no computed block follows the hits: nothing to count
        block, k = found
        k = back_off_from_placeholders(start + k, req.mm_items, 1, self.resident) - start
        if block is None or k < MIN_PARTIAL_TOKENS:
            block, k = None, 0
        if req.num_cached_tokens is None:  # counted at the first admission, as the prefix hit is
            req.count_cache("partial_block", k, end - start)
        return block, k

    def cache_scheduled(self, req: Request, num_tokens: int) -> None:
        """Register `req`'s blocks that its first `num_tokens` tokens fill, as soon as they are
        scheduled (`KVCacheManager.cache_full_blocks`); KV events hear of the keys new to the pool."""
        stored = self.kv_cache.cache_full_blocks(req.request_id, req.block_hashes, num_tokens)
        if stored and self.kv_cache.events is not None:
            self.kv_cache.events.stored(req, stored)

    def cache_computed(self, req: Request, num_scheduled: int, computed: int) -> None:
        """After a step of `num_scheduled` tokens of `req` that ended at `computed` tokens has run
        (--async-scheduling: a later step may be scheduled already): register the prompt's last
        block if the step computed its last token (not when that block holds that token alone),
        and file the blocks whose K/V the step completed in the partial-block index."""
        n, bs = req.num_prompt_tokens, self.kv_cache.block_size
        index = self.kv_cache.partial
        blocks = self.kv_cache.req_to_blocks.get(req.request_id, [])
        if self.kv_cache.cache_last_blocks and (n - 1) % bs and computed - num_scheduled < n <= computed:
            self.kv_cache.cache_last_block(req.request_id, n, req.last_block_hash(n))
            last = (n - 1) // bs
            if index is not None and last and blocks[last].last_hash is not None:
                file_block(index, req, blocks[last], last, last * bs, n)
        if index is None:
            return
        for i in range(max(1, (computed - num_scheduled) // bs), computed // bs):  # a first block is never looked up
            if blocks[i].block_hash is not None:
                file_block(index, req, blocks[i], i, i * bs, (i + 1) * bs)


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
