"""What P0 does when a data-parallel rank's engine core dies (`AsyncLLM`'s failover part).

The rank is retired (`EngineRanks.mark_dead`); its requests are parked and sent again to a live
rank (at once, or once the rank is back when none lives): one that showed its caller nothing
starts over, one that streamed output resumes from its prompt and the tokens already sent
(`flights.py: resumed`; its output state here goes on, so the caller's text continues without a
duplicated or lost character and it sees a pause, not an error); a streamed request that cannot
resume exactly (`flights.py: resumable`) fails with `EngineDeadError`. A request is sent again
at most once (`MAX_MOVES`): one that was on a second rank that died is the likely cause, and fails
with an `EngineRequestError` (a 500 naming the deaths; one log line names it) instead of taking
down a third, so a poison request cannot spend the restarts; the rank is restarted in the background while
`--engine-restart-limit` allows, its IPC mirror starting a new epoch. P0 is dead (`fail_all`)
only once no rank serves and none can come back. A new request that finds no rank serving while
one restarts waits for it (`wait_for_live_rank`, up to `RANK_WAIT_S`) instead of failing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Coroutine

from mmserve.errors import EngineRequestError
from mmserve.frontend.engine_client.core_client import EngineDeadError
from mmserve.frontend.engine_client.engine_ranks import EngineRanks
from mmserve.frontend.figures import EngineFigures
from mmserve.frontend.dp.flights import Flight, RequestFlights, resumed
from mmserve.transport.item_transport import ItemTransport
from mmserve.frontend.request.open_requests import OpenRequests
from mmserve.frontend.output.output_processor import OutputProcessor
from mmserve.transport.undo import UndoLog

logger = logging.getLogger(__name__)

RANK_WAIT_S = 120.0  # longest a new request waits for a restarting rank (a restart loads the model)
_RANK_POLL_S = 0.05
MAX_MOVES = 1  # times a request is sent again after its rank died; past it, it is the suspect


Spawn = Callable[[str, Callable[[], Coroutine[Any, Any, None]]], None]


class RankFailover:
    """Retires, restarts and re-admits ranks; moves their movable requests.

    `spawn(name, make)` runs `make()` as a named background task (once at a time);
    `serve_outputs()` (re)starts the output loop of every rank that has a client."""

    def __init__(self, ranks: EngineRanks, flights: RequestFlights, transport: ItemTransport,
                 output_processor: OutputProcessor, requests: OpenRequests, figures: EngineFigures,
                 spawn: Spawn, serve_outputs: Callable[[], None]) -> None:
        self.ranks = ranks
        self.flights = flights
        self.transport = transport
        self.output_processor = output_processor
        self.requests = requests
        self.figures = figures
        self.spawn = spawn
        self.serve_outputs = serve_outputs
        self.parked: list[str] = []  # requests to move, waiting for a rank to come back

    @property
    def is_healthy(self) -> bool:
        """Whether some rank serves or can come back.

        False once no rank serves and none can come back (a rank whose process just ended and
        that the output loop has not retired yet still counts: it restarts or is marked dead)."""
        return self.requests.dead_error is None and any(s != "dead" for s in self.ranks.status)

    async def wait_for_live_rank(self, timeout_s: float = RANK_WAIT_S) -> None:
        """Return once some rank serves; EngineDeadError once none can come back or after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.ranks.live():
            if not self.is_healthy or loop.time() >= deadline:
                raise EngineDeadError("no engine rank is serving" + (
                    "" if not self.is_healthy else f" (none came back within {timeout_s:g} s)"))
            await asyncio.sleep(_RANK_POLL_S)

    def rank_died(self, rank: int, message: str) -> None:
        """Retire the rank; move what it ran that can start over, fail the rest; restart it."""
        logger.error("engine rank %d died: %s", rank, message)
        self.ranks.mark_dead(rank, message)
        self.figures.forget(rank)
        movable, lost = self.flights.orphans(rank)
        for rid in lost:
            self.requests.fail(rid, EngineDeadError(f"engine rank {rank} died: {message}"))
        self.parked += [rid for rid in movable if rid in self.requests and not self._suspect(rid, rank, message)]
        if self.ranks.can_restart(rank):
            self.spawn(f"restart{rank}", lambda: self._restart(rank))
        elif not self.is_healthy:
            self.requests.fail_all(f"no engine rank can serve; rank {rank}: {message}")
            return
        self._move_parked()

    def _suspect(self, request_id: str, rank: int, message: str) -> bool:
        """Fail a request that was moved already (a second rank died under it): True if it was."""
        flight = self.flights.get(request_id)
        if flight is None or flight.moves < MAX_MOVES:
            return False
        logger.error("request %s was on %d engine ranks that died; failing it, not sending it again",
                     request_id, flight.moves + 1)
        self.requests.fail(request_id, EngineRequestError(
            f"the engine failed while serving this request: engine rank {rank} died with it ({message}) after "
            f"it had been moved from {flight.moves} rank(s) that died; it is not sent again"))
        return True

    async def _restart(self, rank: int) -> None:
        while self.ranks.can_restart(rank):
            try:
                client = await self.ranks.restart(rank)
            except Exception as e:
                logger.error("engine rank %d did not restart: %s", rank, e)
                continue
            self.transport.restarted(rank, remote=not client.is_local)
            self.serve_outputs()
            logger.warning("engine rank %d is serving again", rank)
            self._move_parked()
            return
        if not self.is_healthy:
            self.requests.fail_all(f"no engine rank can serve; rank {rank}: {self.ranks.last_error[rank]}")

    def _move_parked(self) -> None:
        """Send the parked requests (their rank died before they showed anything) to live ranks."""
        if not self.ranks.live():
            return
        parked, self.parked = self.parked, []
        for rid in parked:
            flight = self.flights.get(rid)
            if flight is None or flight.request is None or rid not in self.requests:
                continue
            flight.moves += 1
            if flight.report is not None:
                flight.report.moved()
            if flight.started:
                self._resume(rid, flight)
                continue
            self.output_processor.abort_requests([rid])
            self.output_processor.add_request(flight.request, flight.prompt_text, flight.report)
            self._send(rid, flight)
        if parked:
            logger.warning("moved %d request(s) of a dead engine rank to live ranks", len(parked))

    def _resume(self, rid: str, flight: Flight) -> None:
        """Send a streamed request on from the tokens its caller has; its output state goes on."""
        assert flight.request is not None
        flight.origin = flight.origin or flight.request
        generated = self.output_processor.generated(rid)
        going_on = None if generated is None else resumed(flight.origin, generated)
        if going_on is None:
            self.requests.fail(rid, EngineDeadError(f"engine rank {flight.rank} died with the request"))
            return
        flight.request = going_on  # what a resend (P1 lacked an item) sends again
        self._send(rid, flight)

    def _send(self, rid: str, flight: Flight) -> None:
        undo = UndoLog()
        try:
            self.flights.send(rid, flight, undo)
        except Exception as e:
            undo.run()
            self.requests.fail(rid, e)

