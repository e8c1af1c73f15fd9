"""What `AsyncLLM` reports (`/metrics`, the periodic log): the ranks' stats with P0's cache layers.

The engine cores' latest stats with P0's own cache layers merged in, per rank and summed.

With several API servers (`--api-server-count`) each keeps its own processor cache, IPC senders
and counts of what each rank served for it; one /metrics must answer for all of them. So every
server writes its own figures to a file in the launcher's metrics directory (`SharedFigures`:
at most every `SHARE_EVERY_S`, and only after one of its requests ended) and sums every other
server's last file into its own, so a figure reaches the other servers' /metrics within
`SHARE_EVERY_S`. The engine cores' figures need no sharing: every rank sends its stats
to every server.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec

from mmserve.frontend.engine_client.sender import RankSender
from mmserve.transport.item_transport import ItemTransport
from mmserve.multimodal.processor_cache import ProcessorCache
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
    """The ranks' latest stats (`record`, `forget`) and every figure built from them.

    `processor_cache` is P0's processor cache, `transport` its item transport, `sender` what each
    rank served; `shared` (several API servers) the other servers' figures."""

    def __init__(self, processor_cache: ProcessorCache, transport: ItemTransport, sender: RankSender,
                 shared: SharedFigures | None) -> None:
        self.processor_cache = processor_cache
        self.transport = transport
        self.sender = sender
        self.shared = shared
        self.latest: dict[int, SchedulerStats] = {}  # per rank, absent while it is down
        self.changed = False  # a request ended since the last `publish`

    def record(self, rank: int, stats: SchedulerStats) -> None:
        self.latest[rank] = stats

    def forget(self, rank: int) -> None:
        """Rank `rank` is down: its stats go until it reports again."""
        self.latest.pop(rank, None)

    def stats(self) -> SchedulerStats | None:
        """The engine cores' latest stats summed over ranks, with P0's cache layers (processor, ipc, shm) merged in."""
        others = self._others()
        ranks = [self._rank_stats(r, others) for r in self.latest]
        base = sum_scheduler_stats(ranks) if ranks else SchedulerStats(0, 0, 0, 0, 0)
        return msgspec.structs.replace(base, caches={**base.caches, **self.frontend_stats(others)})

    def frontend_stats(self, others: list[ServerShare] | None = None) -> dict[str, CacheStats]:
        """The cache layers P0 keeps for every rank, over every API server.

        The layers P0 keeps for every rank: the processor cache, the store, the IPC senders summed
        (over every API server: `others` are the other servers' figures, read here when not given)."""
        others = self._others() if others is None else others
        layers = {"processor": self.processor_cache.stats(), **self.transport.stats()}
        if others:
            layers["processor"] = sum_stats([layers["processor"], *(o.processor for o in others)])
            layers["ipc"] = sum_stats([layers["ipc"], *(sum_stats(o.ipc) for o in others)])
        return layers

    def engine_stats(self, others: list[ServerShare] | None = None) -> dict[int, SchedulerStats]:
        """Each rank's latest stats, its IPC senders (P0's half, every server's) merged in."""
        others = self._others() if others is None else others
        return {rank: self._rank_stats(rank, others) for rank in sorted(self.latest)}

    def _rank_stats(self, rank: int, others: list[ServerShare]) -> SchedulerStats:
        layers = self.transport.stats(rank)
        if others:
            layers["ipc"] = sum_stats([layers["ipc"], *(o.ipc[rank] for o in others)])
        return msgspec.structs.replace(self.latest[rank], caches={**self.latest[rank].caches, **layers})

    def _others(self) -> list[ServerShare]:
        return self.shared.others() if self.shared is not None else []

    def dp_figures(self) -> DataParallelFigures:
        """Per rank: up, restarts, stats, what it served; and the routing decisions (for /metrics)."""
        others = self._others()
        figures = self.sender.figures(self.engine_stats(others))
        for other in others:
            for rank, (requests, prompt, generated) in zip(figures.ranks, other.served):
                rank.requests += requests
                rank.prompt_tokens += prompt
                rank.generation_tokens += generated
        return figures

    def publish(self) -> None:
        """Write this server's own figures for the others (several API servers only)."""
        self.changed = False
        if self.shared is not None:
            ranks = range(len(self.transport.senders))
            self.shared.publish(ServerShare(self.processor_cache.stats(),
                                            [self.transport.stats(r)["ipc"] for r in ranks], self.sender.served()))

    async def share_periodically(self) -> None:
        """Publish within `SHARE_EVERY_S` of a request's end, for as long as the server runs."""
        while True:
            if self.changed:
                self.publish()
            await asyncio.sleep(SHARE_EVERY_S)
