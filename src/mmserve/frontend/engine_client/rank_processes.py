"""N engine-core processes (one per data-parallel rank) behind the offline `OfflineClient` interface.

The server's parts, driven synchronously: `EngineRanks` starts and restarts the engine cores,
`RankSender` routes each request (`DPRouter`) and puts it on the wire through the
`ItemTransport` (IPC sender cache or shm store), and each rank's outputs are polled in turn;
`sent` keeps each request's rank (and the request, for a resend) until it ends.
A rank that dies raises `EngineDeadError` from `get_outputs` (its requests are lost, as when an
in-process engine core raises from its step); it is restarted before the next request is sent,
while its restarts (`--engine-restart-limit`) last.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from mmserve.cache_report import CacheReport
from mmserve.config import EngineConfig
from mmserve.errors import ClientError
from mmserve.frontend.dp.dp_router import DPRouter
from mmserve.frontend.engine_client.core_client import EngineDeadError
from mmserve.frontend.engine_client.engine_ranks import EngineRanks
from mmserve.frontend.engine_client.sender import RankSender
from mmserve.transport.undo import UndoLog
from mmserve.frontend.cache_resets import ResetReport, reset_asks
from mmserve.ipc.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from mmserve.outputs import RequestOutput
from mmserve.rank_metrics import DataParallelFigures
from mmserve.transport.item_transport import ItemTransport

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.002  # how long one poll waits on a rank when no rank had outputs


@dataclass
class Sent:
    """A request on a rank's wire, until it ends: where it runs, and what a resend sends again."""

    rank: int
    request: EngineCoreRequest
    report: CacheReport


class RankProcesses:
    """The data-parallel ranks' engine cores, each in its own process, as one `OfflineClient`."""

    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.transport = ItemTransport(config)
        try:
            self.ranks = EngineRanks(config, model_dir, self.transport.shm_info)
        except BaseException:
            self.transport.close()
            raise
        for rank in range(len(self.ranks)):
            self.transport.restarted(rank, remote=not self.ranks.client(rank).is_local)
        router = DPRouter(config, [self.ranks.client(r).num_kv_blocks for r in range(len(self.ranks))]) \
            if len(self.ranks) > 1 else None
        self.sender = RankSender(self.ranks, router, self.transport)
        self.sent: dict[str, Sent] = {}
        self.max_model_len = self.ranks.client(0).max_model_len
        self._stats: dict[int, SchedulerStats] = {}
        self._ready: list[EngineCoreOutput] = []  # outputs for the next `get_outputs`: errors made here
        # (an item lost by P1) and outputs that came while a cache reset was awaited
        self._reset_ids = itertools.count(1)
        self._next = 0  # the rank polled first, in turn

    def known_tokens(self, mm_hash: str) -> int | None:
        return self.transport.known_tokens(mm_hash)

    def fetch(self, mm_hash: str) -> dict[str, Any] | None:
        return self.transport.fetch(mm_hash)

    def add_request(self, request: Any, report: CacheReport) -> None:
        """Route and send; nothing of the request stays if that raises."""
        self._revive()
        undo = UndoLog()
        try:
            rank = self.sender.send(request, undo, report)
            self.sent[request.request_id] = Sent(rank, request, report)
        except BaseException:
            undo.run()
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            if (sent := self.sent.get(rid)) is not None:
                by_rank.setdefault(sent.rank, []).append(rid)
        self.sender.abort(by_rank)
        self._end(request_ids)

    def finished(self, outputs: list[RequestOutput]) -> None:
        for result in outputs:
            if (sent := self.sent.get(result.request_id)) is not None:
                self.sender.count_served(sent.rank, result)
        self._end([result.request_id for result in outputs])

    def _end(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if (sent := self.sent.pop(rid, None)) is not None:
                self.sender.land(sent.rank)
            self.transport.finish(rid)

    def get_outputs(self) -> list[EngineCoreOutput]:
        """The next outputs of some rank (polled in turn); EngineDeadError if a rank died."""
        ready, self._ready = self._ready, []
        if ready:
            return ready
        live = [rank for rank, client in enumerate(self.ranks.clients) if client is not None]  # dead ones raise
        if not live:
            raise EngineDeadError("no engine rank is serving")
        for wait in (0.0, _IDLE_WAIT_S):
            for i in range(len(live)):
                rank = live[(self._next + i) % len(live)]
                batch = self._poll(rank, wait)
                if batch is not None:
                    self._next = (self._next + i + 1) % len(live)
                    return self._dispatch(rank, batch)
        return []

    def reset_caches(self, prefix: bool, encoder: bool, mm: bool, report: ResetReport) -> None:
        """Reset the named caches (`frontend/cache_resets.py`) on every serving rank, and wait for
        their answers; EngineDeadError if a rank dies meanwhile (as from `get_outputs`)."""
        epochs: list[int] = []
        if mm:
            epochs, report.store_items = self.transport.reset()
        call_id = next(self._reset_ids)
        asks = reset_asks(self.ranks.clients, call_id, prefix, encoder, mm, epochs, self.transport.client_index)
        for rank, ask in asks.items():
            self.ranks.client(rank).reset_caches(ask)
        waiting = list(asks)
        while waiting:
            rank = waiting[0]
            if (batch := self._poll(rank, _IDLE_WAIT_S)) is None:
                continue
            self._ready.extend(self._dispatch(rank, batch))
            for done in batch.resets:
                if done.call_id == call_id:
                    report.add(done)
                    waiting.remove(rank)

    def _poll(self, rank: int, wait: float) -> EngineCoreOutputs | None:
        try:
            return self.ranks.client(rank).get_output(timeout_s=wait)
        except EngineDeadError as e:
            self._retire(rank, str(e))
            raise

    def _retire(self, rank: int, reason: str) -> None:
        """Rank `rank`'s engine core died: retire it (restarted by `_revive`); its requests are lost."""
        logger.error("engine rank %d died: %s", rank, reason)
        self.ranks.mark_dead(rank, reason)
        self.sender.orphaned(rank)  # its requests leave the rank's load; the caller aborts them

    def _dispatch(self, rank: int, batch: EngineCoreOutputs) -> list[EngineCoreOutput]:
        """A rank's batch: stats to the router, items P1 lacked sent again, the outputs returned."""
        if (stats := batch.stats) is not None:
            self._stats[rank] = stats
            if (router := self.sender.router) is not None:
                used = 1 - stats.num_free_blocks / stats.num_total_blocks if stats.num_total_blocks else 0.0
                router.set_load(rank, stats.num_running + stats.num_waiting, used)
        for request_id in batch.resend:
            self._resend(request_id)
        return batch.outputs

    def _resend(self, request_id: str) -> None:
        """P1 lacked items it was sent by hash: send the request again, whole (a new IPC epoch)."""
        sent = self.sent.get(request_id)
        if sent is None:
            return  # aborted meanwhile
        undo = UndoLog()
        try:
            if any(item.data is None for item in sent.request.mm_items):
                raise ClientError("an image given by uuid alone is no longer cached: send it again with its uuid")
            self.sender.resend(sent.rank, sent.request, undo, sent.report)
        except Exception as e:
            undo.run()
            self._ready.append(EngineCoreOutput(request_id, [], finish_reason="abort", error=str(e),
                                                 error_kind="client"))

    def _revive(self) -> None:
        """Restart the ranks that died (while their restarts last) before a request is sent."""
        for rank, client in enumerate(self.ranks.clients):
            if client is not None and not client.is_alive():
                self._retire(rank, "the engine core process exited unexpectedly")
            while self.ranks.status[rank] == "restarting" and self.ranks.can_restart(rank):
                try:
                    client = asyncio.run(self.ranks.restart(rank))
                except Exception as e:
                    logger.error("engine rank %d did not restart: %s", rank, e)
                    continue
                self.transport.restarted(rank, remote=not client.is_local)
                break

    def dp_figures(self) -> DataParallelFigures:
        """Per rank: up, restarts, latest stats, what it served; the routing decisions."""
        return self.sender.figures(self._stats)

    def shutdown(self) -> None:
        self.ranks.shutdown()
        self.transport.close()
