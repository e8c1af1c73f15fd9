"""The prefix cache without a model: the block pool's LRU queue and hash map, and the scheduler's
hits (whole blocks, never ending inside an image whose encoder output is not resident, at least one
token left to compute). Last-block caching is off here unless a test says otherwise
(`test_last_block_cache.py` tests it)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.prefix_hits import back_off_from_placeholders
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from helpers.scheduler_sim import BS, fake_step, make_request, make_scheduler, run



def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# ---- the pool ---------------------------------------------------------------------------------


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.append(blocks[2])
    q.remove(blocks[0])
    assert ids(list(q)) == [1, 3, 4, 2] and len(q) == 4
    q.check_integrity()
    assert q.popleft() is blocks[1]


def test_freed_cached_blocks_keep_their_hash_until_evicted_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    kv.allocate_slots("a", 12)  # blocks 0, 1, 2
    kv.cache_full_blocks("a", [b"h0", b"h1", b"h2"], 12)
    kv.free("a")  # queue: 3 4 5 | 2 1 0 (tail first)
    assert ids(list(kv.pool.free_queue)) == [3, 4, 5, 2, 1, 0]
    assert kv.pool.num_cached_blocks == 3 and kv.num_free_blocks == 6
    kv.allocate_slots("b", 16)  # takes 3 4 5, then evicts 2 (a's tail block)
    assert kv.get_block_ids("b") == [3, 4, 5, 2]
    assert kv.pool.num_evictions == 1 and kv.pool.get_cached_block(b"h2") is None
    assert ids(kv.find_cached_prefix([b"h0", b"h1", b"h2"], 3)) == [0, 1]
    kv.check_integrity()


def test_a_hit_on_a_free_block_takes_it_out_of_the_free_queue():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    kv.allocate_slots("a", 8)
    kv.cache_full_blocks("a", [b"h0", b"h1"], 8)
    kv.free("a")
    hits = kv.find_cached_prefix([b"h0", b"h1", b"zz"], 3)
    assert ids(hits) == [0, 1]
    assert kv.can_allocate("b", 16, hits) and not kv.can_allocate("b", 20, hits)
    assert kv.allocate_slots("b", 12, hits) == [2]  # only the third block is new
    assert kv.get_block_ids("b") == [0, 1, 2] and kv.num_free_blocks == 1
    kv.allocate_slots("c", 4, kv.find_cached_prefix([b"h0"], 1))  # shared: ref count 2
    assert kv.pool.blocks[0].ref_cnt == 2
    kv.check_integrity()
    kv.free("b")
    kv.free("c")
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 2
    kv.check_integrity()


def test_duplicate_blocks_under_one_hash_are_allowed_and_evicted_one_by_one():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"same")
    pool.cache_block(b, b"same")  # computed at the same time by two requests
    assert pool.num_cached_blocks == 2 and pool.get_cached_block(b"same") in (a, b)
    pool.free([a, b])
    pool.allocate(2)  # the never-used block 2, then a (evicted)
    assert pool.get_cached_block(b"same") is b and pool.num_evictions == 1
    pool.check_integrity()


def test_disabled_caching_never_hits_or_registers():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=False)
    kv.allocate_slots("a", 8)
    kv.cache_full_blocks("a", [b"h0", b"h1"], 8)
    assert kv.pool.num_cached_blocks == 0 and kv.find_cached_prefix([b"h0"], 1) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcde"), st.sampled_from("xyz"), st.integers(0, 24),
                          st.sampled_from(["grow", "free", "admit"])), max_size=50))
def test_random_allocate_hit_cache_free_keeps_integrity(ops):
    """Requests follow one of three token streams ('x', 'y', 'z': block i hashes to `stream + i`),
    so that admissions hit what other requests cached."""
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    sizes: dict[str, tuple[str, int]] = {}
    for rid, stream, n, op in ops:
        chain = [f"{stream}{i}".encode() for i in range(12)]
        if op == "free":
            kv.free(rid)
            sizes.pop(rid, None)
        elif op == "admit" and rid not in sizes:
            hits = kv.find_cached_prefix(chain, 12)
            want = len(hits) * BS + n
            if kv.allocate_slots(rid, want, hits) is not None:
                sizes[rid] = (stream, want)
        elif op == "grow" and rid in sizes:
            stream, have = sizes[rid]
            if kv.allocate_slots(rid, min(have + n, 48)) is not None:
                sizes[rid] = (stream, min(have + n, 48))
        if rid in sizes:
            stream, have = sizes[rid]
            kv.cache_full_blocks(rid, [f"{stream}{i}".encode() for i in range(12)], have)
        kv.check_integrity()
        for r, (_, have) in sizes.items():
            assert len(kv.get_block_ids(r)) == kv.blocks_needed(have)
    for r in list(sizes):
        kv.free(r)
    kv.check_integrity()
    assert kv.num_free_blocks == 10


# ---- the scheduler ----------------------------------------------------------------------------


def hit_after_warmup(tokens, images=(), second=None, encoder_cache_tokens=0) -> int:
    """Run one request to the end, then admit `second` (default: the same request again). The
    encoder cache is off by default, so the first request's images are no longer resident."""
    s = make_scheduler(encoder_cache_tokens=encoder_cache_tokens)
    run(s, make_request("first", tokens, images))
    req = second or make_request("second", tokens, images)
    s.add_request(req)
    so, _ = fake_step(s)
    assert so.new_requests[0].num_computed_tokens == req.num_cached_tokens
    return req.num_cached_tokens


@pytest.mark.parametrize("n, images, expected", [
    (20, [], 16),  # the text's 4 full blocks (the 5th holds the last token, which is recomputed)
    (16, [], 12),  # the whole prompt hits: back off one block so one token is computed
    (20, [("img", 6, 12)], 4),  # the hit (16) ends inside [6, 18): back off to the block holding 6
    (20, [("img", 8, 10)], 8),  # the image starts on a block boundary: back off to it exactly
    (20, [("img", 6, 10)], 16),  # the image ends where the hit ends: usable whole
    (20, [("img", 2, 14)], 16),  # the image ends on the hit's boundary from inside block 0
    (20, [("a", 2, 7), ("b", 9, 9)], 0),  # backing off from b lands inside a: back off again
])
def test_hit_lengths_with_images_inside_and_on_block_boundaries(n, images, expected):
    assert hit_after_warmup(range(100, 100 + n), images) == expected


@pytest.mark.parametrize("images", [[("img", 6, 12)], [("img", 8, 10)], [("a", 2, 7), ("b", 9, 9)]])
def test_a_hit_may_end_inside_an_image_whose_encoder_output_is_resident(images):
    assert hit_after_warmup(range(100, 120), images, encoder_cache_tokens=None) == 16


def test_a_different_image_with_identical_tokens_hits_only_the_blocks_before_it():
    tokens = range(100, 124)
    other = make_request("second", tokens, [("dog", 6, 9)])
    assert other.all_token_ids == make_request("x", tokens, [("cat", 6, 9)]).all_token_ids
    assert hit_after_warmup(tokens, [("cat", 6, 9)], second=other, encoder_cache_tokens=None) == 4


def test_salt_isolates_requests():
    tokens = range(100, 120)
    assert hit_after_warmup(tokens, second=make_request("salted", tokens, salt="tenant")) == 0


def test_generated_tokens_are_cached_for_the_next_turn():
    s = make_scheduler()
    first = make_request("turn1", range(100, 110), max_tokens=8)
    run(s, first)
    turn2 = make_request("turn2", first.all_token_ids + [55, 56, 57])
    run(s, turn2)
    # turn 1 computed its 10 prompt + 7 output tokens (the 8th was never fed back): 4 full blocks
    assert turn2.num_cached_tokens == 16 > first.num_prompt_tokens


@pytest.mark.parametrize("last_blocks", [False, True])
def test_a_request_admitted_in_the_same_step_hits_blocks_scheduled_just_before_it(last_blocks):
    """...its full blocks, not the last one: that is registered only once its step has run."""
    s = make_scheduler(last_blocks=last_blocks)
    a, b = make_request("a", range(100, 119)), make_request("b", range(100, 119))
    s.add_request(a)
    s.add_request(b)
    so, _ = fake_step(s)
    assert so.num_scheduled_tokens == {"a": 19, "b": 3} and b.num_cached_tokens == 16
    assert so.new_requests[1].block_ids[:4] == so.new_requests[0].block_ids[:4] and so.kv_copies == []


def test_first_output_carries_num_cached_tokens_and_stats_count_it():
    s = make_scheduler()
    run(s, make_request("a", range(100, 120)))
    s.add_request(make_request("b", range(100, 120), max_tokens=2))
    outs = [o for _ in range(2) for o in fake_step(s)[1].outputs]
    assert [o.num_cached_tokens for o in outs] == [16, 0]
    assert (s.admission.prefix_queries, s.admission.prefix_hits) == (40, 16)


def test_no_hits_with_caching_disabled():
    s = make_scheduler(enable_caching=False)
    run(s, make_request("a", range(100, 120)))
    req = make_request("b", range(100, 120))
    run(s, req)
    assert req.num_cached_tokens == 0 and s.kv_cache.pool.num_cached_blocks == 0
    assert (s.admission.prefix_queries, s.admission.prefix_hits) == (0, 0)


def test_a_preempted_request_resumes_from_its_own_cached_blocks():
    s = make_scheduler(num_blocks=9)
    a, b = make_request("a", range(100, 116), max_tokens=10), make_request("b", range(200, 216), max_tokens=10)
    for r in (a, b):
        s.add_request(r)
    resumed = []
    while s.num_unfinished_requests:
        so, _ = fake_step(s)
        resumed += [n.num_computed_tokens for n in so.new_requests if n.request_id == "b" and b.num_preemptions]
    assert b.num_preemptions > 0 and resumed and resumed[0] > 0
    assert b.num_cached_tokens == 0  # reported for the first admission only
    assert s.kv_cache.num_free_blocks == 9


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 40), st.lists(st.tuples(st.integers(0, 39), st.integers(1, 12)), max_size=3))
def test_a_hit_never_ends_inside_an_image_and_leaves_a_token_to_compute(n, raw):
    layout, end = [], 0
    for gap, length in sorted(raw):  # non-overlapping, in order, inside the prompt
        off = end + gap % 5
        if off + length <= n:
            layout.append((f"img{off}", off, length))
            end = off + length
    hit = hit_after_warmup(range(100, 100 + n), layout)
    assert hit % BS == 0 and hit < n
    assert not any(off < hit < off + length for _, off, length in layout)
    valid = [h for h in range(0, n, BS) if not any(off < h < off + length for _, off, length in layout)]
    assert hit == max(valid)  # and it is the longest such prefix


def test_back_off_from_placeholders_directly():
    items = [MultiModalItem("image", "a", None, PlaceholderRange(5, 6))]
    assert [back_off_from_placeholders(h, items, BS) for h in (0, 4, 8, 12)] == [0, 4, 4, 12]
    assert back_off_from_placeholders(8, items, BS, resident=lambda h: h == "a") == 8
    assert back_off_from_placeholders(8, items, BS, resident=lambda h: False) == 4
