"""How a request's processed items cross from P0 to P1, decided once from the multimodal config.

- `--mm-cache-type lru` (the default): through the mirrored IPC cache. An item P1 already holds
  crosses as its hash alone; P1 reports a hash it lacks (drift), and the resend starts a new
  epoch (both sides empty) and sends every item whole. A 0 GiB IPC cache sends every item whole.
- `--mm-cache-type shm`: through the shared-memory store. Each item is written once and crosses
  as a handle that P1 (and every tensor-parallel rank) maps in place; an item the store cannot
  take goes whole. A stale handle (evicted meanwhile) is reported missing, and the resend sends
  every item whole. P1 keeps no IPC receiver then (`MultiModalConfig.ipc_cache_bytes` is 0).
  With several API servers there is one store per node, owned by the launcher and written by
  every server (`item_store/node_store.py`); a server's processor cache also finds there the items the
  other servers processed (`fetch`).

With `--api-server-count M` each API server has its own senders, each mirroring its own
receiver in each engine core, at `EngineConfig.ipc_cache_bytes_per_server` (a share of the
budget); every request is stamped with the server's index so its outputs come back to it.

P1's half is `transport/api_server_channels.py` (`ApiServerChannels`) and `ShmItemReader`; both halves read the
same derived config properties (`MultiModalConfig.uses_shm`, `EngineConfig.ipc_cache_bytes_per_server`),
so they agree.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from mmserve.cache_report import CacheReport
from mmserve.config import EngineConfig
from mmserve.transport.undo import UndoLog
from mmserve.ipc.messages import CacheStats, EngineCoreRequest, sum_stats
from mmserve.ipc.items import ShmStoreInfo
from mmserve.item_store.node_store import NodeStoreClient
from mmserve.item_store.shm_store import ShmStore
from mmserve.transport.shm_items import ShmItemWriter
from mmserve.multimodal.cache import IpcSenderCache


class StoreAttachment(Protocol):
    """Where the launcher's node store is, for an API server it started (`Attachment`): the store's
    address and its msgpack `ShmStoreInfo` (holds the handle secret), None when it runs none."""

    @property
    def store(self) -> str | None: ...

    @property
    def store_info(self) -> bytes | None: ...


class ItemTransport:
    """P0's item transport for every data-parallel rank.

    P0's side, for every data-parallel rank: one IPC sender per rank (each mirrors its own
    rank's receiver), one store shared by all of them. `to_wire` registers in `undo` how to take
    back each change it makes (IPC sender keys, shm entries and pins); `finish` ends a request's
    hold on the store. A rank marked `remote` (another node: it cannot map this machine's shared
    memory) gets its items through its IPC sender instead (a 0 GiB one under shm: every item inline)."""

    def __init__(self, config: EngineConfig, attachment: StoreAttachment | None = None) -> None:
        mm = config.multimodal
        self.client_index = config.parallel.api_server_index
        self.senders = [IpcSenderCache(config.ipc_cache_bytes_per_server)
                        for _ in range(config.parallel.data_parallel_size)]
        self.shm = ShmItemWriter(_item_store(config, attachment)) if mm.uses_shm else None
        self.remote: set[int] = set()
        # the node's store is another process's (several API servers): each lookup and put is a
        # round trip, so `prepare` does them off the event loop, while the request resolves
        self.store_round_trips = self.shm is not None and isinstance(self.shm.store, NodeStoreClient)

    @property
    def sender(self) -> IpcSenderCache:
        """Rank 0's IPC sender (the only one without data parallelism)."""
        return self.senders[0]

    @property
    def shm_info(self) -> bytes | None:
        """What P1 attaches to the store with (holds the handle secret: never log it)."""
        return self.shm.info if self.shm is not None else None

    def fetch(self, mm_hash: str) -> dict[str, Any] | None:
        """The processed item another API server put in the node's store.

        The processed item another API server put in the node's store, copied out; else None
        (always None without a node store)."""
        store = self.shm.store if self.shm is not None else None
        return store.fetch(mm_hash) if isinstance(store, NodeStoreClient) else None

    def known_tokens(self, mm_hash: str) -> int | None:
        """The placeholder count of an item some rank holds through the IPC cache, else None."""
        for sender in self.senders:
            if (tokens := sender.num_tokens(mm_hash)) is not None:
                return tokens
        return None

    def to_wire(self, request: EngineCoreRequest, undo: UndoLog, resend: bool = False,
                rank: int = 0, report: CacheReport | None = None) -> tuple[EngineCoreRequest, bool]:
        """The request as it crosses to `rank`'s P1.

        (the message for `rank`'s P1, whether some item crosses by reference — a hash or a
        handle — so P1 may report it missing). `resend`: P1 lacked an item of this request last time.
        A shadow request (`bypass_caches`) sends every item whole and touches no cache; `report`
        gets the lookups of the layer the items went through (`ipc` or `shm`)."""
        if request.bypass_caches:
            return msgspec.structs.replace(request, client_index=self.client_index), False
        if self.shm is not None and rank not in self.remote:
            return self._through_store(request, undo, resend, report)
        sender = self.senders[rank]
        if resend:
            sender.reset()
        undo.push(sender.rollback, sender.checkpoint())
        cached = sender.update(request.mm_items)
        if report is not None and sender.enabled and cached:
            report.count("ipc", sum(cached), len(cached))
        items = [msgspec.structs.replace(i, data=None) if hit else i for i, hit in zip(request.mm_items, cached)]
        return (msgspec.structs.replace(request, mm_items=items, ipc_epoch=sender.epoch,
                                        client_index=self.client_index), any(cached))

    def prepare(self, request: EngineCoreRequest, undo: UndoLog,
                report: CacheReport | None = None) -> EngineCoreRequest | None:
        """The request's message through the node's store, made ahead (in the resolving worker
        thread) where the store's lookups and puts are round trips; None elsewhere, or for a
        shadow request (`to_wire` makes the message at the send). Registers its undo like `to_wire`."""
        if not self.store_round_trips or request.bypass_caches:
            return None
        return self._through_store(request, undo, False, report)[0]

    def _through_store(self, request: EngineCoreRequest, undo: UndoLog, resend: bool,
                       report: CacheReport | None) -> tuple[EngineCoreRequest, bool]:
        assert self.shm is not None
        written: list[str] = []
        undo.push(self.shm.finish, request.request_id)
        undo.push(self.shm.discard, written)
        items = self.shm.to_wire(request, resend, written)  # a resend goes inline
        by_handle = sum(item.shm_handle is not None for item in items)
        if report is not None and items:
            report.count("shm", by_handle - len(written), len(items))
        return (msgspec.structs.replace(request, mm_items=items, client_index=self.client_index), by_handle > 0)

    def restarted(self, rank: int, remote: bool = False) -> None:
        """`rank`'s engine core is new: its IPC mirror starts from empty.

        `rank`'s engine core is new (empty caches), on this node or not: its IPC mirror starts
        a new epoch from empty."""
        self.senders[rank].reset()
        self.remote.discard(rank)
        if remote:
            self.remote.add(rank)

    def reset(self, store: bool = True) -> tuple[list[int], int]:
        """Drop what the transport's layers hold (`/reset_mm_cache`): every IPC sender starts a new
        epoch from empty, and (with `store`) the store drops every entry no request pins. Each
        rank's new epoch (for its receiver), and the store entries dropped."""
        for sender in self.senders:
            sender.reset()
        dropped = self.shm.store.drop_unused() if self.shm is not None and store else 0
        return [sender.epoch for sender in self.senders], dropped

    def finish(self, request_id: str) -> None:
        """The request ended (finished, aborted or failed): unpin its store entries."""
        if self.shm is not None:
            self.shm.finish(request_id)

    def stats(self, rank: int | None = None) -> dict[str, CacheStats]:
        """The transport's cache layers, of one rank or of the node.

        The layers of `rank` (its IPC sender), or with None the node's: the store, and the IPC
        senders summed over ranks."""
        if rank is not None:
            return {"ipc": self.senders[rank].stats()}
        layers = {"ipc": sum_stats([sender.stats() for sender in self.senders])}
        if self.shm is not None:
            layers["shm"] = self.shm.stats()
        return layers

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()


def _item_store(config: EngineConfig, attachment: StoreAttachment | None) -> ShmStore | NodeStoreClient:
    """This server's own store, or the node's when its launcher runs one (several API servers)."""
    if attachment is not None and attachment.store is not None and attachment.store_info is not None:
        info = msgspec.msgpack.decode(attachment.store_info, type=ShmStoreInfo)
        return NodeStoreClient(attachment.store, info, config.parallel.api_server_index)
    mm = config.multimodal
    return ShmStore.from_flags(mm.mm_shm_cache_gb, mm.mm_shm_max_object_mb)
