"""Partial-block reuse without a model: after its full-block hits, a request copies the longest
reusable leading part of a computed block under the same parent (tokens equal, the items over them
equal, the salt equal), and only from a block whose step has run; the index drops a block when the
pool hands it out again; the copy is a new block to KV events and the verifier's shadows never take
one; off with prefix caching or its own switch."""

from __future__ import annotations

from mmserve.engine.block_hash import BlockHasher, block_extra_keys, reusable_prefix_length
from mmserve.engine.block_pool import KVBlock
from mmserve.engine.kv_events import KVEventLog
from mmserve.engine.partial_prefix import PartialPrefixIndex
from mmserve.engine.request import Request
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.sampling_params import SamplingParams
from helpers.scheduler_sim import BS, admit, IMG, fake_step, make_request, make_scheduler, run

PROMPT = list(range(100, 119))  # 19 tokens: 4 full blocks, 3 in the last


def scheduler(**kwargs):
    return make_scheduler(partial_blocks=True, **kwargs)


def test_a_new_question_copies_the_shared_part_of_the_block_after_the_hits():
    s = scheduler()
    first = make_request("first", PROMPT)
    s.add_request(first)
    so, _ = fake_step(s)
    source = so.new_requests[0].block_ids[2]  # tokens 8..11
    run(s)
    second = make_request("second", [*PROMPT[:10], 7, 8, 9, 10])  # shares 2 blocks and 2 tokens
    so = admit(s, second)
    own = so.new_requests[0].block_ids
    assert so.kv_copies == [(source, own[2])] and source != own[2]
    assert second.num_cached_tokens == 10 and so.num_scheduled_tokens == {"second": 4}
    assert second.cache_counts["partial_block"] == (2, 3) and second.cache_counts["prefix"] == (10, 14)
    block = s.kv_cache.pool.blocks[source]
    assert block.ref_cnt == 0 and block.block_hash == first.block_hashes[2]  # not taken, still cached


def test_the_last_block_wins_and_a_partial_stops_before_the_last_token():
    s = scheduler(last_blocks=True)
    run(s, make_request("first", PROMPT))
    again = make_request("again", PROMPT)
    so = admit(s, again)
    assert "partial_block" not in again.cache_counts and again.cache_counts["last_block"] == (1, 1)
    shorter = make_request("shorter", PROMPT[:18])  # its last block: 2 of the first's 3 tokens
    so = admit(s, shorter)
    assert shorter.num_cached_tokens == 17 and so.num_scheduled_tokens["shorter"] == 1 and len(so.kv_copies) == 1
    assert shorter.cache_counts["partial_block"] == (1, 1)


def test_a_prompts_last_block_is_a_source_before_it_is_full():
    s = scheduler(last_blocks=True)
    s.add_request(make_request("first", PROMPT, max_tokens=1))  # ends before its last block fills
    so, _ = fake_step(s)
    source = so.new_requests[0].block_ids[4]
    run(s)
    assert s.kv_cache.pool.blocks[source].block_hash is None
    other = make_request("other", [*PROMPT[:18], 5, 6])
    so = admit(s, other)
    assert other.num_cached_tokens == 18 and so.kv_copies == [(source, so.new_requests[0].block_ids[4])]


def test_only_blocks_whose_step_ran_are_copied():
    s = scheduler()
    s.add_request(make_request("first", PROMPT))
    s.add_request(make_request("same-step", [*PROMPT[:10], 1, 2, 3]))
    so, _ = fake_step(s)  # both admitted in one step: the first's blocks are not computed yet
    assert so.kv_copies == [] and s.requests["same-step"].num_cached_tokens == 8  # full blocks only
    later = make_request("later", [*PROMPT[:10], 4, 5, 6])
    assert admit(s, later).kv_copies and later.num_cached_tokens == 10


def test_an_item_that_differs_cuts_the_reused_part_at_its_offset():
    s = scheduler()
    run(s, make_request("first", [*range(100, 112), 50, 51], images=[("cat", 10, 2)]))
    dog = make_request("dog", [*range(100, 112), 60], images=[("dog", 10, 2)])  # same tokens up to 12
    admit(s, dog)
    assert dog.num_cached_tokens == 10 and dog.cache_counts["partial_block"] == (2, 3)
    cat = make_request("cat", [*range(100, 112), 60], images=[("cat", 10, 2)])
    admit(s, cat)
    assert cat.num_cached_tokens == 12  # the image too, and the token after it differs


def test_a_part_never_ends_inside_an_item_whose_encoder_output_is_gone():
    images = [("img", 9, 5)]  # placeholders [9, 14): the shorter prompt ends inside the image
    for cache_tokens, expected in ((0, 9), (None, 13)):  # encoder output gone / resident
        s = scheduler(encoder_cache_tokens=cache_tokens)
        run(s, make_request("first", range(100, 119), images))
        other = make_request("other", range(100, 114), images)
        admit(s, other)
        assert other.num_cached_tokens == expected, cache_tokens


def test_no_full_hit_no_part_and_salt_and_switches_keep_parts_apart():
    s = scheduler()
    run(s, make_request("first", PROMPT))
    short = make_request("short", [*PROMPT[:3], 5])  # shares 3 tokens of the first block: not looked up
    assert not admit(s, short).kv_copies and "partial_block" not in short.cache_counts
    salted = make_request("salted", [*PROMPT[:10], 7, 8, 9], salt="tenant")  # the salt is in the parents
    assert not admit(s, salted).kv_copies and salted.num_cached_tokens == 0
    for off in (make_scheduler(enable_caching=False, partial_blocks=True), make_scheduler()):
        run(off, make_request("first", PROMPT))
        other = make_request("other", [*PROMPT[:10], 7, 8, 9, 10])
        assert off.kv_cache.partial is None and not admit(off, other).kv_copies
        assert other.num_cached_tokens in (0, 8) and "partial_block" not in other.cache_counts


def test_handing_the_block_out_again_drops_it_from_the_index():
    s = scheduler(num_blocks=8)
    run(s, make_request("first", PROMPT))  # 5 blocks, freed tail first
    assert len(s.kv_cache.partial) == 4  # blocks 1 to 3, and the last once full (a first block never)
    run(s, make_request("filler", range(300, 328)))  # 8 blocks: every one of the first's reused
    assert len(s.kv_cache.partial) == 6  # the filler's full blocks only
    other = make_request("other", [*PROMPT[:10], 7, 8, 9])
    so = admit(s, other)
    assert so.kv_copies == [] and other.num_cached_tokens == 0


def test_preempted_after_a_copy_it_is_recomputed_and_copies_again():
    s = scheduler(num_blocks=9, max_tokens=64)
    run(s, make_request("first", PROMPT))
    long = make_request("long", range(500, 512), max_tokens=12)  # grows while the other runs
    other = make_request("other", [*PROMPT[:10], 7, 8, 9], max_tokens=8)
    s.add_request(long)
    fake_step(s)
    so = admit(s, other)
    assert so.kv_copies and other.num_cached_tokens == 10
    while s.num_unfinished_requests:
        fake_step(s)  # integrity checked every step
    assert s.num_preemptions > 0 and other.num_preemptions > 0
    assert other.num_output_tokens == 8
    assert other.cache_counts["partial_block"] == (2, 3) and other.num_cached_tokens == 10  # the first admission


def test_the_copy_is_announced_only_once_full():
    s = scheduler()
    log = KVEventLog(BS)
    s.kv_cache.attach_events(log)
    run(s, make_request("first", PROMPT))
    log.take()
    other = make_request("other", [*PROMPT[:10], 7], max_tokens=1)
    so = admit(s, other)
    assert so.kv_copies and log.take() == []  # 11 tokens: its copied block is not full
    longer = make_request("longer", [*PROMPT[:10], 7, 8], max_tokens=3)
    admit(s, longer)
    stored = log.take()
    assert [r[1] for r in stored] == [longer.block_hashes[2]]  # full with its own tokens: a new key


def test_a_shadow_takes_no_part():
    s = scheduler()
    run(s, make_request("first", PROMPT))
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    message = EngineCoreRequest("shadow", [*PROMPT[:10], 7, 8, 9], [], params, None, 0.0, bypass_caches=True)
    twin = Request.from_engine_core_request(message, BlockHasher(BS))
    so = admit(s, twin)
    assert so.kv_copies == [] and so.num_scheduled_tokens == {"shadow": 13}


# ---- the index and the rule on their own ---------------------------------------------------------


def keys_of(items, start, end, salt=None):
    return block_extra_keys(items, salt, start, end)


def test_the_rule_stops_at_the_first_token_or_item_that_differs():
    image = MultiModalItem("image", "a", None, PlaceholderRange(2, 3), position_key=(1, 2, 2))
    moved = MultiModalItem("image", "a", None, PlaceholderRange(3, 3), position_key=(1, 2, 2))
    other_grid = MultiModalItem("image", "a", None, PlaceholderRange(2, 3), position_key=(1, 1, 4))
    tokens = [1, 2, IMG, IMG, IMG, 3]
    mine = keys_of([image], 0, 6)
    assert reusable_prefix_length(tokens, mine, tokens, mine, 6) == 6
    assert reusable_prefix_length(tokens, mine, tokens, mine, 4) == 4
    assert reusable_prefix_length(tokens, mine, [1, 2, IMG, IMG, IMG, 4], mine, 6) == 5
    assert reusable_prefix_length(tokens, mine, tokens, keys_of([other_grid], 0, 6), 6) == 2
    assert reusable_prefix_length(tokens, mine, [1, 2, 9, IMG, IMG, IMG], keys_of([moved], 0, 6), 6) == 2
    assert reusable_prefix_length(tokens, mine, tokens[:2], keys_of([], 0, 2), 6) == 2  # the item starts after
    assert reusable_prefix_length(tokens, keys_of([image], 0, 6, "x"), tokens, mine, 6) == 0  # the salt
    tail = MultiModalItem("image", "a", None, PlaceholderRange(-1, 3))  # began in the block before
    assert reusable_prefix_length(tokens, keys_of([tail], 0, 6), tokens, mine, 6) == 0


def test_the_index_finds_the_longest_among_many_children_and_forgets_dropped_ones():
    index = PartialPrefixIndex()
    root = (b"parent", None)
    blocks = [KVBlock(i) for i in range(6)]
    for block in blocks:
        block.block_hash = bytes([block.block_id])
    rows = [[1, 2, 3, 4], [1, 2, 9, 9], [1, 5, 5, 5], [0, 0, 0, 0], [1, 2, 3, 7], [2, 2, 2, 2]]
    for block, row in zip(blocks, rows):
        index.add(block, root, row, ())
    index.check_integrity()
    assert index.find(root, [1, 2, 3, 5], ()) in ((blocks[0], 3), (blocks[4], 3))
    assert index.find(root, [1, 2, 9], ()) == (blocks[1], 3)
    assert index.find(root, [1, 6], ()) in ((blocks[i], 1) for i in (0, 1, 2, 4))
    assert index.find(root, [3], ()) == (None, 0) and index.find((b"other", None), [1], ()) is None
    index.drop(blocks[0])
    index.drop(blocks[4])
    assert index.find(root, [1, 2, 3, 5], ()) == (blocks[1], 2)
    index.add(blocks[3], root, [0, 0], ())  # filed already with more tokens: kept
    assert index.find(root, [0, 0, 0], ()) == (blocks[3], 3)
    index.check_integrity()
    assert len(index) == 4
