"""What `AsyncLLM` reports (`/metrics`, the periodic log): the engine cores' latest stats with
P0's own cache layers merged in, per rank and summed.

With several API servers (`--api-server-count`) each keeps its own processor cache, IPC senders
and counts of what each rank served for it; one /metrics must answer for all of them. So every
server writes its own figures to a file in the launcher's metrics directory (`SharedFigures`,
~0.4 ms a write on this machine's disk: at most every `SHARE_EVERY_S`, and only after one of its
requests ended) and sums every other server's last file into its own, so a figure reaches the
other servers' /metrics within `SHARE_EVERY_S`. The engine cores' figures need no sharing: every rank sends its stats
to every server.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec

from mmserve.frontend.flights import RequestFlights
from mmserve.frontend.input_processor import InputProcessor
from mmserve.frontend.item_transport import ItemTransport
from mmserve.ipc.messages import CacheStats, SchedulerStats, sum_scheduler_stats, sum_stats
from mmserve.rank_metrics import DataParallelFigures

SHARE_EVERY_S = 0.1


class ServerShare(msgspec.Struct):
    """One API server's own figures."""

    processor: CacheStats
    ipc: list[CacheStats]  # per rank: its IPC sender
    served: list[list[int]]  # per rank: requests, prompt tokens, generated tokens


class SharedFigures:
    """Server `index`'s figures in `directory`, and the others' (a file each, replaced atomically)."""

    def __init__(self, directory: str, index: int) -> None:
        self.directory = Path(directory)
        self.path = self.directory / f"api_server_{index}.figures"
        self._decoder = msgspec.msgpack.Decoder(ServerShare)

    def publish(self, share: ServerShare) -> None:
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.msgpack.encode(share))
        os.replace(tmp, self.path)

    def others(self) -> list[ServerShare]:
        shares = []
        for path in sorted(self.directory.glob("api_server_*.figures")):
            if path != self.path:
                try:
                    shares.append(self._decoder.decode(path.read_bytes()))
                except (OSError, msgspec.DecodeError):  # gone, or being replaced
                    continue
        return shares


class EngineFigures:
    """Mixed into `AsyncLLM`, whose state it uses (declared here)."""

    input_processor: InputProcessor
    transport: ItemTransport
    flights: RequestFlights
    shared: SharedFigures | None
    figures_changed: bool  # a request ended since the last `publish_figures`
    _stats: dict[int, SchedulerStats]

    def stats(self) -> SchedulerStats | None:
        """The engine cores' latest stats summed over ranks, with P0's cache layers (processor,
        ipc, shm) merged in."""
        others = self._others()
        ranks = [self._rank_stats(r, others) for r in self._stats]
        base = sum_scheduler_stats(ranks) if ranks else SchedulerStats(0, 0, 0, 0, 0)
        return msgspec.structs.replace(base, caches={**base.caches, **self.frontend_stats(others)})

    def frontend_stats(self, others: list[ServerShare] | None = None) -> dict[str, CacheStats]:
        """The layers P0 keeps for every rank: the processor cache, the store, the IPC senders summed
        (over every API server: `others` are the other servers' figures, read here when not given)."""
        others = self._others() if others is None else others
        layers = {"processor": self.input_processor.processor_cache.stats(), **self.transport.stats()}
        if others:
            layers["processor"] = sum_stats([layers["processor"], *(o.processor for o in others)])
            layers["ipc"] = sum_stats([layers["ipc"], *(sum_stats(o.ipc) for o in others)])
        return layers

    def engine_stats(self, others: list[ServerShare] | None = None) -> dict[int, SchedulerStats]:
        """Each rank's latest stats, its IPC senders (P0's half, every server's) merged in."""
        others = self._others() if others is None else others
        return {rank: self._rank_stats(rank, others) for rank in sorted(self._stats)}

    def _rank_stats(self, rank: int, others: list[ServerShare]) -> SchedulerStats:
        layers = self.transport.stats(rank)
        if others:
            layers["ipc"] = sum_stats([layers["ipc"], *(o.ipc[rank] for o in others)])
        return msgspec.structs.replace(self._stats[rank], caches={**self._stats[rank].caches, **layers})

    def _others(self) -> list[ServerShare]:
        return self.shared.others() if self.shared is not None else []

    def dp_figures(self) -> DataParallelFigures:
        """Per rank: up, restarts, stats, what it served; and the routing decisions (for /metrics)."""
        others = self._others()
        figures = self.flights.figures(self.engine_stats(others))
        for other in others:
            for rank, (requests, prompt, generated) in zip(figures.ranks, other.served):
                rank.requests += requests
                rank.prompt_tokens += prompt
                rank.generation_tokens += generated
        return figures

    def publish_figures(self) -> None:
        """Write this server's own figures for the others (several API servers only)."""
        self.figures_changed = False
        if self.shared is not None:
            ranks = range(len(self.transport.senders))
            self.shared.publish(ServerShare(self.input_processor.processor_cache.stats(),
                                            [self.transport.stats(r)["ipc"] for r in ranks], self.flights.served()))

    async def share_figures_periodically(self) -> None:
        while True:
            if self.figures_changed:
                self.publish_figures()
            await asyncio.sleep(SHARE_EVERY_S)
