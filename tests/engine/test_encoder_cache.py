"""The encoder cache manager alone, with plain request objects: references, lazy eviction in
the order entries became unused, restores, freed-hash reporting, budgets; and the budget sizing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.config import SchedulerConfig, compute_encoder_budget
from mmserve.engine.encoder_cache import EncoderCacheManager

BIG = 1 << 20  # a compute budget that never binds


def req(rid: str, *items: tuple[str, int]) -> SimpleNamespace:
    """A request with items given as (mm_hash, embedding tokens)."""
    mm = [SimpleNamespace(mm_hash=h, placeholder=SimpleNamespace(length=n)) for h, n in items]
    return SimpleNamespace(request_id=rid, mm_items=mm)


def load(cache: EncoderCacheManager, r: SimpleNamespace, idx: int = 0) -> bool:
    """What the scheduler does for one item: reuse if resident, else allocate if it can."""
    if cache.check_and_update(r, idx):
        return True
    if not cache.can_allocate(r, idx, BIG, 0):
        return False
    cache.allocate(r, idx)
    return True


def test_an_output_is_shared_and_stays_resident_after_its_last_user():
    cache = EncoderCacheManager(16)
    a, b = req("a", ("x", 6)), req("b", ("x", 6))
    assert not cache.check_and_update(a, 0) and cache.can_allocate(a, 0, BIG, 0)
    cache.allocate(a, 0)
    assert cache.check_and_update(b, 0)  # shared: no second encoder run
    cache.free(a)
    assert cache.num_reclaimable_tokens == 10  # b still uses it
    cache.free(b)
    assert cache.contains("x") and cache.num_resident_tokens == 6 and cache.num_reclaimable_tokens == 16
    assert cache.get_freed_hashes() == []  # unused, not dropped
    assert (cache.num_queries, cache.num_hits) == (2, 1)
    cache.check_integrity()


def test_unused_entries_are_evicted_oldest_first_and_only_when_room_is_needed():
    cache = EncoderCacheManager(12)
    reqs = {h: req(f"r{h}", (h, 4)) for h in "abc"}
    for r in reqs.values():
        assert load(cache, r)
    for h in "bac":  # the order they become unused
        cache.free(reqs[h])
    assert cache.num_free_tokens == 0 and cache.num_resident_items == 3
    d = req("rd", ("d", 8))
    assert cache.can_allocate(d, 0, BIG, 0)
    cache.allocate(d, 0)
    assert cache.get_freed_hashes() == ["b", "a"] and cache.num_evictions == 2
    assert cache.contains("c") and not cache.contains("a")
    assert cache.get_freed_hashes() == []  # reported once
    cache.check_integrity()


def test_a_restored_entry_is_not_evicted():
    cache = EncoderCacheManager(8)
    first = req("first", ("x", 4))
    load(cache, first)
    cache.free(first)
    again = req("again", ("x", 4))
    assert cache.check_and_update(again, 0)  # restored from the freeable queue
    assert cache.num_reclaimable_tokens == 4
    assert not cache.can_allocate(req("big", ("y", 8)), 0, BIG, 0)  # would need the in-use entry
    assert cache.contains("x") and cache.num_evictions == 0
    cache.check_integrity()


def test_the_same_item_twice_in_a_request_stays_referenced_until_both_are_consumed():
    cache = EncoderCacheManager(8)
    r = req("r", ("x", 4), ("x", 4))
    cache.allocate(r, 0)
    assert cache.check_and_update(r, 1)
    assert cache.held_items("r") == {0: "x", 1: "x"} and cache.num_resident_tokens == 4  # counted once
    cache.free_encoder_input(r, 0)
    assert cache.num_reclaimable_tokens == 4  # item 1 still needs it
    cache.free_encoder_input(r, 1)
    assert cache.num_reclaimable_tokens == 8 and cache.held_items("r") == {}
    cache.free_encoder_input(r, 1)  # no reference left: a no-op
    cache.check_integrity()


def test_a_hash_dropped_and_allocated_again_in_one_step_is_not_reported():
    cache = EncoderCacheManager(4)
    old = req("old", ("x", 4))
    load(cache, old)
    cache.free(old)
    assert cache.can_allocate(req("y", ("y", 4)), 0, BIG, 0)  # evicts x, then is not scheduled after all
    assert not cache.contains("x")
    back = req("back", ("x", 4))
    assert load(cache, back)  # x allocated again in the same step: the runner keeps (and rewrites) it
    assert cache.get_freed_hashes() == [] and cache.num_evictions == 1
    cache.check_integrity()


def test_budget_edges():
    cache = EncoderCacheManager(10)
    r = req("r", ("x", 6), ("y", 4), ("z", 5))
    assert cache.can_allocate(r, 0, 6, 0) and not cache.can_allocate(r, 0, 5, 0)  # the compute budget
    assert cache.can_allocate(r, 1, BIG, 6) and not cache.can_allocate(r, 2, BIG, 6)  # space, with pending tokens
    cache.allocate(r, 0)
    cache.allocate(r, 1)
    assert cache.num_free_tokens == 0 and not cache.can_allocate(r, 2, BIG, 0)
    cache.free_encoder_input(r, 1)
    assert not cache.can_allocate(r, 2, BIG, 0)  # 4 reclaimable < 5: nothing is evicted in vain
    assert cache.contains("y") and cache.num_evictions == 0
    cache.check_integrity()


def test_without_keep_unused_an_output_goes_with_its_last_user():
    cache = EncoderCacheManager(8, keep_unused=False)
    a, b = req("a", ("x", 4)), req("b", ("x", 4))
    load(cache, a)
    load(cache, b)  # running requests still share it
    cache.free(a)
    assert cache.get_freed_hashes() == []
    cache.free(b)
    assert cache.get_freed_hashes() == ["x"] and cache.num_free_tokens == 8 and cache.num_evictions == 0
    cache.check_integrity()


def test_compute_encoder_budget():
    assert compute_encoder_budget(SchedulerConfig(max_num_batched_tokens=100), 144) == (144, 144)
    assert compute_encoder_budget(SchedulerConfig(max_num_batched_tokens=1000), 144) == (1000, 1000)
    config = SchedulerConfig(max_num_encoder_input_tokens=300, encoder_cache_tokens=2000)
    assert compute_encoder_budget(config, 144) == (300, 2000)
    assert compute_encoder_budget(SchedulerConfig(encoder_cache_tokens=0), 144) == (4096, 4096)  # off: in-use only
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        compute_encoder_budget(SchedulerConfig(max_num_batched_tokens=100, disable_chunked_mm_input=True), 144)
    assert compute_encoder_budget(SchedulerConfig(max_num_batched_tokens=144, disable_chunked_mm_input=True),
                                  144) == (144, 144)
    with pytest.raises(ValueError):
        SchedulerConfig(encoder_cache_tokens=-1)
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_encoder_input_tokens=0)


def test_a_reset_drops_unused_outputs_now_and_outputs_in_use_once_unused():
    cache = EncoderCacheManager(16)
    a, b, c = req("a", ("x", 4)), req("b", ("y", 4)), req("c", ("y", 4))
    load(cache, a)
    load(cache, b)
    cache.free(a)  # x unused (kept), y in use by b
    assert cache.reset() == 1
    assert not cache.contains("x") and cache.contains("y") and cache.get_freed_hashes() == ["x"]
    assert load(cache, c) and cache.num_hits == 1  # admitted meanwhile: it shares b's output
    cache.check_integrity()
    cache.free(b)
    assert cache.contains("y")  # c still uses it
    cache.free(c)
    assert not cache.contains("y") and cache.get_freed_hashes() == ["y"]  # dropped, not kept for reuse
    assert cache.num_free_tokens == cache.num_reclaimable_tokens == 16 and cache.num_evictions == 0
    assert load(cache, req("d", ("y", 4))) and cache.num_hits == 1  # encoded again
    cache.free(req("d", ("y", 4)))
    assert cache.contains("y")  # a new output is kept again
    cache.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.sampled_from("vwxyz"), st.integers(1, 6),
                          st.sampled_from(["load", "free", "free_all", "reset"])), max_size=60), st.booleans())
def test_random_operations_keep_integrity(ops, keep_unused):
    cache = EncoderCacheManager(12, keep_unused)
    items: dict[str, list[tuple[str, int]]] = {}  # request id -> its items so far (a hash keeps its size)
    sizes: dict[str, int] = {}
    for rid, h, n, op in ops:
        entry = (h, sizes.setdefault(h, n))
        if op == "load":
            items.setdefault(rid, []).append(entry)
            load(cache, req(rid, *items[rid]), len(items[rid]) - 1)
        elif op == "free" and items.get(rid):
            cache.free_encoder_input(req(rid, *items[rid]), 0)
        elif op == "free_all" and rid in items:
            cache.free(req(rid, *items.pop(rid)))
        elif op == "reset":
            cache.reset()
            assert all(cache._users[x] for x in cache._tokens), "an unused output survived a reset"
        freed = cache.get_freed_hashes()
        assert not any(cache.contains(x) for x in freed)
        cache.check_integrity()
