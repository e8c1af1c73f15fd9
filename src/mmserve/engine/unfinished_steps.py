"""The steps the scheduler has scheduled and not yet updated from (`UnfinishedSteps`).

Without --async-scheduling a step is updated from before the next is scheduled, so there is at
most one, between `schedule` and `update_from_output`. With it the engine core schedules step N+1
before step N's tokens arrive: two. What the scheduler must know of them:
- how many of a request's computed tokens belong to steps not yet updated from (`pending`): where
  a step left the request is its `num_computed_tokens` less the tokens of the steps scheduled since,
  and what those steps consume is released when they are updated from;
- which of a step's requests were requeued since (preempted, or a later step failed): their blocks
  and encoder references are gone, so nothing of the step is filed in the caches for them.
A step that schedules no token is not tracked (it has nothing to update from).
"""

from __future__ import annotations

from collections import deque

from mmserve.ipc.worker_messages import SchedulerOutput


class UnfinishedSteps:
    """Each tracked step's tokens per request and the requests requeued since, oldest first."""

    def __init__(self) -> None:
        self._steps: deque[tuple[dict[str, int], set[str]]] = deque()

    def add(self, sched: SchedulerOutput) -> None:
        """`sched` was scheduled."""
        if sched.num_scheduled_tokens:
            self._steps.append((sched.num_scheduled_tokens, set()))

    def requeued(self, request_id: str) -> None:
        """`request_id` left running for its queue (its blocks and encoder references freed)."""
        for tokens, requeued in self._steps:
            if request_id in tokens:
                requeued.add(request_id)

    def take(self, sched: SchedulerOutput, newest: bool = False) -> set[str]:
        """Stop tracking `sched`, the oldest step (or the `newest`, which failed): the requests
        requeued since it was scheduled."""
        if not sched.num_scheduled_tokens or not self._steps:
            return set()
        return (self._steps.pop() if newest else self._steps.popleft())[1]

    def pending(self, request_id: str) -> int:
        """The tokens of `request_id` that tracked steps compute."""
        return sum(tokens.get(request_id, 0) for tokens, _ in self._steps)

