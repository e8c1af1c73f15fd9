"""What P0 does when a data-parallel rank's engine core dies (`AsyncLLM`'s part for it).

The rank is retired (`EngineRanks.mark_dead`); requests that showed their caller nothing yet
are parked and sent again to a live rank (at once, or once the rank is back when none lives),
the others fail with `EngineDeadError`; the rank is restarted in the background while
`--engine-restart-limit` allows, its IPC mirror starting a new epoch. P0 is dead (`_fail_all`)
only once no rank serves and none can come back. A new request that finds no rank serving while
one restarts waits for it (`wait_for_live_rank`, up to `RANK_WAIT_S`) instead of failing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from mmserve.frontend.core_client import EngineDeadError
from mmserve.frontend.engine_ranks import EngineRanks
from mmserve.frontend.flights import RequestFlights
from mmserve.frontend.item_transport import ItemTransport
from mmserve.frontend.output_processor import OutputProcessor
from mmserve.frontend.undo import UndoLog
from mmserve.ipc.messages import SchedulerStats
from mmserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

RANK_WAIT_S = 120.0  # longest a new request waits for a restarting rank (a restart loads the model)
_RANK_POLL_S = 0.05


class RankFailover:
    """Mixed into `AsyncLLM`, whose state it uses (declared here)."""

    ranks: EngineRanks
    flights: RequestFlights
    transport: ItemTransport
    output_processor: OutputProcessor
    _queues: dict[str, asyncio.Queue[RequestOutput | Exception]]
    _parked: list[str]
    _stats: dict[int, SchedulerStats]
    _fail: Callable[[str, Exception], None]
    _fail_all: Callable[[str], None]
    _ensure_task: Callable[[str, Any], None]
    _ensure_output_task: Callable[[], None]

    @property
    def is_healthy(self) -> bool:
        raise NotImplementedError

    async def wait_for_live_rank(self, timeout_s: float = RANK_WAIT_S) -> None:
        """Return once some rank serves; EngineDeadError once none can come back or after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.ranks.live():
            if not self.is_healthy or loop.time() >= deadline:
                raise EngineDeadError("no engine rank is serving" + (
                    "" if not self.is_healthy else f" (none came back within {timeout_s:g} s)"))
            await asyncio.sleep(_RANK_POLL_S)

    def _rank_died(self, rank: int, message: str) -> None:
        """Retire the rank; move what it ran that can start over, fail the rest; restart it."""
        logger.error("engine rank %d died: %s", rank, message)
        self.ranks.mark_dead(rank, message)
        self._stats.pop(rank, None)
        movable, lost = self.flights.orphans(rank)
        for rid in lost:
            self._fail(rid, EngineDeadError(f"engine rank {rank} died: {message}"))
        self._parked += [rid for rid in movable if rid in self._queues]
        if self.ranks.can_restart(rank):
            self._ensure_task(f"restart{rank}", lambda: self._restart(rank))
        elif not self.is_healthy:
            self._fail_all(f"no engine rank can serve; rank {rank}: {message}")
            return
        self._move_parked()

    async def _restart(self, rank: int) -> None:
        while self.ranks.can_restart(rank):
            try:
                client = await self.ranks.restart(rank)
            except Exception as e:
                logger.error("engine rank %d did not restart: %s", rank, e)
                continue
            self.transport.restarted(rank, remote=not client.is_local)
            self._ensure_output_task()
            logger.warning("engine rank %d is serving again", rank)
            self._move_parked()
            return
        if not self.is_healthy:
            self._fail_all(f"no engine rank can serve; rank {rank}: {self.ranks.last_error[rank]}")

    def _move_parked(self) -> None:
        """Send the parked requests (their rank died before they showed anything) to live ranks."""
        if not self.ranks.live():
            return
        parked, self._parked = self._parked, []
        for rid in parked:
            flight = self.flights.get(rid)
            if flight is None or flight.request is None or rid not in self._queues:
                continue
            self.output_processor.abort_requests([rid])
            if flight.report is not None:
                flight.report.moved()
            self.output_processor.add_request(flight.request, flight.prompt_text, flight.report)
            undo = UndoLog()
            try:
                self.flights.send(rid, flight, undo)
            except Exception as e:
                undo.run()
                self._fail(rid, e)
        if parked:
            logger.warning("moved %d request(s) of a dead engine rank to live ranks", len(parked))

