"""The requests P0 sent to engine cores that have not ended: where each runs, which may start over.

Contract.
- `send` routes a request (`DPRouter`, or rank 0 without data parallelism), puts it on the wire
  through the item transport and counts it on its rank; each change before the send is
  registered in the caller's `UndoLog`. `resend` sends it again, whole, to the same rank (P1
  lacked an item it got by reference).
- A flight keeps the whole request while it may still be sent again: until it ends, fails or is
  aborted. When its rank dies (`orphans`) a flight whose caller has seen nothing starts over on a
  live rank; one that has streamed output (`started`) resumes there (`resumed`: its prompt and
  the tokens already sent as the new prompt, the rest of its budget), which continues a greedy or
  seeded request exactly (a seeded draw depends on (seed, position) alone: `worker/model_runner.py:
  _step_seed`). A streamed request that cannot resume exactly (`resumable`: n > 1, a grammar,
  frequency or presence penalties) stops being movable at its first output. Either way a flight
  moves at most once (`moves`; `RankFailover`).
- `land` ends a flight (finished, failed or aborted) and frees its place on its rank; it also
  counts what the rank served. `abort` tells each rank to stop its requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from mmserve.cache_report import CacheReport
from mmserve.frontend.dp.dp_router import Route, Router
from mmserve.frontend.engine_client.core_client import EngineDeadError
from mmserve.frontend.engine_client.engine_ranks import EngineRanks
from mmserve.transport.item_transport import ItemTransport
from mmserve.transport.undo import UndoLog
from mmserve.ipc.messages import EngineCoreRequest, SchedulerStats
from mmserve.outputs import RequestOutput
from mmserve.rank_metrics import DataParallelFigures, RankFigures
from mmserve.sampling_params import SamplingParams


@dataclass
class Flight:
    rank: int
    request: EngineCoreRequest | None  # None once it can no longer be sent again
    prompt_text: str | None
    stream: bool
    report: CacheReport | None = None  # what the caches did for it (the transport counts its layer)
    moves: int = 0  # times it was sent again because its rank died (`RankFailover`: at most once)
    started: bool = False  # its caller has seen output: it resumes rather than starts over
    origin: EngineCoreRequest | None = None  # the request as admitted, once it has resumed


def resumable(params: SamplingParams) -> bool:
    """Whether a request that has streamed output can go on exactly from its prompt and those tokens:
    one completion, and no state beyond the tokens (no grammar, no output-only penalties)."""
    return (params.n == 1 and params.structured_outputs is None and params.frequency_penalty == 0
            and params.presence_penalty == 0)


def resumed(request: EngineCoreRequest, generated: list[int]) -> EngineCoreRequest | None:
    """The request that goes on after `generated` tokens: they join the prompt and leave the budget
    (None when nothing is left to generate)."""
    params = request.sampling_params
    left = params.max_tokens - len(generated)
    if left < 1:
        return None
    params = msgspec.structs.replace(params, max_tokens=left, min_tokens=max(0, params.min_tokens - len(generated)))
    return msgspec.structs.replace(request, prompt_token_ids=request.prompt_token_ids + generated,
                                   sampling_params=params, return_first_logits=False)


class RequestFlights:
    def __init__(self, ranks: EngineRanks, router: Router | None, transport: ItemTransport) -> None:
        self.ranks = ranks
        self.router = router
        self.transport = transport
        self._flights: dict[str, Flight] = {}
        self._served = [[0, 0, 0] for _ in range(len(ranks))]  # per rank: requests, prompt, generated tokens

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._flights

    def get(self, request_id: str) -> Flight | None:
        return self._flights.get(request_id)

    def ids(self) -> list[str]:
        return sorted(self._flights)

    async def pick(self, request: EngineCoreRequest, forced: int | None = None) -> Route | None:
        """The request's route decided ahead of `send`, awaited where the router is remote (None:
        decided in `send`). Nothing is registered: a route asked for but never sent is dropped."""
        route_async = getattr(self.router, "route_async", None)
        live = self.ranks.live()
        if route_async is None or not live:
            return None
        route: Route = await route_async(request, live, forced)
        return route

    def send(self, request_id: str, flight: Flight, undo: UndoLog, forced: int | None = None,
             picked: Route | None = None, wire: EngineCoreRequest | None = None) -> None:
        """Route (or take `picked`, if its rank still serves) and send `flight.request` (as `wire`,
        its message made ahead by `ItemTransport.prepare`, unless the rank is on another node);
        registered at once (undone with `undo`)."""
        request = flight.request
        assert request is not None
        self._flights[request_id] = flight
        undo.push(self._flights.pop, request_id, None)
        live = self.ranks.live()
        if not live:
            raise EngineDeadError("no engine rank is serving")
        route = picked if picked is not None and picked.rank in live else \
            self.router.route(request, live, forced) if self.router is not None else None
        flight.rank = route.rank if route is not None else 0
        self._put(flight, request, undo, resend=False, wire=wire)
        if route is not None and self.router is not None:
            self.router.on_sent(route, request)

    def resend(self, flight: Flight, undo: UndoLog) -> None:
        assert flight.request is not None
        self._put(flight, flight.request, undo, resend=True)

    def _put(self, flight: Flight, request: EngineCoreRequest, undo: UndoLog, resend: bool,
             wire: EngineCoreRequest | None = None) -> None:
        if wire is not None and flight.rank not in self.transport.remote:
            message = wire
        else:
            message, _ = self.transport.to_wire(request, undo, resend, flight.rank, flight.report)
        self.ranks.client(flight.rank).add_request(message)

    def shown(self, result: RequestOutput) -> None:
        """An output is on its way to the caller: after a streamed one the request can only resume, and
        only if `resumable`; after the last one it is not sent again."""
        flight = self._flights.get(result.request_id)
        if flight is None:
            return
        if result.finished:
            flight.request = None
        elif flight.stream and not flight.started and flight.request is not None:
            flight.started = True
            if not resumable(flight.request.sampling_params):
                flight.request = None
        if result.finished:
            served = self._served[flight.rank]
            served[0] += 1
            served[1] += len(result.prompt_token_ids or [])
            served[2] += sum(len(c.token_ids) for c in result.outputs)

    def stay(self, request_id: str) -> None:
        """The request can no longer start over (failed or aborted)."""
        if (flight := self._flights.get(request_id)) is not None:
            flight.request = None

    def land(self, request_id: str) -> None:
        flight = self._flights.pop(request_id, None)
        if flight is not None and self.router is not None:
            self.router.on_finished(flight.rank)

    def abort(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            if (flight := self._flights.get(rid)) is not None:
                flight.request = None
                by_rank.setdefault(flight.rank, []).append(rid)
        live = self.ranks.live()
        for rank, ids in by_rank.items():
            if rank in live:
                self.ranks.client(rank).abort_requests(ids)

    def orphans(self, rank: int) -> tuple[list[str], list[str]]:
        """Rank `rank` died: (requests that can start over elsewhere, requests that are lost).

        Both leave the rank's load.
        """
        movable: list[str] = []
        lost: list[str] = []
        for rid, flight in self._flights.items():
            if flight.rank == rank:
                (movable if flight.request is not None else lost).append(rid)
        if self.router is not None:
            self.router.forget(rank)
        return movable, lost

    def served(self) -> list[list[int]]:
        """Per rank: requests it finished, their prompt and generated tokens."""
        return [list(counts) for counts in self._served]

    def figures(self, stats: dict[int, SchedulerStats]) -> DataParallelFigures:
        """Each rank's state and what it served, with its latest `stats` (absent while down)."""
        live = self.ranks.live()
        ranks = [RankFigures(r, r in live, self.ranks.restarts[r], stats.get(r), *self._served[r])
                 for r in range(len(self.ranks))]
        return DataParallelFigures(ranks, dict(self.router.decisions) if self.router is not None else {})
