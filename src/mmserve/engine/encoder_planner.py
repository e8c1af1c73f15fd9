"""The scheduler's encoder side: what a request's chunk needs from the vision encoder this step.

A chunk of tokens [start, start + n) needs the encoder output of every item whose placeholders
it reaches. Per item, in prompt order: an output the request already references needs nothing;
a resident one is referenced (a hit: no encoder run); an item whose hash another item of the
same chunk is encoding shares that run; otherwise the item is encoded if the step's compute
budget and the cache's space allow. When they do not — or when `--disable-chunked-mm-input`
forbids splitting an item that does not fit the chunk — the chunk stops before the item (it may
become 0 tokens: the request waits for a later step).

Across requests, an item some request allocated earlier in the step is resident by then, so the
same image in two requests of one step is encoded once; `scheduled_encoder_inputs` therefore
names each hash at most once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.engine.encoder_cache import EncoderCacheManager
from mmserve.engine.request import Request


@dataclass
class EncoderPlan:
    """One request's encoder work for one step (made by `plan`, applied by `commit`)."""

    num_tokens: int  # the chunk, shortened so it stops before an item that cannot run
    to_encode: list[int] = field(default_factory=list)  # item indices to encode, one per new mm_hash
    to_share: list[int] = field(default_factory=list)  # items whose hash an item in to_encode brings
    num_encoder_tokens: int = 0  # embedding tokens of to_encode


class EncoderPlanner:
    """Plans each scheduled request's encoder inputs within the step's compute budget.

    Mutates the cache only through its verbs: `plan` may take references (hits) and evict unused
    outputs; `commit` allocates and spends the budget; `release_consumed` drops references to
    outputs whose placeholders are all computed. Items are in prompt order (placeholder offsets
    increasing), as the processor makes them.
    """

    def __init__(self, cache: EncoderCacheManager, compute_budget: int, chunked_mm_input: bool) -> None:
        self.cache = cache
        self.compute_budget = compute_budget  # embedding tokens per step
        self.chunked_mm_input = chunked_mm_input
        self.budget_left = compute_budget

    def start_step(self) -> None:
        self.budget_left = self.compute_budget

    def check_fits(self, request: Request, max_num_batched_tokens: int) -> None:
        """A ValueError when one of the request's items could never be scheduled."""
        limit = min(self.compute_budget, self.cache.cache_size)
        if not self.chunked_mm_input:
            limit = min(limit, max_num_batched_tokens)
        for item in request.mm_items:
            if item.placeholder.length > limit:
                raise ValueError(f"an image of {item.placeholder.length} embedding tokens exceeds the encoder's "
                                 f"{limit}-token budget")

    def plan(self, req: Request, start: int, n: int) -> EncoderPlan:
        """What the chunk [start, start + n) of `req` needs encoded; see the module docstring."""
        plan = EncoderPlan(n)
        items = req.mm_items
        if not items or items[-1].placeholder.end <= start:
            return plan  # decoding, or past its last image
        held, new_hashes = self.cache.held_items(req.request_id), set()
        for idx, item in enumerate(items):
            ph = item.placeholder
            if ph.end <= start or idx in held:
                continue
            if ph.offset >= start + plan.num_tokens:
                break
            if not self.chunked_mm_input and start <= ph.offset and ph.end > start + plan.num_tokens:
                plan.num_tokens = ph.offset - start
                break
            if item.mm_hash in new_hashes:
                plan.to_share.append(idx)
            elif self.cache.check_and_update(req, idx):
                req.count_cache("encoder", 1, 1, add=True)
                continue
            elif self.cache.can_allocate(req, idx, self.budget_left - plan.num_encoder_tokens,
                                         plan.num_encoder_tokens):
                plan.to_encode.append(idx)
                plan.num_encoder_tokens += ph.length
                new_hashes.add(item.mm_hash)
            else:
                plan.num_tokens = max(ph.offset - start, 0)
                break
        return plan

    def commit(self, req: Request, plan: EncoderPlan) -> None:
        """The request is scheduled with `plan`: allocate its outputs and spend the budget."""
        for idx in plan.to_encode:
            self.cache.allocate(req, idx)
        for idx in plan.to_share:
            hit = self.cache.check_and_update(req, idx)
            assert hit, "a shared item's output was allocated just before"
        if plan.to_encode or plan.to_share:
            req.count_cache("encoder", len(plan.to_share), len(plan.to_encode) + len(plan.to_share), add=True)
        self.budget_left -= plan.num_encoder_tokens

    def release_consumed(self, req: Request) -> None:
        """Drop the request's references to outputs whose placeholders it has all computed."""
        held = self.cache.held_items(req.request_id)
        for idx in [i for i in held if req.mm_items[i].placeholder.end <= req.num_computed_tokens]:
            self.cache.free_encoder_input(req, idx)
