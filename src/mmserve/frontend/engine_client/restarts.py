"""One restart counter per rank, kept by the one process that starts the rank's engine cores.

That process holds the one `EngineSupervisor` (`supervisor.py`): the API server with one API
server, the launcher with several. It counts each restart against `--engine-restart-limit` here
and starts every engine core with the count so far (`ParallelConfig.engine_restarts`); the
engine core reports it back in `EngineCoreReady.restarts`, so an API server attached to the
launcher's engine cores reads the launcher's count (`EngineCoreClient.restarts`) instead of
keeping one of its own.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class RankRestarts:
    """Per rank: restarts so far (`counts`, a list), and whether another is allowed."""

    def __init__(self, size: int, limit: int) -> None:
        self.counts = [0] * size
        self.limit = limit

    def can_restart(self, rank: int) -> bool:
        return self.counts[rank] < self.limit

    def count(self, rank: int) -> None:
        """Count a restart of `rank` (the caller checked `can_restart`)."""
        self.counts[rank] += 1
        logger.warning("restarting engine rank %d (restart %d of %d)", rank, self.counts[rank], self.limit)
