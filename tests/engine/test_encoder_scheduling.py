"""The scheduler's encoder work with plain requests and no model: the compute budget, reuse of
resident outputs across requests, one encoder run per hash per step, chunked and unchunked
placeholders, cache space running short, and preemption."""

from __future__ import annotations

import pytest

from mmserve.config import SchedulerConfig
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.scheduler import Scheduler
from mmserve.ipc.worker_messages import SchedulerOutput
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.sampling_params import SamplingParams
from helpers.scheduler_sim import fake_step


def make_scheduler(max_tokens=64, num_blocks=64, max_item_tokens=8, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_tokens, **config),
                     KVCacheManager(num_blocks, 4, enable_caching=False), 256, max_item_tokens)


def make_request(rid: str, n_prompt: int, images=(), max_tokens=2) -> Request:
    """`images`: (mm_hash, offset, length) per item."""
    items = [MultiModalItem("image", h, None, PlaceholderRange(off, length)) for h, off, length in images]
    return Request(rid, list(range(10, 10 + n_prompt)), items, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   None, 0.0)


def step(s: Scheduler) -> SchedulerOutput:
    return fake_step(s)[0]


def run(s: Scheduler, *reqs: Request) -> list[SchedulerOutput]:
    for r in reqs:
        s.add_request(r)
    outs = []
    while s.num_unfinished_requests:
        outs.append(step(s))
    return outs


def encoded(outs: list[SchedulerOutput]) -> list[tuple[str, int]]:
    return [(rid, idx) for so in outs for rid, idxs in so.scheduled_encoder_inputs.items() for idx in idxs]


def test_a_resident_image_after_different_text_is_not_encoded_again():
    s = make_scheduler()
    run(s, make_request("a", 20, [("img", 3, 8)]))
    outs = run(s, make_request("b", 26, [("img", 9, 8)]))  # other text before the same image
    assert encoded(outs) == []
    enc = s.encoder_cache
    assert (enc.num_queries, enc.num_hits, enc.num_resident_items, enc.num_resident_tokens) == (2, 1, 1, 8)


def test_the_same_image_in_two_requests_of_one_step_and_twice_in_one_request_is_encoded_once():
    s = make_scheduler()
    outs = run(s, make_request("a", 20, [("img", 2, 8)]), make_request("b", 30, [("img", 4, 8), ("img", 14, 8)]))
    assert encoded(outs) == [("a", 0)]
    assert (s.encoder_cache.num_queries, s.encoder_cache.num_hits) == (3, 2)


def test_the_compute_budget_stops_a_chunk_before_the_image_that_does_not_fit():
    s = make_scheduler(max_num_encoder_input_tokens=8)
    for r in (make_request("a", 20, [("x", 2, 8)]), make_request("b", 20, [("y", 5, 8)])):
        s.add_request(r)
    so = step(s)
    assert so.scheduled_encoder_inputs == {"a": [0]} and so.num_scheduled_tokens == {"a": 20, "b": 5}
    so = step(s)
    assert so.scheduled_encoder_inputs == {"b": [0]} and so.num_scheduled_tokens["b"] == 15


def test_a_request_whose_first_image_cannot_run_is_not_admitted():
    s = make_scheduler(max_num_encoder_input_tokens=8)
    for r in (make_request("a", 20, [("x", 2, 8)]), make_request("b", 20, [("y", 0, 8)])):
        s.add_request(r)
    so = step(s)
    assert so.num_scheduled_tokens == {"a": 20} and s.requests["b"].status is RequestStatus.WAITING
    assert not s.encoder_cache.held_items("b")


def test_chunked_mm_input_encodes_once_and_keeps_the_output_across_chunks():
    s = make_scheduler(max_tokens=3)
    s.add_request(make_request("a", 16, [("x", 2, 8)]))
    held = []
    outs = []
    while s.num_unfinished_requests:
        outs.append(step(s))
        held.append(bool(s.encoder_cache.held_items("a")))
    assert encoded(outs) == [("a", 0)] and outs[0].num_scheduled_tokens == {"a": 3}
    assert held[:4] == [True, True, True, False]  # chunks end at 3, 6, 9 (< 10), then 12: consumed
    assert s.encoder_cache.contains("x")


def test_without_chunked_mm_input_placeholders_are_never_split():
    s = make_scheduler(max_tokens=10, disable_chunked_mm_input=True)
    s.add_request(make_request("a", 24, [("x", 4, 8), ("y", 13, 8)]))
    chunks = []
    while s.num_unfinished_requests:
        so = step(s)
        start = s.requests["a"].num_computed_tokens - so.num_scheduled_tokens["a"] if "a" in s.requests else None
        chunks.append((start, so.num_scheduled_tokens["a"]))
    assert chunks[:4] == [(0, 4), (4, 9), (13, 10), (23, 1)]  # each image whole in one step
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        make_scheduler(max_tokens=7, disable_chunked_mm_input=True)  # an 8-token image never fits


def test_short_cache_space_holds_a_request_back_until_an_output_is_unused():
    s = make_scheduler(max_tokens=8, encoder_cache_tokens=8)
    a, b = make_request("a", 14, [("A", 4, 8)]), make_request("b", 12, [("B", 0, 8)])
    s.add_request(a)
    step(s)  # a: [0, 8) allocates A, which it needs until token 12
    s.add_request(b)
    so = step(s)
    assert so.num_scheduled_tokens == {"a": 6}  # 2 tokens left over, but B has no room while a uses A
    assert s.requests["b"].status is RequestStatus.WAITING
    so = step(s)  # A is unused now: evicted to make room for B
    assert so.scheduled_encoder_inputs == {"b": [0]} and so.free_encoder_ids == ["A"]


def test_an_item_larger_than_the_budgets_is_refused_at_add():
    s = make_scheduler(max_tokens=16, max_item_tokens=8)
    with pytest.raises(ValueError, match="encoder"):
        s.add_request(make_request("a", 30, [("x", 2, 20)]))
    assert not s.requests and not s.waiting


def test_a_preempted_request_releases_its_references_and_reuses_its_output():
    # 7 blocks of 4: a decodes past 12 tokens while b is midway through its image, so b is preempted
    s = make_scheduler(max_tokens=12, num_blocks=7, max_item_tokens=16)
    a, b = make_request("a", 8, max_tokens=12), make_request("b", 24, [("B", 4, 16)])
    s.add_request(a)
    s.add_request(b)
    outs, seen = [], False
    while s.num_unfinished_requests:
        outs.append(step(s))
        if b.status is RequestStatus.PREEMPTED and not seen:
            seen = True
            assert s.encoder_cache.held_items("b") == {} and s.encoder_cache.contains("B")
    assert seen and b.num_preemptions > 0
    assert encoded(outs) == [("b", 0)]  # resumed from token 0, it found its output resident
