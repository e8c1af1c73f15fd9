"""Which data-parallel rank serves a request (`--dp-routing`), decided in P0 before the send.

Contract.
- P0 keeps a picture of each rank's caches, built from what it sent there: the request's prompt
  block hashes, computed exactly as the rank's prefix cache keys its blocks (`BlockHasher`:
  tokens, `("mm", mm_hash, offset)` and the salt), in LRU order up to the rank's KV blocks; and
  its items' hashes with their placeholder tokens, in LRU order up to the rank's encoder budget.
  A rank that restarts is forgotten (`forget`): its caches start empty.
- `route` scores each live rank: expected reuse = prompt tokens its prefix cache holds (the
  leading blocks found) + placeholder tokens of the items after that prefix whose encoder
  outputs it holds; the gain is that minus the least any live rank would reuse. A gain counts
  when the rank holds more of the request's items than the least-holding rank (an image seen
  there, however small), or when it is two blocks and a tenth of the prompt (a short header that
  every prompt shares does not pull every request onto the first rank that saw it). Load = max(requests P0 has in
  flight there, running + waiting in its last stats) + a KV-pressure term. The imbalance
  guard: only ranks whose load is within `slack + min_load // 2` of the least-loaded rank may
  win on reuse, so one hot image cannot pile every request onto one rank. Among those the largest gain wins; no gain (or
  `--dp-routing load`) picks the least loaded, then the one routed to least, then the lowest.
- Decisions are counted by reason: "pinned" (`X-Data-Parallel-Rank`), "cache" (reuse decided),
  "load" (nothing cached anywhere allowed), "imbalance" (the best-cached rank was over the guard).
- `on_sent` / `on_finished` keep in-flight counts; `set_load` takes a rank's stats.

Single-threaded (P0's event loop).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mmserve.config import EngineConfig
from mmserve.engine.block_hash import BlockHash, BlockHasher
from mmserve.ipc.messages import EngineCoreRequest

REASONS = ("pinned", "cache", "load", "imbalance")


@dataclass
class _RankView:
    """What P0 believes one rank holds, and its load."""

    kv_blocks: int
    encoder_tokens: int
    blocks: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)
    items: OrderedDict[str, int] = field(default_factory=OrderedDict)  # mm_hash -> tokens
    item_tokens: int = 0
    inflight: int = 0
    routed: int = 0
    engine_load: int = 0  # running + waiting in the rank's last stats
    kv_usage: float = 0.0

    def load(self) -> float:
        return max(self.inflight, self.engine_load) + self.engine_load * 6 * max(0.0, self.kv_usage - 0.5)

    def reuse(self, hashes: Sequence[BlockHash], request: EngineCoreRequest, block_size: int) -> int:
        cached = 0
        for h in hashes:
            if h not in self.blocks:
                break
            cached += 1
        prefix = cached * block_size
        return prefix + sum(item.placeholder.length for item in request.mm_items
                            if item.placeholder.end > prefix and item.mm_hash in self.items)

    def held_items(self, request: EngineCoreRequest) -> int:
        """How many of the request's items this rank holds (encoder output or blocks)."""
        return sum(item.mm_hash in self.items for item in request.mm_items)

    def remember(self, hashes: Sequence[BlockHash], request: EngineCoreRequest) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.kv_blocks:
            self.blocks.popitem(last=False)
        for item in request.mm_items:
            if item.mm_hash in self.items:
                self.items.move_to_end(item.mm_hash)
                continue
            self.items[item.mm_hash] = item.placeholder.length
            self.item_tokens += item.placeholder.length
        while self.item_tokens > self.encoder_tokens and self.items:
            self.item_tokens -= self.items.popitem(last=False)[1]


@dataclass(frozen=True)
class Route:
    rank: int
    reason: str
    block_hashes: list[BlockHash]


class Router(Protocol):
    """The one routing interface, in-process or remote.

    The one routing interface: `DPRouter` in this process, or `coordinator.py: RemoteRouter`
    asking the launcher's coordinator (in-process or remote is a transport detail)."""

    @property
    def decisions(self) -> Counter[str]: ...

    def route(self, request: EngineCoreRequest, live: Sequence[int], forced: int | None = None) -> Route: ...

    def on_sent(self, route: Route, request: EngineCoreRequest) -> None: ...

    def on_finished(self, rank: int) -> None: ...

    def set_load(self, rank: int, running_and_waiting: int, kv_usage: float) -> None: ...

    def forget(self, rank: int) -> None: ...


class DPRouter:
    """Routes requests over `num_ranks` ranks; `kv_blocks[r]` is rank r's KV cache size."""

    def __init__(self, config: EngineConfig, kv_blocks: Sequence[int]) -> None:
        parallel, sched = config.parallel, config.scheduler
        self.cache_aware = parallel.dp_routing == "cache_aware"
        self.slack = parallel.dp_imbalance_slack
        self.block_size = config.cache.block_size
        self.hasher = BlockHasher(self.block_size, config.cache.prefix_caching_hash_algo)
        encoder = sched.encoder_cache_tokens if sched.encoder_cache_tokens is not None else sched.max_num_batched_tokens
        self.ranks = [_RankView(blocks, encoder) for blocks in kv_blocks]
        self.decisions: Counter[str] = Counter({reason: 0 for reason in REASONS})

    def route(self, request: EngineCoreRequest, live: Sequence[int], forced: int | None = None) -> Route:
        """The rank for `request` among `live` ones (non-empty); `forced` is one it must take (live)."""
        hashes = self.hasher.new_block_hashes(request.prompt_token_ids, request.mm_items, request.cache_salt, []) \
            if self.cache_aware else []
        if forced is not None:
            return self._decide(forced, "pinned", hashes)  # "pinned": the /metrics label
        views = {r: self.ranks[r] for r in live}
        least = min(views[r].load() for r in live)
        allowed = [r for r in live if views[r].load() <= least + self.slack + least // 2]
        quiet = min(allowed, key=lambda r: (views[r].load(), views[r].routed, r))
        if not hashes and not request.mm_items:
            return self._decide(quiet, "load", hashes)
        reuse = {r: views[r].reuse(hashes, request, self.block_size) for r in live}
        held = {r: views[r].held_items(request) for r in live}
        floor, least_held = min(reuse.values()), min(held.values())
        enough = max(2 * self.block_size, len(request.prompt_token_ids) // 10)  # a shared header is not
        gain = {r: reuse[r] - floor if reuse[r] - floor >= enough or held[r] > least_held else 0 for r in live}
        best = max(allowed, key=lambda r: (gain[r], -views[r].load(), -views[r].routed, -r))
        if gain[best] > 0:
            return self._decide(best, "cache", hashes)
        return self._decide(quiet, "imbalance" if max(gain.values()) > 0 else "load", hashes)

    def _decide(self, rank: int, reason: str, hashes: list[BlockHash]) -> Route:
        self.decisions[reason] += 1
        return Route(rank, reason, hashes)

    def on_sent(self, route: Route, request: EngineCoreRequest) -> None:
        view = self.ranks[route.rank]
        view.inflight += 1
        view.routed += 1
        if self.cache_aware:
            view.remember(route.block_hashes, request)

    def on_finished(self, rank: int) -> None:
        self.ranks[rank].inflight = max(0, self.ranks[rank].inflight - 1)

    def set_load(self, rank: int, running_and_waiting: int, kv_usage: float) -> None:
        self.ranks[rank].engine_load = running_and_waiting
        self.ranks[rank].kv_usage = kv_usage

    def set_kv_blocks(self, rank: int, kv_blocks: int) -> None:
        """Rank `rank`'s KV cache holds `kv_blocks` (known from its stats when not from its ready message)."""
        self.ranks[rank].kv_blocks = kv_blocks

    def forget(self, rank: int) -> None:
        """Rank `rank` restarted: nothing cached, nothing in flight."""
        old = self.ranks[rank]
        self.ranks[rank] = _RankView(old.kv_blocks, old.encoder_tokens, routed=old.routed)
