"""Fair shares of the running slots: the users' lane (`FairLane`) and the pure functions it runs on.

A request's completions (n > 1 siblings) count together, by `client_id`, and so do the prompts of
one completions batch (the endpoint names them `cmpl-…-{p}`: `group_of`). A request's share is
`max_num_seqs` divided by the number of requests running or waiting (at least 1). While a request
within its share waits, the next admitted is the first waiting request within its share, and with
every slot taken, completions of requests over their share are preempted (the last admitted
first) until it has a slot. Released siblings queue behind the requests that arrived before them.
Requests of other lanes (a running shadow) count in the shares but are never preempted here.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence

from mmserve.engine.policies.lane import Lane
from mmserve.engine.request import Request


_BATCH = re.compile(r"(cmpl-[0-9a-f]+)-\d+")  # serving_completions.py: a batch's prompt p is `{id}-{p}`


def group_of(request: Request) -> str:
    """What shares one fair share: the client's request (its siblings), or its completions batch."""
    match = _BATCH.fullmatch(request.client_id)
    return match.group(1) if match else request.client_id


def shares(running: Sequence[Request], waiting: Sequence[Request], max_num_seqs: int) -> tuple[dict[str, int], int]:
    """Running slots per request (siblings and batch prompts together), and each one's fair share."""
    held: dict[str, int] = {}
    for r in running:
        held[group_of(r)] = held.get(group_of(r), 0) + 1
    groups = set(held) | {group_of(r) for r in waiting}
    return held, max(1, max_num_seqs // max(1, len(groups)))


def next_fair(running: Sequence[Request], waiting: Sequence[Request], max_num_seqs: int) -> int:
    """The index in `waiting` of the first request within its share (0 when the head is, or none is)."""
    held, share = shares(running, waiting, max_num_seqs)
    return next((i for i, r in enumerate(waiting) if held.get(group_of(r), 0) < share), 0)


def over_share(running: Sequence[Request], own: Sequence[Request], waiting: Sequence[Request],
               max_num_seqs: int, candidates: Sequence[Request] | None = None) -> list[Request]:
    """The completions of `own` (the lane's running requests, in `running`'s order) to preempt so
    that a request of `candidates` (default: all `waiting`) within its share gets a slot (none
    unless every slot is taken and such a request waits); the last admitted first."""
    if len(running) < max_num_seqs:
        return []
    held, share = shares(running, waiting, max_num_seqs)
    if not any(held.get(group_of(r), 0) < share for r in (waiting if candidates is None else candidates)):
        return []
    for victim in reversed(own):
        if held[group_of(victim)] > share:
            return [victim]  # one slot: the waiting request takes it
    return []


def insert_in_order(waiting: deque[Request], siblings: Sequence[Request]) -> None:
    """Queue `siblings` behind the waiting requests that arrived (`order`) before theirs."""
    if not siblings:
        return
    index = next((i for i, r in enumerate(waiting) if r.order > siblings[0].order), len(waiting))
    for sibling in reversed(siblings):
        waiting.insert(index, sibling)


class FairLane(Lane):
    """The users' lane: admitted in fair-share order within `max_num_seqs` running slots."""

    def __init__(self, max_num_seqs: int) -> None:
        super().__init__()
        self.max_num_seqs = max_num_seqs

    def pick(self, running: Sequence[Request]) -> int:
        """The index in `waiting` (not empty) of the next to admit: the first within its fair share."""
        return next_fair(running, self.waiting, self.max_num_seqs)

    def next_up(self, running: Sequence[Request]) -> None:
        """Bring the request `pick` names to the head."""
        index = self.pick(running)
        if index:
            req = self.waiting[index]
            del self.waiting[index]
            self.waiting.appendleft(req)

    def over_share(self, running: Sequence[Request], members: Sequence[Request]) -> list[Request]:
        """The lane's running `members` to preempt before the step, so a request within its share gets a slot."""
        return over_share(running, members, self.waiting, self.max_num_seqs)

    def queue_released(self, siblings: Sequence[Request]) -> None:
        """Queue released n > 1 `siblings` behind the requests that arrived before them."""
        insert_in_order(self.waiting, siblings)
