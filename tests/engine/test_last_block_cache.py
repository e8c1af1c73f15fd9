"""Last-block caching without a model: a prompt's last block (full or partial) is registered once
the step that computed it has run (the same-step case is in test_prefix_cache.py); an identical
prompt whose full-block hits reach it asks the runner to copy it and computes one token; the
registration goes with the block's reuse, and a last token inside an image whose encoder output is
gone is not skipped."""

from __future__ import annotations

from mmserve.engine.block_hash import BlockHasher
from mmserve.engine.block_pool import BlockPool
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from helpers.scheduler_sim import BS, admit, fake_step, make_request, make_scheduler, run



def scheduler(**kwargs):
    return make_scheduler(last_blocks=True, **kwargs)


def test_a_repeat_copies_the_first_prompts_last_block_and_computes_one_token():
    s = scheduler()
    first = make_request("first", range(100, 119))  # 19 tokens: 4 full blocks, 3 in the last
    s.add_request(first)
    so, _ = fake_step(s)
    last_block = so.new_requests[0].block_ids[4]
    run(s)
    again = make_request("again", range(100, 119))
    so = admit(s, again)
    assert again.num_cached_tokens == 18 and so.num_scheduled_tokens == {"again": 1}
    own = so.new_requests[0].block_ids
    assert own[:4] == so.new_requests[0].block_ids[:4] and so.kv_copies == [(last_block, own[4])]
    assert so.new_requests[0].num_computed_tokens == 18
    assert (s.admission.prefix_queries, s.admission.prefix_hits) == (38, 18)


def test_a_full_last_block_is_copied_too():
    s = scheduler()
    run(s, make_request("first", range(100, 116)))  # 16 tokens: the last block full
    again = make_request("again", range(100, 116))
    so = admit(s, again)
    assert again.num_cached_tokens == 15 and len(so.kv_copies) == 1


def test_the_source_may_still_be_running_and_keeps_its_one_owner():
    s = scheduler()
    first = make_request("first", range(100, 110), max_tokens=20)
    s.add_request(first)
    fake_step(s)  # the prompt: its last block (2 tokens) registered after this step
    again = make_request("again", range(100, 110))
    so = admit(s, again)  # the first decodes into the same block meanwhile
    src, dst = so.kv_copies[0]
    assert again.num_cached_tokens == 9 and src == s.kv_cache.get_block_ids("first")[2] != dst
    assert s.kv_cache.pool.blocks[src].ref_cnt == 1


def test_a_last_block_of_one_token_is_not_registered_and_a_different_last_token_misses():
    s = scheduler()
    run(s, make_request("one", range(100, 117)))  # 17 tokens: 1 in the last block
    assert s.kv_cache.pool.last_blocks == {}
    run(s, make_request("first", range(100, 119)))
    other = make_request("other", [*range(100, 118), 5])  # the same but its last token
    so = admit(s, other)
    assert other.num_cached_tokens == 16 and so.kv_copies == []


def test_reusing_the_block_drops_its_registration():
    s = scheduler(num_blocks=8)
    run(s, make_request("first", range(100, 119)))  # 5 blocks, freed tail first
    run(s, make_request("filler", range(300, 328)))  # 8 blocks: takes the first's last block
    again = make_request("again", range(100, 119))
    assert s.kv_cache.find_last_block(again.last_block_hash(19)) is None
    so = admit(s, again)
    assert again.num_cached_tokens < 18 and so.kv_copies == []


def test_a_last_token_inside_an_image_is_computed_only_from_its_encoder_output():
    images = [("img", 10, 9)]  # placeholders [10, 19): the prompt ends inside the image
    for cache_tokens, expected in ((0, 8), (None, 18)):  # encoder output gone / resident
        s = scheduler(encoder_cache_tokens=cache_tokens)
        run(s, make_request("first", range(100, 119), images))
        again = make_request("again", range(100, 119), images)
        admit(s, again)
        assert again.num_cached_tokens == expected, cache_tokens


def test_salt_and_switches_keep_last_blocks_apart():
    s = scheduler()
    run(s, make_request("first", range(100, 119)))
    salted = make_request("salted", range(100, 119), salt="tenant")
    assert not admit(s, salted).kv_copies and salted.num_cached_tokens == 0
    for off in (make_scheduler(), make_scheduler(enable_caching=False, last_blocks=True)):
        run(off, make_request("first", range(100, 119)))
        assert off.kv_cache.pool.last_blocks == {} and not admit(off, make_request("b", range(100, 119))).kv_copies


def test_a_last_block_key_of_a_whole_block_is_that_blocks_hash():
    hasher = BlockHasher(BS)
    items = [MultiModalItem("image", "h", None, PlaceholderRange(2, 5))]
    tokens = list(range(100, 112))
    full = hasher.new_block_hashes(tokens, items, "salt", [])
    assert hasher.last_block_hash(tokens, 8, items, "salt", full) == full[1]
    assert hasher.last_block_hash(tokens, 7, items, "salt", full) not in full
    assert hasher.last_block_hash(tokens, 7, items, "salt", full[:0]) is None  # its parent unknown
    assert hasher.last_block_hash(tokens, 7, [], "salt", full) != hasher.last_block_hash(tokens, 7, items, "salt", full)


def test_the_pool_keeps_last_block_keys_with_their_blocks():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_last_block(a, b"k")
    pool.cache_last_block(b, b"k")  # two requests with the same prompt
    pool.cache_block(a, b"full")
    pool.check_integrity()
    pool.free([a, b])
    assert pool.get_last_block(b"k") in (a, b)
    pool.allocate(2)  # the free one, then a (the head of the queue after it)
    assert pool.get_last_block(b"k") is b and pool.get_cached_block(b"full") is None
    pool.check_integrity()
    kv = KVCacheManager(4, BS, enable_caching=True, cache_last_blocks=False)
    kv.allocate_slots("r", 6)
    kv.cache_last_block("r", 6, b"k")
    assert kv.pool.last_blocks == {} and kv.find_last_block(b"k") is None
