"""Fair shares of the running slots: who goes next, and who gives a slot back (pure functions).

A request's completions (n > 1 siblings) count together, by `client_id`. A request's share is
`max_num_seqs` divided by the number of requests running or waiting (at least 1). While a request
within its share waits, the next admitted is the first waiting request within its share, and with
every slot taken, completions of requests over their share are preempted (the last admitted
first) until it has a slot. Released siblings queue behind the requests that arrived before them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from mmserve.engine.request import Request


def shares(running: Sequence[Request], waiting: Sequence[Request], max_num_seqs: int) -> tuple[dict[str, int], int]:
    """Running slots per request (siblings together), and each request's fair share."""
    held: dict[str, int] = {}
    for r in running:
        held[r.client_id] = held.get(r.client_id, 0) + 1
    groups = set(held) | {r.client_id for r in waiting}
    return held, max(1, max_num_seqs // max(1, len(groups)))


def next_fair(running: Sequence[Request], waiting: Sequence[Request], max_num_seqs: int) -> int:
    """The index in `waiting` of the first request within its share (0 when the head is, or none is)."""
    held, share = shares(running, waiting, max_num_seqs)
    return next((i for i, r in enumerate(waiting) if held.get(r.client_id, 0) < share), 0)


def over_share(running: Sequence[Request], waiting: Sequence[Request], max_num_seqs: int) -> list[Request]:
    """The running completions to preempt so that a waiting request within its share gets a slot
    (none unless every slot is taken and such a request waits); the last admitted first."""
    if len(running) < max_num_seqs:
        return []
    held, share = shares(running, waiting, max_num_seqs)
    if not any(held.get(r.client_id, 0) < share for r in waiting if not r.shadow):
        return []
    for victim in reversed(running):
        if held[victim.client_id] > share and not victim.shadow:
            return [victim]  # one slot: the waiting request takes it
    return []


def insert_in_order(waiting: deque[Request], siblings: Sequence[Request]) -> None:
    """Queue `siblings` behind the waiting requests that arrived (`order`) before theirs."""
    if not siblings:
        return
    index = next((i for i, r in enumerate(waiting) if r.order > siblings[0].order), len(waiting))
    for sibling in reversed(siblings):
        waiting.insert(index, sibling)
