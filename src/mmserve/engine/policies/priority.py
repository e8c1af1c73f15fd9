"""`--scheduling-policy priority`: the users' lane in order of each request's `priority` (vLLM's:
the lower the value, the sooner it runs; ties in arrival order), fair shares within one priority.

- **Admission.** The next admitted is the first waiting request of the most urgent priority that
  is within its fair share, else the first of that priority (`next_urgent`). A request of a less
  urgent priority waits while a more urgent one does.
- **Each step,** running requests are scheduled most urgent first (admission order within a
  priority), so when the step's token budget runs out the least urgent go without.
- **When KV blocks run out,** the request preempted is the least urgent, most recently admitted
  (the last in turn: `Lane.in_turn`); vLLM preempts `max(priority, arrival_time)`.
- **Fair shares** (`fairness.py`) hold among the most urgent waiting requests: one within its
  share may take the slot of a running request over its share whose priority is no more urgent.

As in vLLM, a waiting request does not preempt a running one for its slot or blocks because it is
more urgent: it is admitted next.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmserve.engine.policies.fairness import FairLane, group_of, over_share, shares
from mmserve.engine.request import Request


def next_urgent(running: Sequence[Request], waiting: Sequence[Request], max_num_seqs: int) -> int:
    """The index in `waiting` (not empty) of the first request of the most urgent priority within
    its fair share, else of the first of that priority."""
    urgent = min(r.priority for r in waiting)
    tied = [i for i, r in enumerate(waiting) if r.priority == urgent]
    held, share = shares(running, waiting, max_num_seqs)
    return next((i for i in tied if held.get(group_of(waiting[i]), 0) < share), tied[0])


class PriorityLane(FairLane):
    """The users' lane under `--scheduling-policy priority`."""

    def pick(self, running: Sequence[Request]) -> int:
        """The first most urgent waiting request within its share, else the first most urgent."""
        return next_urgent(running, self.waiting, self.max_num_seqs)

    def in_turn(self, members: list[Request]) -> list[Request]:
        """Most urgent first, admission order within a priority (the last is preempted first)."""
        return sorted(members, key=lambda r: r.priority)

    def over_share(self, running: Sequence[Request], members: Sequence[Request]) -> list[Request]:
        """A running request over its share and no more urgent than the most urgent waiting ones, so
        that one of those within its share gets a slot."""
        if not self.waiting:
            return []
        urgent = min(r.priority for r in self.waiting)
        return over_share(running, [r for r in members if r.priority >= urgent], self.waiting, self.max_num_seqs,
                          candidates=[r for r in self.waiting if r.priority == urgent])
