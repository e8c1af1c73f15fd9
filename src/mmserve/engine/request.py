"""A request's state inside the engine core."""

from __future__ import annotations

import enum
import time

import msgspec

from mmserve.engine.block_hash import BlockHash, BlockHasher, ExtraKeys
from mmserve.engine.encoder_cache import SHADOW_HASH_PREFIX
from mmserve.ipc.items import MultiModalItem
from mmserve.ipc.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, TokenLogprobs, sibling_request_id
from mmserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # waiting again, its KV blocks gone; recomputed from token 0
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """Tokens known so far (prompt + outputs) and how many of them have K/V in the cache.

    Invariant: 0 <= num_computed_tokens <= num_tokens + num_in_flight. After a step has been
    scheduled, `num_computed_tokens` already counts its tokens (the runner computes them that step).
    `num_in_flight` counts the tokens that scheduled steps sample and the scheduler has not yet
    appended: 0 between steps without --async-scheduling; with it, a request may be scheduled again
    (its next token's K/V, from the token the device already sampled) before the last step's token
    arrives, so up to 2.

    With a `block_hasher` (prefix caching on), `block_hashes[i]` is the hash of full block i of
    `all_token_ids`; it grows as tokens become known (at creation, then in
    `append_output_token_ids`), so each block is hashed once. Without one it stays empty.
    `num_cached_tokens` is the prefix-cache hit of its first admission (None before it).
    A completion of an n > 1 request (`sibling`) answers to its request's `client_id` as `index`.
    `cache_counts` is what each cache layer did for this request's prompt (`count_cache`), sent
    back with its first output. A `shadow` request (the cache verifier's) reads and writes no
    cache: it has no block hashes, and its items carry private hashes (`shadow_items`). A request
    with `SamplingParams.prompt_logprobs` gathers them in `prompt_logprobs` (one per prompt token
    after the first, as its chunks are computed; sent with its first output) and reads no prefix
    cache: every prompt token is computed.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], mm_items: list[MultiModalItem],
                 sampling_params: SamplingParams, eos_token_id: int | None, arrival_time: float, *,
                 cache_salt: str | None = None, block_hasher: BlockHasher | None = None,
                 return_first_logits: bool = False, shadow: bool = False, priority: int = 0,
                 return_hidden: bool = False) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.mm_items = mm_items
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.queued_at = time.monotonic()  # P1's clock, as every time it sends (`EngineCoreOutput`)
        self.scheduled_at: float | None = None  # first admitted (a preempted request keeps it)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_in_flight = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        self.cache_salt = cache_salt
        self.num_cached_tokens: int | None = None
        self.block_hashes: list[BlockHash] = []
        self.block_extra_keys: list[ExtraKeys] = []  # per hashed block, when the hasher keeps them
        self._block_hasher = block_hasher
        self._update_block_hashes()
        self.client_id = request_id
        self.index = 0
        self.return_first_logits = return_first_logits
        self.return_hidden = return_hidden  # an embedding: P1 sends back its prompt's last hidden state
        self.answered_hidden: bytes | None = None  # that state, kept by the first-token cache, when it answered
        self.shadow = shadow
        self.cache_counts: dict[str, tuple[int, int]] = {}  # layer -> (hits, queries) for the prompt
        self.order = 0  # the scheduler's arrival number (siblings share their request's)
        self.priority = priority  # --scheduling-policy priority: the lower, the sooner (`policies/priority.py`)
        self.prompt_logprobs: list[TokenLogprobs] | None = None if sampling_params.prompt_logprobs is None else []

    @classmethod
    def from_engine_core_request(cls, r: EngineCoreRequest, block_hasher: BlockHasher | None = None) -> Request:
        if r.bypass_caches:
            return cls(r.request_id, r.prompt_token_ids, shadow_items(r.request_id, r.mm_items), r.sampling_params,
                       r.eos_token_id, r.arrival_time, cache_salt=r.cache_salt, return_first_logits=True, shadow=True)
        return cls(r.request_id, r.prompt_token_ids, r.mm_items, r.sampling_params, r.eos_token_id, r.arrival_time,
                   cache_salt=r.cache_salt, block_hasher=block_hasher, return_first_logits=r.return_first_logits,
                   priority=r.priority, return_hidden=r.return_hidden)

    def add_prompt_logprobs(self, first: int, entries: list[TokenLogprobs]) -> None:
        """Prompt tokens `first`, `first` + 1, ...'s log probabilities, as a step scored them; those
        gathered already (a chunk computed again after a preemption) are skipped."""
        if self.prompt_logprobs is not None:
            have = 1 + len(self.prompt_logprobs)  # the next prompt token without one
            assert first <= have, f"prompt log probabilities from token {first}, expected {have}"
            self.prompt_logprobs.extend(entries[max(0, have - first):])

    def sibling(self, index: int) -> Request:
        """Completion `index` of this (n > 1) request, before it runs: the same prompt, items and
        salt, its block hashes copied rather than recomputed, `SamplingParams.for_sibling`."""
        n = self.sampling_params.n
        sib = Request(sibling_request_id(self.client_id, index, n), self.prompt_token_ids, self.mm_items,
                      self.sampling_params.for_sibling(index), self.eos_token_id, self.arrival_time,
                      cache_salt=self.cache_salt, priority=self.priority)
        sib.block_hashes = list(self.block_hashes)
        sib.block_extra_keys = list(self.block_extra_keys)
        sib._block_hasher = self._block_hasher
        sib.client_id, sib.index, sib.order = self.client_id, index, self.order
        return sib

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        """Append sampled tokens; hashes the blocks they fill (mutates `block_hashes`)."""
        self.all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def drop_last_token(self) -> None:
        """Take back the last appended token (a step that failed), and the block hash it made."""
        self.all_token_ids.pop()
        if self._block_hasher is not None:
            full = len(self.all_token_ids) // self._block_hasher.block_size
            del self.block_hashes[full:], self.block_extra_keys[full:]

    def count_cache(self, layer: str, hits: int, queries: int, add: bool = False) -> None:
        """Record what cache `layer` did for this request's prompt: (hits, queries), replacing the
        layer's last lookup (an admission tried again looks up again), or with `add` added to it."""
        if add and layer in self.cache_counts:
            old_hits, old_queries = self.cache_counts[layer]
            hits, queries = old_hits + hits, old_queries + queries
        self.cache_counts[layer] = (hits, queries)

    def start_running(self) -> None:
        """Admitted: it runs from now on (its first admission's time is kept, for its queue time)."""
        self.status = RequestStatus.RUNNING
        if self.scheduled_at is None:
            self.scheduled_at = time.monotonic()

    def output(self, tokens: list[int], siblings_running: bool, logprobs: list[TokenLogprobs] | None,
               first_logits: bytes | None, hidden: bytes | None = None) -> EngineCoreOutput:
        """What is new for this completion, its `tokens` appended already (its status decided). The
        first output carries what the caches did for the prompt, its P1 times and, when asked, the
        first logits and the prompt's log probabilities."""
        first = self.num_output_tokens == len(tokens)
        out = EngineCoreOutput(self.client_id, tokens, self.status.finish_reason, self.stop_reason,
                               index=self.index, siblings_running=siblings_running, new_logprobs=logprobs,
                               first_logits=first_logits, hidden=hidden, timestamp=time.monotonic())
        if first:
            out.num_cached_tokens = self.num_cached_tokens or 0
            out.cache_counts, out.prompt_logprobs = dict(self.cache_counts), self.prompt_logprobs
            out.queued_at, out.scheduled_at = self.queued_at, self.scheduled_at
        return out

    def stop_status(self, max_model_len: int) -> RequestStatus | None:
        """How the request ends after its last token: FINISHED_STOPPED on EOS (unless ignored) or a
        stop token id (then `stop_reason`), FINISHED_LENGTH at `max_tokens` or the model's length;
        None while it goes on."""
        last = self.all_token_ids[-1]
        params = self.sampling_params
        if not params.ignore_eos and last == self.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def ends_in_flight(self, max_model_len: int) -> bool:
        """Whether the tokens in flight (--async-scheduling) reach `max_tokens` or the model's
        length: the request ends when they arrive, so it is not scheduled again."""
        if not self.num_in_flight:
            return False
        total = self.num_tokens + self.num_in_flight
        return total - self.num_prompt_tokens >= self.sampling_params.max_tokens or total >= max_model_len

    def last_block_hash(self, num_tokens: int) -> BlockHash | None:
        """The prefix-cache key of the block holding token `num_tokens - 1`, over its tokens up to
        that one (`BlockHasher.last_block_hash`); None without a block hasher."""
        hasher = self._block_hasher
        if hasher is None:
            return None
        return hasher.last_block_hash(self.all_token_ids, num_tokens, self.mm_items, self.cache_salt, self.block_hashes)

    def block_parent(self, index: int) -> BlockHash | None:
        """The hash that block `index` chains from (block `index - 1`'s, or the hasher's seed for
        the first block); None without a block hasher or before block `index - 1` is hashed."""
        hasher = self._block_hasher
        if hasher is None or index > len(self.block_hashes):
            return None
        return self.block_hashes[index - 1] if index else hasher.seed

    def _update_block_hashes(self) -> None:
        hasher = self._block_hasher
        if hasher is not None and len(self.all_token_ids) >= (len(self.block_hashes) + 1) * hasher.block_size:
            keys: list[ExtraKeys] | None = [] if hasher.keep_extra_keys else None
            self.block_hashes += hasher.new_block_hashes(self.all_token_ids, self.mm_items, self.cache_salt,
                                                         self.block_hashes, keys)
            if keys:
                self.block_extra_keys += keys

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")


def shadow_items(request_id: str, items: list[MultiModalItem]) -> list[MultiModalItem]:
    """A shadow request's items under hashes of its own, so the encoder cache neither serves nor
    keeps their outputs for any other request."""
    return [msgspec.structs.replace(item, mm_hash=f"{SHADOW_HASH_PREFIX}{request_id}/{i}")
            for i, item in enumerate(items)]
