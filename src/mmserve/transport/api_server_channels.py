"""P1's side of its channels to the API servers (P0s) that send it requests.

One API server (the default) is the case of `--api-server-count 1`. With M > 1 every API server
binds its own input and output socket for this engine core: P1 connects one PULL socket to all M
inputs (fair-queued; each server's messages keep their order) and one PUSH socket to each
output, and every request carries `client_index`, its server's index.

Contract.
- `register(request)` remembers which server the request came from (ValueError for an index no
  server has: the request's error output then goes to server 0); `restore(request)` restores its
  items sent by hash alone from that server's own IPC receiver cache (each mirrors one sender;
  the engine's IPC budget is split evenly between the M servers, so M servers hold no more
  than one) and returns the hashes it lacks.
- `send(outputs, stats, resend)` sends each server its own requests' outputs and resend asks,
  and every server the stats whenever they changed since its last send (every server routes
  and reports metrics from them); a request's server is forgotten once its last output is sent.
- `broadcast(msg)` sends a message (ready, failed) to every server; `stats_out`, when given (the
  data-parallel coordinator with M > 1), gets the stats too, as `RankStats` of this `rank`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from mmserve.ipc.launcher_messages import RankStats
from mmserve.ipc.messages import CachesReset, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from mmserve.ipc.queues import QueueSender
from mmserve.multimodal.cache import IpcReceiverCache


class ApiServerChannels:
    def __init__(self, outputs: Sequence[QueueSender[Any]], ipc_cache_bytes: int, rank: int = 0,
                 stats_out: QueueSender[Any] | None = None) -> None:
        """`ipc_cache_bytes`: each server's share of the IPC cache (0: no receivers)."""
        self.outputs = list(outputs)
        self.rank = rank
        self.receivers = [IpcReceiverCache(ipc_cache_bytes) for _ in self.outputs] if ipc_cache_bytes > 0 else None
        self.stats_out = stats_out
        self._client: dict[str, int] = {}  # request id -> the server it came from
        self._last_stats: list[SchedulerStats | None] = [None] * len(self.outputs)
        self._last_shared: SchedulerStats | None = None
        self._reset_items: set[int] = set()  # servers to tell that another reset the multimodal caches

    def register(self, request: EngineCoreRequest) -> None:
        self.check_client(request.client_index)
        self._client[request.request_id] = request.client_index

    def check_client(self, client_index: int) -> None:
        """ValueError unless `client_index` is one of this engine core's API servers."""
        if not 0 <= client_index < len(self.outputs):
            raise ValueError(f"client_index {client_index} is not an API server of this engine core "
                             f"(it has {len(self.outputs)})")

    def restore(self, request: EngineCoreRequest) -> list[str]:
        if self.receivers is None:
            return []
        return self.receivers[request.client_index].update(request.mm_items, request.ipc_epoch)

    def start_epoch(self, client_index: int, epoch: int) -> None:
        """Empty API server `client_index`'s IPC receiver, which starts `epoch` (its sender's, reset)."""
        if self.receivers is not None:
            self.receivers[client_index].start_epoch(epoch)

    def items_reset_by(self, client_index: int) -> None:
        """API server `client_index` reset its item layers: every other server is told to, with its next outputs."""
        self._reset_items.update(c for c in range(len(self.outputs)) if c != client_index)

    def forget(self, request_id: str) -> None:
        self._client.pop(request_id, None)

    def broadcast(self, msg: Any, timeout_s: float | None = None) -> None:
        for out in self.outputs:
            out.send(msg, timeout_s=timeout_s)

    def send(self, outputs: list[EngineCoreOutput], stats: SchedulerStats | None,
             resend: dict[str, list[str]], resets: Sequence[tuple[int, CachesReset]] = ()) -> None:
        """Each API server's outputs, resends and cache resets (`(client_index, done)`), with the
        stats when they changed for it; nothing to a server with nothing new."""
        by_client: list[list[EngineCoreOutput]] = [[] for _ in self.outputs]
        for out in outputs:
            by_client[self._client.get(out.request_id, 0)].append(out)
            if out.finish_reason is not None and not out.siblings_running:
                self.forget(out.request_id)
        asks: list[dict[str, list[str]]] = [{} for _ in self.outputs]
        for request_id, missing in resend.items():
            asks[self._client.pop(request_id, 0)][request_id] = missing
        done: list[list[CachesReset]] = [[] for _ in self.outputs]
        for client, reset in resets:
            done[client].append(reset)
        for client, queue in enumerate(self.outputs):
            own = stats
            if stats is not None and self.receivers is not None:  # its receiver's half, to compare with its sender
                own = msgspec.structs.replace(stats, caches={**stats.caches,
                                                             "ipc_receiver": self.receivers[client].stats()})
            told = client in self._reset_items
            if not by_client[client] and not asks[client] and not done[client] and not told \
                    and own == self._last_stats[client]:
                continue
            queue.send(EngineCoreOutputs(by_client[client], own, asks[client], done[client], told))
            self._reset_items.discard(client)
            self._last_stats[client] = own
        if self.stats_out is not None and stats is not None and stats != self._last_shared:
            self.stats_out.send(RankStats(self.rank, stats))
            self._last_shared = stats

    def close(self) -> None:
        for out in self.outputs:
            out.close()
        if self.stats_out is not None:
            self.stats_out.close()
