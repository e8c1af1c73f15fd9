"""What P0 does when a data-parallel rank's engine core dies (`AsyncLLM`'s failover part).

The rank is retired (`EngineRanks.mark_dead`); its requests are parked and sent again to a live
rank (at once, or once the rank is back when none lives): one that showed its caller nothing
starts over, one that streamed output resumes from its prompt and the tokens already sent
(`open_request.py: resumed`; its output state here goes on, so the caller's text continues without a
duplicated or lost character and it sees a pause, not an error); a streamed request that cannot
resume exactly (`open_request.py: resumable`) fails with `EngineDeadError`. A request is sent again
at most once (`MAX_MOVES`): one that was on a second rank that died is the likely cause, and fails
with an `EngineRequestError` (a 500 naming the deaths; one log line names it) instead of taking
down a third, so a poison request cannot spend the restarts; the rank is restarted in the background while
`--engine-restart-limit` allows (`rank_died` says so; its owner runs `restart`, then `move_parked`),
its IPC mirror starting a new epoch. P0 is dead (`fail_all`)
only once no rank serves and none can come back. A new request that finds no rank serving while
one restarts waits for it (`wait_for_live_rank`, up to `RANK_WAIT_S`) instead of failing.
"""

from __future__ import annotations

import asyncio
import logging

from mmserve.errors import EngineRequestError
from mmserve.frontend.engine_client.core_client import EngineDeadError
from mmserve.frontend.engine_client.engine_ranks import EngineRanks
from mmserve.frontend.engine_client.sender import RankSender
from mmserve.frontend.figures import EngineFigures
from mmserve.frontend.output.output_processor import OutputProcessor
from mmserve.frontend.request.open_request import OpenRequest, resumed
from mmserve.frontend.request.open_requests import OpenRequests
from mmserve.transport.item_transport import ItemTransport
from mmserve.transport.undo import UndoLog

logger = logging.getLogger(__name__)

RANK_WAIT_S = 120.0  # longest a new request waits for a restarting rank (a restart loads the model)
RANK_POLL_S = 0.05
MAX_MOVES = 1  # times a request is sent again after its rank died; past it, it is the suspect


class RankFailover:
    """Retires, restarts and re-admits ranks; moves their movable requests."""

    def __init__(self, ranks: EngineRanks, sender: RankSender, transport: ItemTransport,
                 output_processor: OutputProcessor, requests: OpenRequests, figures: EngineFigures) -> None:
        self.ranks = ranks
        self.sender = sender
        self.transport = transport
        self.output_processor = output_processor
        self.requests = requests
        self.figures = figures
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
            await asyncio.sleep(RANK_POLL_S)

    def rank_died(self, rank: int, message: str) -> bool:
        """Retire the rank; move what it ran that can start over, fail the rest. True: restart it
        (`restart`, in the background)."""
        logger.error("engine rank %d died: %s", rank, message)
        self.ranks.mark_dead(rank, message)
        self.figures.forget(rank)
        movable, lost = self.requests.orphans(rank)
        for rid in lost:
            self.requests.fail(rid, EngineDeadError(f"engine rank {rank} died: {message}"))
        self.parked += [rid for rid in movable if not self._suspect(rid, rank, message)]
        restart = self.ranks.can_restart(rank)
        if not restart and not self.is_healthy:
            self.requests.fail_all(f"no engine rank can serve; rank {rank}: {message}")
            return False
        self.move_parked()
        return restart

    def _suspect(self, request_id: str, rank: int, message: str) -> bool:
        """Fail a request that was moved already (a second rank died under it): True if it was."""
        request = self.requests.get(request_id)
        if request is None or request.moves < MAX_MOVES:
            return False
        logger.error("request %s was on %d engine ranks that died; failing it, not sending it again",
                     request_id, request.moves + 1)
        self.requests.fail(request_id, EngineRequestError(
            f"the engine failed while serving this request: engine rank {rank} died with it ({message}) after "
            f"it had been moved from {request.moves} rank(s) that died; it is not sent again"))
        return True

    async def restart(self, rank: int) -> bool:
        """Restart `rank` while its restarts last: True once it serves again (its output loop and
        `move_parked` are then its owner's to run); P0 is dead when it cannot and none serves."""
        while self.ranks.can_restart(rank):
            try:
                client = await self.ranks.restart(rank)
            except Exception as e:
                logger.error("engine rank %d did not restart: %s", rank, e)
                continue
            self.transport.restarted(rank, remote=not client.is_local)
            logger.warning("engine rank %d is serving again", rank)
            return True
        if not self.is_healthy:
            self.requests.fail_all(f"no engine rank can serve; rank {rank}: {self.ranks.last_error[rank]}")
        return False

    def move_parked(self) -> None:
        """Send the parked requests (their rank died before they showed anything) to live ranks."""
        if not self.ranks.live():
            return
        parked, self.parked = self.parked, []
        for rid in parked:
            request = self.requests.get(rid)
            if request is None or request.resend is None:
                continue
            request.moves += 1
            request.report.moved()
            if request.started:
                self._resume(request)
                continue
            self.output_processor.abort_requests([rid])
            self.output_processor.add_request(request.resend, request.prompt.shown_text, request.report)
            self._send(request)
        if parked:
            logger.warning("moved %d request(s) of a dead engine rank to live ranks", len(parked))

    def _resume(self, request: OpenRequest) -> None:
        """Send a streamed request on from the tokens its caller has; its output state goes on."""
        assert request.resend is not None
        request.origin = request.origin or request.resend
        generated = self.output_processor.generated(request.request_id)
        going_on = None if generated is None else resumed(request.origin, generated)
        if going_on is None:
            self.requests.fail(request.request_id, EngineDeadError(f"engine rank {request.rank} died with the request"))
            return
        request.resend = going_on  # what a resend (P1 lacked an item) sends again
        self._send(request)

    def _send(self, request: OpenRequest) -> None:
        assert request.resend is not None
        undo = UndoLog()
        try:
            request.rank = self.sender.send(request.resend, undo, request.report)
        except Exception as e:
            undo.run()
            request.rank = None  # on no rank's wire: nothing to abort or land
            self.requests.fail(request.request_id, e)
