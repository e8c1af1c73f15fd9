"""How P0 puts a request on its engine core's wire, and takes it off: one rank or many alike.

Contract.
- `send` puts a request on a live rank's wire through the item transport and returns the rank:
  rank 0 without data parallelism (no router, nothing kept per request); with it, the `Router`'s
  pick (or the one `pick` made ahead, if that rank still serves), counted in the router's load
  (`on_sent`, and `land` once the request ends). Each change before the send is registered in the
  caller's `UndoLog`. `resend` sends a request again, whole, to the same rank (P1 lacked an item
  it got by reference).
- Nothing per request lives here: the caller keeps the rank (`open_request.py: OpenRequest`; the
  offline data-parallel driver, `rank_processes.py`, its own table). What stays is per rank: what
  each served (`served`), for /metrics.
"""

from __future__ import annotations

from mmserve.cache_report import CacheReport
from mmserve.frontend.dp.dp_router import Route, Router
from mmserve.frontend.engine_client.core_client import EngineDeadError
from mmserve.frontend.engine_client.engine_ranks import EngineRanks
from mmserve.ipc.messages import EngineCoreRequest, SchedulerStats
from mmserve.outputs import RequestOutput
from mmserve.rank_metrics import DataParallelFigures, RankFigures
from mmserve.transport.item_transport import ItemTransport
from mmserve.transport.undo import UndoLog


class RankSender:
    """Sends, resends and aborts requests on the engine ranks; `router` is None with one rank."""

    def __init__(self, ranks: EngineRanks, router: Router | None, transport: ItemTransport) -> None:
        self.ranks = ranks
        self.router = router
        self.transport = transport
        self._served = [[0, 0, 0] for _ in range(len(ranks))]  # per rank: requests, prompt, generated tokens

    async def pick(self, request: EngineCoreRequest, forced: int | None = None) -> Route | None:
        """The request's route decided ahead of `send`, awaited where the router is remote (None:
        decided in `send`). Nothing is registered: a route asked for but never sent is dropped."""
        route_async = getattr(self.router, "route_async", None)
        live = self.ranks.live()
        if route_async is None or not live:
            return None
        route: Route = await route_async(request, live, forced)
        return route

    def send(self, request: EngineCoreRequest, undo: UndoLog, report: CacheReport | None = None,
             forced: int | None = None, picked: Route | None = None, wire: EngineCoreRequest | None = None) -> int:
        """Send `request` (as `wire`, its message made ahead by `ItemTransport.prepare`, unless the rank
        is on another node) to its rank, which is returned; its changes registered in `undo`."""
        live = self.ranks.live()
        if not live:
            raise EngineDeadError("no engine rank is serving")
        route = None
        if self.router is not None:
            route = picked if picked is not None and picked.rank in live else self.router.route(request, live, forced)
        rank = route.rank if route is not None else 0
        self._put(rank, request, undo, False, report, wire)
        if route is not None and self.router is not None:
            self.router.on_sent(route, request)
        return rank

    def resend(self, rank: int, request: EngineCoreRequest, undo: UndoLog, report: CacheReport | None) -> None:
        """Send `request` again to `rank`, every item whole (P1 lacked one it got by reference)."""
        self._put(rank, request, undo, True, report)

    def _put(self, rank: int, request: EngineCoreRequest, undo: UndoLog, resend: bool,
             report: CacheReport | None, wire: EngineCoreRequest | None = None) -> None:
        if wire is not None and rank not in self.transport.remote:
            message = wire
        else:
            message, _ = self.transport.to_wire(request, undo, resend, rank, report)
        self.ranks.client(rank).add_request(message)

    def abort(self, by_rank: dict[int, list[str]]) -> None:
        """Tell each live rank to stop its requests (a dead rank's are gone with it)."""
        live = self.ranks.live()
        for rank, ids in by_rank.items():
            if rank in live:
                self.ranks.client(rank).abort_requests(ids)

    def land(self, rank: int) -> None:
        """A request sent to `rank` ended (finished, failed or aborted): it leaves the rank's load."""
        if self.router is not None:
            self.router.on_finished(rank)

    def orphaned(self, rank: int) -> None:
        """`rank` died: the router forgets what it believed the rank held (its caches start empty)."""
        if self.router is not None:
            self.router.forget(rank)

    def count_served(self, rank: int, result: RequestOutput) -> None:
        """A request's last output came from `rank`: count it, its prompt and generated tokens."""
        served = self._served[rank]
        served[0] += 1
        served[1] += len(result.prompt_token_ids or [])
        served[2] += sum(len(c.token_ids) for c in result.outputs)

    def served(self) -> list[list[int]]:
        """Per rank: requests it finished, their prompt and generated tokens."""
        return [list(counts) for counts in self._served]

    def figures(self, stats: dict[int, SchedulerStats]) -> DataParallelFigures:
        """Each rank's state and what it served, with its latest `stats` (absent while down)."""
        live = self.ranks.live()
        ranks = [RankFigures(r, r in live, self.ranks.restarts[r], stats.get(r), *self._served[r])
                 for r in range(len(self.ranks))]
        return DataParallelFigures(ranks, dict(self.router.decisions) if self.router is not None else {})
