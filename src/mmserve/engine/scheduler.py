"""The scheduler: continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget (`max_num_batched_tokens`). Running requests go first, in
arrival order, each taking what it still needs (1 token when decoding, a chunk of its prompt
when prefilling). When KV blocks run out, the most recently admitted running request is
preempted: its blocks are freed and it waits at the front of the queue, to be recomputed from
token 0 (its outputs so far become part of what is recomputed). Waiting requests are admitted
afterwards, in order, while budget, `max_num_seqs` and free blocks allow — and not in a step
that had to preempt.

Prefix cache: a request being admitted first takes the longest run of cached full blocks that
match its block hashes, and its prefill starts after them. At least one token is always computed
(the hit is capped at `num_tokens - 1`, so a prompt that hits whole recomputes its last block),
and a hit never ends strictly inside an item's placeholder range (see `back_off_from_placeholders`).
Blocks are registered in the cache as soon as the scheduled tokens fill them; finished, aborted and
preempted requests free their blocks into the LRU queue with their hashes kept.

Encoder work: an image's encoder runs in the step that first schedules any of its placeholder
tokens; its output stays in the runner until the request has computed all of them.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from mmserve.config import SchedulerConfig
from mmserve.engine.kv_cache import KVBlock, KVCacheManager
from mmserve.engine.request import Request, RequestStatus
from mmserve.ipc.messages import (CachedRequestData, EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput,
                                  NewRequestData, SchedulerOutput, encoder_key)
from mmserve.multimodal.inputs import MultiModalItem


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # to drop from the runner at the next step
        self._free_encoder_ids: list[str] = []  # encoder outputs the runner may drop
        self._encoded: dict[str, set[int]] = {}  # request id -> items whose output the runner holds
        self._known_to_runner: set[str] = set()
        self.num_preemptions = 0  # since start, for tests and metrics
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache at first admission, since start
        self.prefix_hits = 0  # of which were cache hits

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string); unknown ids are ignored."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req in self.running:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], {}, {}, self._free_encoder_ids, sorted(self._finished_ids))
        self._free_encoder_ids, self._finished_ids = [], set()
        budget = self.config.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv_cache.can_allocate(req.request_id, req.num_computed_tokens + n):
                preempted = True
                if self._preempt_last() is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            self._schedule(req, n, out)
            budget -= n
            i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            computed = self._cached_prefix(req)
            num_hit = len(computed) * self.kv_cache.block_size
            n = min(req.num_tokens - num_hit, budget)
            if not self.kv_cache.can_allocate(req.request_id, num_hit + n, computed):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._admit(req, num_hit)
            self._schedule(req, n, out, computed)
            budget -= n
        return out

    def _cached_prefix(self, req: Request) -> list[KVBlock]:
        """The cache hits a waiting request can use: whole blocks, at least one token left to
        compute, not ending inside a placeholder range. Changes nothing."""
        bs = self.kv_cache.block_size
        hits = self.kv_cache.find_cached_prefix(req.block_hashes, (req.num_tokens - 1) // bs)
        return hits[:back_off_from_placeholders(len(hits) * bs, req.mm_items, bs) // bs]

    def _admit(self, req: Request, num_hit: int) -> None:
        """Start `req` after its `num_hit` cached tokens; the first admission sets its
        `num_cached_tokens` and counts the lookup in `prefix_queries` / `prefix_hits`."""
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_hit
            if self.kv_cache.enable_caching:
                self.prefix_queries += req.num_tokens
                self.prefix_hits += num_hit

    def _schedule(self, req: Request, n: int, out: SchedulerOutput, computed: Sequence[KVBlock] = ()) -> None:
        """Give `req` `n` tokens this step (after the cache hits `computed`, when admitted): slots,
        encoder inputs, and what the runner needs; blocks the step fills join the prefix cache."""
        rid, start = req.request_id, req.num_computed_tokens
        new_blocks = self.kv_cache.allocate_slots(rid, start + n, computed)
        assert new_blocks is not None, "caller checked can_allocate"
        self.kv_cache.cache_full_blocks(rid, req.block_hashes, start + n)
        if rid in self._known_to_runner:
            out.cached_requests.append(CachedRequestData(rid, new_blocks, start))
        else:
            self._known_to_runner.add(rid)
            out.new_requests.append(NewRequestData(rid, list(req.all_token_ids), req.mm_items, req.sampling_params,
                                                   self.kv_cache.get_block_ids(rid).copy(), start))
        encoded = self._encoded.setdefault(rid, set())
        to_encode = [idx for idx, item in enumerate(req.mm_items)
                     if idx not in encoded and item.placeholder.overlaps(start, start + n)]
        if to_encode:
            out.scheduled_encoder_inputs[rid] = to_encode
            encoded.update(to_encode)
        out.num_scheduled_tokens[rid] = n
        req.num_computed_tokens += n

    def _preempt_last(self) -> Request:
        victim = self.running.pop()
        self._release(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    # ---- after the step ---------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> EngineCoreOutputs:
        """Append sampled tokens, finish requests that stop, and say what is new per request."""
        outputs: list[EngineCoreOutput] = []
        for rid in sched.num_scheduled_tokens:
            req = self.requests[rid]
            if req.status is not RequestStatus.RUNNING:
                continue
            self._free_consumed_encoder_outputs(req)
            tokens = result.sampled_token_ids.get(rid)
            if not tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            req.append_output_token_ids(tokens)
            status = self._check_stop(req)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            first = req.num_output_tokens == len(tokens)
            outputs.append(EngineCoreOutput(rid, tokens, req.status.finish_reason, req.stop_reason,
                                            num_cached_tokens=(req.num_cached_tokens or 0) if first else 0))
        return EngineCoreOutputs(outputs)

    def _check_stop(self, req: Request) -> RequestStatus | None:
        last = req.all_token_ids[-1]
        params = req.sampling_params
        if not params.ignore_eos and last == req.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            req.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self._release(req)
        del self.requests[req.request_id]

    def _release(self, req: Request) -> None:
        """Free the request's blocks and encoder outputs; the runner drops its state next step."""
        self.kv_cache.free(req.request_id)
        for idx in self._encoded.pop(req.request_id, ()):
            self._free_encoder_ids.append(encoder_key(req.request_id, idx))
        if req.request_id in self._known_to_runner:
            self._known_to_runner.discard(req.request_id)
            self._finished_ids.add(req.request_id)

    def _free_consumed_encoder_outputs(self, req: Request) -> None:
        encoded = self._encoded.get(req.request_id, set())
        for idx in [i for i in encoded if req.mm_items[i].placeholder.end <= req.num_computed_tokens]:
            encoded.discard(idx)
            self._free_encoder_ids.append(encoder_key(req.request_id, idx))

    def check_integrity(self) -> None:
        """Queues and block ownership agree: every owner of blocks is running."""
        self.kv_cache.check_integrity()
        assert set(self.kv_cache.req_to_blocks) <= {r.request_id for r in self.running}, "a non-running request owns blocks"
        assert {r.request_id for r in self.running} | {r.request_id for r in self.waiting} == set(self.requests)
        assert len(self.running) <= self.config.max_num_seqs
        for req in self.running:
            blocks = len(self.kv_cache.req_to_blocks.get(req.request_id, ()))
            assert blocks >= self.kv_cache.blocks_needed(req.num_computed_tokens), f"{req} lacks KV blocks"


def back_off_from_placeholders(num_tokens: int, mm_items: Sequence[MultiModalItem], block_size: int) -> int:
    """The longest block-aligned prefix of at most `num_tokens` (block-aligned) tokens that does
    not end strictly inside any item's placeholder range.

    A cached prefix that ends inside an image would leave the rest of its placeholders to compute,
    which needs the image's encoder output; until encoder outputs are cached across requests, the
    hit backs off to the block holding the image's first placeholder (and again, should that
    block boundary fall inside an earlier image).
    """
    changed = True
    while changed:
        changed = False
        for item in mm_items:
            ph = item.placeholder
            if ph.offset < num_tokens < ph.end:
                num_tokens = ph.offset // block_size * block_size
                changed = True
    return num_tokens
