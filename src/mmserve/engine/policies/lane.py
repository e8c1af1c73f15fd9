"""A lane: one class of requests with its own waiting queue, and the rules the scheduler asks of it.

The scheduler (`engine/scheduler.py`) runs its lanes in order, each the way vLLM's scheduler runs
its one queue: the lane's running requests first, then its waiting ones while nothing was preempted.
Every request waits and runs in one lane (`Lanes.of`). The base class is a plain FIFO lane
with no rule of its own; `fairness.py: FairLane` (users' requests) and `shadows.py: ShadowLane` (the
cache verifier's re-runs) add theirs by overriding these members:

- `spare`: a running request of this lane gives its seat and blocks to a request of an earlier lane
  that cannot be admitted otherwise, is preempted before any of an earlier lane when blocks run out,
  and preempting it stops no admission in the step.
- `reads_caches`: whether its requests look up (and count) prefix-cache hits at admission.
- `takes(req)`: whether `req` belongs to this lane (the first lane takes every request no other does).
- `next_up(running)`: put the next request to admit at the head of `waiting` (FIFO: nothing to do).
- `in_turn(members)`: the order its running requests are scheduled in, each step (admission
  order); the last is the one preempted first when blocks run out, so a victim is never a request
  scheduled before the one that needs its blocks.
- `may_admit(running)`: whether the lane admits a request now, given every running request.
- `check_integrity(members)`: the lane's invariants over its running members, between steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

from mmserve.engine.request import Request


class Lane:
    """A FIFO lane: requests are admitted in arrival order (requeued ones at the head)."""

    spare = False
    reads_caches = True

    def __init__(self) -> None:
        self.waiting: deque[Request] = deque()

    def takes(self, req: Request) -> bool:
        return True

    def next_up(self, running: Sequence[Request]) -> None:
        """Bring the next request to admit to the head of `waiting`, given every `running` request."""

    def in_turn(self, members: list[Request]) -> list[Request]:
        """The lane's running `members` (in admission order) in the order they are scheduled."""
        return members

    def may_admit(self, running: Sequence[Request]) -> bool:
        return True

    def check_integrity(self, members: Sequence[Request]) -> None:
        """Between steps, the lane's own invariants (the scheduler checks that each request waits in its lane)."""


class Lanes:
    """The scheduler's lanes in the order each step runs them: `first` (the users'), then `others`.

    A request belongs to the first of `others` that takes it, else to `first`. When blocks run out
    the victim is the last running request in turn (`Lane.in_turn`) of the last lane that has one
    (`victim`); a request that cannot be admitted takes the place of a later spare lane's
    (`spare_after`)."""

    def __init__(self, first: Lane, *others: Lane) -> None:
        self.first = first
        self.others = others
        self.order: tuple[Lane, ...] = (first, *others)

    def __iter__(self) -> Iterator[Lane]:
        return iter(self.order)

    def of(self, req: Request) -> Lane:
        for lane in self.others:
            if lane.takes(req):
                return lane
        return self.first

    def members(self, lane: Lane, running: Sequence[Request]) -> list[Request]:
        """`lane`'s requests among `running`, in their order."""
        return [r for r in running if self.of(r) is lane]

    def in_turn(self, lane: Lane, running: Sequence[Request]) -> list[Request]:
        """`lane`'s requests among `running`, in the order the lane schedules them."""
        return lane.in_turn(self.members(lane, running))

    def num_waiting(self) -> int:
        return sum(len(lane.waiting) for lane in self.order)

    def victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when blocks run out (`running` is not empty)."""
        return next(members[-1] for lane in reversed(self.order) if (members := self.in_turn(lane, running)))

    def spare_after(self, lane: Lane, running: Sequence[Request]) -> Request | None:
        """The running request whose seat and blocks a waiting request of `lane` may take, else None."""
        later = self.order[self.order.index(lane) + 1:]
        return next((members[-1] for other in reversed(later)
                     if other.spare and (members := self.members(other, running))), None)

    def check_integrity(self, running: Sequence[Request]) -> None:
        for lane in self.order:
            assert all(self.of(r) is lane for r in lane.waiting), "a request waits in another lane"
            lane.check_integrity(self.members(lane, running))
