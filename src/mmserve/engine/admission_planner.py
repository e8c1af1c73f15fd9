"""What a waiting request is admitted with, decided before the scheduler changes anything.

An admission is one of two kinds:
- **computed**: the request's prefix-cache hit (`prefix_hits.py`: full blocks to share, then maybe
  a last or partial block to copy; none for a request that asks for its prompt's log
  probabilities), then a chunk of its prompt within the step's budget, shortened by the encoder
  planner where an item's output cannot be had this step;
- **answered** (`policies/first_tokens.py`): the hits reach an identical prompt's last block and
  that prompt's first token is cached — the whole prompt is cached and nothing is computed.

Either needs its KV blocks to fit. `AdmissionPlanner.plan` says which, or None (the request waits);
the scheduler then moves the request to running and, for a computed admission, schedules its
chunk. The first admission of a request records its prefix lookup (`record`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.engine.encoder_planner import EncoderPlan, EncoderPlanner
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.policies.first_tokens import FirstTokenAnswers
from mmserve.engine.policies.lane import Lane
from mmserve.engine.prefix_hits import PrefixHit, PrefixHits
from mmserve.engine.request import Request


@dataclass
class AdmissionPlan:
    """How one waiting request is admitted: `hit`, then `token` (its prompt's cached first token,
    nothing computed) or `plan` (the chunk computed this step and its encoder inputs)."""

    hit: PrefixHit
    token: int | None = None
    plan: EncoderPlan | None = None

    def num_computed(self, req: Request) -> int:
        """`req`'s tokens whose K/V the admission finds cached: the hit's, or the whole prompt's."""
        return req.num_tokens if self.token is not None else self.hit.num_tokens


class AdmissionPlanner:
    """Plans admissions over the KV cache, its prefix hits, the first-token answers and the
    encoder planner; counts, since start, the prompt tokens looked up in the prefix cache at a
    request's first admission (`prefix_queries`) and the hits among them (`prefix_hits`)."""

    def __init__(self, kv_cache: KVCacheManager, prefix: PrefixHits, answers: FirstTokenAnswers,
                 encoder_planner: EncoderPlanner) -> None:
        self.kv_cache = kv_cache
        self.prefix = prefix
        self.answers = answers
        self.encoder_planner = encoder_planner
        self.prefix_queries = 0
        self.prefix_hits = 0

    def plan(self, req: Request, lane: Lane, budget: int) -> AdmissionPlan | None:
        """How `req` is admitted within `budget` tokens, or None when its blocks or its first
        encoder input do not fit. Changes nothing the scheduler must undo: the encoder planner
        may take a reference to a resident output the hit relies on, which the request then holds."""
        reads = lane.reads_caches and req.prompt_logprobs is None  # prompt log probabilities: all computed
        hit = self.prefix.hits(req) if reads else PrefixHit([])
        token = self.answers.token_for(req, hit.last_block)
        if token is not None:
            fits = self.kv_cache.can_allocate(req.request_id, req.num_tokens, hit.blocks)
            return AdmissionPlan(hit, token) if fits else None
        n = min(req.num_tokens - hit.num_tokens, budget)
        if not self.kv_cache.can_allocate(req.request_id, hit.num_tokens + n, hit.blocks):
            return None
        plan = self.encoder_planner.plan(req, hit.num_tokens, n)  # may shorten the chunk: it still fits the blocks
        if plan.num_tokens == 0:
            return None  # took no reference: its first needed item was the one that cannot run
        return AdmissionPlan(hit, plan=plan)

    def record(self, req: Request, num_hit: int, lane: Lane) -> None:
        """At `req`'s first admission, after `num_hit` cached tokens: set its `num_cached_tokens`
        and, when it looked up the prefix cache, count the lookup here and in the request's `cache_counts`."""
        if req.num_cached_tokens is not None:
            return
        req.num_cached_tokens = num_hit
        if self.kv_cache.enable_caching and lane.reads_caches and req.prompt_logprobs is None:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += num_hit
            req.count_cache("prefix", num_hit, req.num_tokens)

    def block_copies(self, req: Request, hit: PrefixHit) -> list[tuple[int, int]]:
        """The runner's copy of the hit's last or partial block into `req`'s block after its shared
        ones (its blocks allocated), before the step's forward writes to any block."""
        if hit.copy is None:
            return []
        return [(hit.copy.block_id, self.kv_cache.get_block_ids(req.request_id)[len(hit.blocks)])]
