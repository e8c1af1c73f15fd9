"""Shadow requests (the cache verifier's re-runs, `Request.shadow`): a lane of their own that runs last.

A shadow reads and writes no cache (`request.py: shadow_items`; it has no block hashes), so it looks
nothing up at admission. Its lane comes after the users' in every step: the users' running requests
take the budget first, then the users' waiting ones are admitted, then the running shadow gets what
budget is left, and a waiting shadow is admitted only when none runs and no user's request was
preempted in the step. A shadow's blocks are spare: it is the first to be preempted when blocks run
out, a waiting user's request that finds no seat or no blocks takes its place, and preempting it
stops no admission. So a user's request is never held back by one for more than the step it shares
with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmserve.engine.policies.lane import Lane
from mmserve.engine.request import Request


class ShadowLane(Lane):
    """The shadow requests' lane: at most one runs, admitted only while none does."""

    spare = True
    reads_caches = False

    def takes(self, req: Request) -> bool:
        return req.shadow

    def may_admit(self, running: Sequence[Request]) -> bool:
        return not any(self.takes(r) for r in running)

    def check_integrity(self, members: Sequence[Request]) -> None:
        assert len(members) <= 1, "more than one shadow request runs"
