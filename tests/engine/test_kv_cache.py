from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.engine.kv_cache import BlockPool, KVCacheManager


def test_allocate_grows_by_whole_blocks_and_free_returns_all():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    assert kv.allocate_slots("a", 1) == [0]
    assert kv.allocate_slots("a", 16) == []  # still fits in block 0
    assert kv.allocate_slots("a", 17) == [1]
    assert kv.get_block_ids("a") == [0, 1]
    kv.check_integrity()
    kv.free("a")
    assert kv.num_free_blocks == 4
    kv.check_integrity()


def test_allocate_fails_without_change_when_short():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    kv.allocate_slots("a", 5)
    assert kv.allocate_slots("b", 1) is None
    assert kv.get_block_ids("b") == []
    assert not kv.can_allocate("a", 9)
    kv.check_integrity()


def test_freed_blocks_are_reused_tail_first_in_lru_order():
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.free(a[::-1])  # the manager frees a request's tail first
    assert [b.block_id for b in pool.allocate(3)] == [2, 1, 0]


def test_integrity_catches_a_leak():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    kv.allocate_slots("a", 4)
    kv.req_to_blocks.pop("a")  # a block owned by nobody but not free
    try:
        kv.check_integrity()
    except AssertionError:
        return
    raise AssertionError("check_integrity missed a leaked block")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcde"), st.integers(0, 40), st.booleans()), max_size=40))
def test_random_allocate_free_keeps_integrity(ops):
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sizes: dict[str, int] = {}
    for rid, grow, free in ops:
        if free:
            kv.free(rid)
            sizes.pop(rid, None)
        else:
            want = sizes.get(rid, 0) + grow
            if kv.allocate_slots(rid, want) is not None:
                sizes[rid] = want
        kv.check_integrity()
        for r, n in sizes.items():
            assert len(kv.get_block_ids(r)) == kv.blocks_needed(n)
    for r in list(sizes):
        kv.free(r)
    assert kv.num_free_blocks == 8
