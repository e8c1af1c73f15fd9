"""A debugging hook that makes one request crash its engine core, so tests and the soak can show
that a poison request fails alone instead of using up the restarts (`engine_client/failover.py`).

`MMSERVE_DEBUG_POISON_SEED` (read here only, once per engine core) names a sampling seed: a step
that schedules a request with that seed ends the engine core process at once, as a crash in
native code would (no exception the step could catch and pin on the request). Unset (the
default) nothing changes.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable

from mmserve.engine.request import Request

logger = logging.getLogger(__name__)

ENV = "MMSERVE_DEBUG_POISON_SEED"
EXIT_CODE = 70  # what the engine core exits with when the poison is scheduled


class Poison:
    """Ends the process when a step schedules a request whose seed is `seed`."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    @classmethod
    def from_env(cls) -> Poison | None:
        """The poison the environment asks for, or None (the normal case)."""
        value = os.environ.get(ENV)
        if not value:
            return None
        try:
            return cls(int(value))
        except ValueError:
            raise ValueError(f"{ENV} must be an integer seed; got {value!r}") from None

    def check(self, scheduled: Iterable[Request]) -> None:
        """Crash the process if one of the step's requests carries the poison seed."""
        for request in scheduled:
            if request.sampling_params.seed == self.seed:
                logger.error("%s: request %s carries the poison seed; the engine core crashes", ENV,
                             request.request_id)
                logging.shutdown()
                os._exit(EXIT_CODE)
