"""n > 1: a request's completions as sibling requests that share its prompt's KV and encoder work.

A request with `n` > 1 becomes n `Request.sibling`s, each with its own id
(`sibling_request_id`), sampler state and seed (seed + index). Sibling 0 is queued at once; the
others are held here until sibling 0's whole prompt has been scheduled. By then its full blocks are
registered in the prefix cache and its items' encoder outputs resident (or computed in that very
step, before the decoder runs), so the siblings, queued right behind it, take the prompt's blocks
as prefix-cache hits (shared blocks, reference-counted) and reference the encoder outputs by
`mm_hash`: the prompt is prefilled once and each image encoded once. A sibling computes only what
a prefix hit cannot cover: the prompt's last, partial block (at least one token). With the prefix
cache off the siblings recompute the prompt (the encoder cache still shares the images).

Invariants: `live[client_id]` holds the ids of the request's unfinished siblings (held or
queued); `held[client_id]` the ones not handed to the scheduler yet; a client id is in `held`
only while sibling 0 has not finished scheduling its prompt.
"""

from __future__ import annotations

from mmserve.engine.request import Request


class SiblingGroups:
    """The n > 1 requests' siblings: split at arrival, held until sibling 0's prompt is scheduled.

    The scheduler calls `split` when a request arrives, `release` after each request it schedules,
    `finish` when one ends and `expand` when requests are aborted by id."""

    def __init__(self) -> None:
        self.held: dict[str, list[Request]] = {}
        self.live: dict[str, set[str]] = {}
        self._first: dict[str, str] = {}  # client id -> sibling 0's id, while others are held

    def split(self, request: Request) -> Request:
        """Sibling 0 of an n > 1 request (to queue); the others wait here."""
        siblings = [request.sibling(i) for i in range(request.sampling_params.n)]
        self.live[request.client_id] = {s.request_id for s in siblings}
        self.held[request.client_id] = siblings[1:]
        self._first[request.client_id] = siblings[0].request_id
        return siblings[0]

    def contains(self, client_id: str) -> bool:
        """Whether `client_id` names an n > 1 request with an unfinished sibling."""
        return client_id in self.live

    def release(self, request: Request) -> list[Request]:
        """The held siblings of `request` once it has scheduled its whole prompt (else [])."""
        cid = request.client_id
        if request.num_computed_tokens < request.num_prompt_tokens or self._first.get(cid) != request.request_id:
            return []
        del self._first[cid]
        return self.held.pop(cid, [])

    def finish(self, request: Request) -> bool:
        """`request` ended: whether others of its request still run."""
        live = self.live.get(request.client_id)
        if live is None:
            return False
        live.discard(request.request_id)
        if live:
            return True
        del self.live[request.client_id]
        return False

    def expand(self, request_ids: list[str]) -> tuple[list[str], list[Request]]:
        """Abort ids -> the scheduler's ids to finish (a client id stands for all its siblings),
        and the held siblings dropped here (never scheduled)."""
        ids: list[str] = []
        dropped: list[Request] = []
        for rid in request_ids:
            if rid not in self.live:
                ids.append(rid)
                continue
            held = self.held.pop(rid, [])
            self._first.pop(rid, None)
            dropped += held
            ids += sorted(self.live.pop(rid) - {r.request_id for r in held})
        return ids, dropped

    def check_integrity(self) -> None:
        assert set(self.held) <= set(self.live), "held siblings of a finished request"
        assert set(self._first) == set(self.held)
        for cid, held in self.held.items():
            assert {r.request_id for r in held} <= self.live[cid]
