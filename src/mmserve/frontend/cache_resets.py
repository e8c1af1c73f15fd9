"""P0's half of a cache reset (vLLM's `reset_prefix_cache`, `reset_mm_cache`, `reset_encoder_cache`).

A reset is one `ResetCaches` per serving rank, answered by a `CachesReset` in that rank's next
outputs to this API server; `reset_mm_cache` first empties P0's own layers — the processor cache,
every IPC sender (a new epoch, which the ask carries to the rank's receiver) and the item store's
unpinned entries. With several API servers, each engine core tells the other servers, which empty
their own processor caches and IPC senders (`reset_by_another_server`). What each layer drops and
keeps is written once, in `engine/cache_reset.py`.
A rank that dies before it answers holds nothing any more: its answer is skipped. A rank with no
engine core now is skipped the same way (a restarted one starts empty).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, fields
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mmserve.frontend.engine_client.core_client import EngineDeadError
from mmserve.ipc.messages import CachesReset, ResetCaches

if TYPE_CHECKING:
    from mmserve.frontend.engine_client.engine_ranks import EngineRanks
    from mmserve.frontend.input_processor import InputProcessor
    from mmserve.transport.item_transport import ItemTransport


@dataclass
class ResetReport:
    """What a reset dropped, summed over the ranks (the body of the server's reset routes)."""

    prefix_blocks: int = 0  # KV blocks that had keys
    first_tokens: int = 0
    encoder_items: int = 0
    processor_items: int = 0  # P0's processor cache
    store_items: int = 0  # the shared-memory item store's unpinned entries

    def add(self, done: CachesReset) -> None:
        self.prefix_blocks += done.prefix_blocks
        self.first_tokens += done.first_tokens
        self.encoder_items += done.encoder_items

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def reset_frontend_items(inputs: InputProcessor, transport: ItemTransport | None, report: ResetReport,
                         store: bool = True) -> list[int]:
    """Empty P0's item layers (`reset_mm_cache`; the item store's unpinned entries too with `store`);
    each rank's new IPC epoch (none without a transport)."""
    report.processor_items = inputs.processor_cache.clear()
    if transport is None:
        return []
    epochs, report.store_items = transport.reset(store)
    return epochs


def reset_asks(clients: Sequence[object | None], call_id: int, prefix: bool, encoder: bool, mm: bool,
               epochs: list[int], client_index: int) -> dict[int, ResetCaches]:
    """One `ResetCaches` per rank with an engine core (`epochs`: each rank's new IPC epoch, for `mm`)."""
    return {rank: ResetCaches(call_id, prefix, encoder, mm, epochs[rank] if epochs else 0, client_index)
            for rank, client in enumerate(clients) if client is not None}


class CacheResets:
    """The resets this API server asked its ranks for and awaits (`reset`, answered by `answered`)."""

    def __init__(self, ranks: EngineRanks, inputs: InputProcessor, transport: ItemTransport) -> None:
        self.ranks = ranks
        self.inputs = inputs
        self.transport = transport
        self._ids = itertools.count(1)
        self._waiting: dict[tuple[int, int], asyncio.Future[CachesReset | None]] = {}  # (rank, call id)

    async def reset(self, prefix: bool, encoder: bool, mm: bool) -> ResetReport:
        """Empty P0's item layers (`mm`), then ask every serving rank and await the answers; what was dropped."""
        report = ResetReport()
        epochs: list[int] = []
        if mm and self.transport.store_round_trips:  # the node's store answers a round trip: off the event loop
            epochs = await asyncio.to_thread(reset_frontend_items, self.inputs, self.transport, report)
        elif mm:
            epochs = reset_frontend_items(self.inputs, self.transport, report)
        call_id = next(self._ids)
        loop = asyncio.get_running_loop()
        waits = []
        asks = reset_asks(self.ranks.clients, call_id, prefix, encoder, mm, epochs, self.transport.client_index)
        for rank, ask in asks.items():
            self._waiting[rank, call_id] = future = loop.create_future()
            try:
                self.ranks.client(rank).reset_caches(ask)
            except EngineDeadError:
                del self._waiting[rank, call_id]
                continue
            waits.append(future)
        for done in await asyncio.gather(*waits):
            if done is not None:
                report.add(done)
        return report

    def reset_by_another_server(self) -> None:
        """Another API server reset the multimodal caches: this one's processor cache and IPC senders
        too (the node's store is reset already). Each rank tells it; a second time is cheap."""
        reset_frontend_items(self.inputs, self.transport, ResetReport(), store=False)

    def answered(self, rank: int, resets: list[CachesReset]) -> None:
        for done in resets:
            future = self._waiting.pop((rank, done.call_id), None)
            if future is not None and not future.done():
                future.set_result(done)

    def rank_gone(self, rank: int) -> None:
        """`rank`'s engine core died: its caches are gone with it."""
        for key in [key for key in self._waiting if key[0] == rank]:
            future = self._waiting.pop(key)
            if not future.done():
                future.set_result(None)
