"""The admission planner without a model: what a waiting request is admitted with, decided before
anything changes — a plan that does not fit leaves the KV cache, the encoder cache and the
request as they were; the prefix lookup is counted at a request's first admission only."""

from __future__ import annotations

from helpers.scheduler_sim import BS, make_request, make_scheduler, run

PROMPT = range(100, 119)  # 19 tokens: 4 full blocks of 4, 3 in the last


def kv_state(s):
    pool = s.kv_cache.pool
    return pool.num_free_blocks, pool.num_cached_blocks, dict(s.kv_cache.req_to_blocks)


def test_a_computed_admission_takes_the_hit_then_a_chunk_within_the_budget():
    s = make_scheduler()
    run(s, make_request("first", PROMPT))
    again = make_request("again", [*PROMPT[:16], 1, 2, 3, 4, 5, 6])
    plan = s.admission.plan(again, s.users, budget=4)
    assert plan is not None and plan.token is None
    assert plan.hit.num_tokens == 16 and len(plan.hit.blocks) == 16 // BS
    assert plan.plan is not None and plan.plan.num_tokens == 4  # the budget, not the 6 tokens left
    assert plan.num_computed(again) == 16


def test_a_plan_that_does_not_fit_changes_nothing():
    s = make_scheduler(num_blocks=6, encoder_cache_tokens=64)
    run(s, make_request("first", PROMPT, images=[("img", 2, 8)]))
    before = kv_state(s), s.encoder_cache.held_items("big"), s.encoder_cache.num_hits
    # 59 tokens (15 blocks), the resident image again after the hit: planning it would take a reference
    big = make_request("big", [*PROMPT, *range(300, 340)], images=[("img", 2, 8), ("img", 24, 8)])
    assert s.admission.plan(big, s.users, budget=64) is None
    assert (kv_state(s), s.encoder_cache.held_items("big"), s.encoder_cache.num_hits) == before
    assert big.num_cached_tokens is None and big.cache_counts == {}
    s.check_integrity()


def test_a_repeat_with_a_cached_first_token_is_answered_with_its_whole_prompt():
    s = make_scheduler(last_blocks=True, first_tokens=True)
    run(s, make_request("first", PROMPT, temperature=0.0))
    again = make_request("again", PROMPT, temperature=0.0)
    plan = s.admission.plan(again, s.users, budget=64)
    assert plan is not None and plan.token == 7 and plan.plan is None and plan.hit.last_block
    assert plan.num_computed(again) == len(PROMPT)


def test_the_prefix_lookup_is_counted_at_the_first_admission_only():
    s = make_scheduler()
    run(s, make_request("first", PROMPT))
    req = make_request("again", PROMPT)
    s.admission.record(req, 16, s.users)
    s.admission.record(req, 0, s.users)  # readmitted after a preemption: not looked up again
    assert (s.admission.prefix_queries, s.admission.prefix_hits) == (19 + 19, 0 + 16)
    assert req.num_cached_tokens == 16 and req.cache_counts["prefix"] == (16, 19)


def test_a_shadow_reads_no_cache_and_is_not_counted():
    s = make_scheduler()
    run(s, make_request("first", PROMPT))
    shadow = make_request("shadow", PROMPT)
    plan = s.admission.plan(shadow, s.shadow_lane, budget=64)
    assert plan is not None and plan.hit.num_tokens == 0 and plan.plan is not None
    s.admission.record(shadow, 0, s.shadow_lane)
    assert (s.admission.prefix_queries, s.admission.prefix_hits) == (19, 0)
