"""First-token caching without a model: once a plain greedy prompt has been computed, an identical
plain greedy prompt is admitted with its whole prompt computed (full-block hits and a copy of the
last block), the first prompt's token appended and nothing scheduled; it decodes on from there.
Anything that makes the token depend on more than the prompt, or needs the logits, computes it."""

from __future__ import annotations

import pytest

from mmserve.engine.policies import first_tokens
from mmserve.engine.policies.first_tokens import FirstTokenCache
from mmserve.sampling_params import StructuredOutputsParams
from helpers.scheduler_sim import fake_step, make_request, make_scheduler, run

PROMPT = range(100, 119)  # 19 tokens: 4 full blocks of 4, 3 tokens in the last


def scheduler(**kwargs):
    return make_scheduler(last_blocks=True, first_tokens=True, **kwargs)


def greedy(rid, tokens=PROMPT, **params):
    return make_request(rid, tokens, temperature=0.0, **params)


def test_a_repeat_takes_the_first_token_and_computes_nothing():
    s = scheduler()
    s.add_request(greedy("first"))
    so, out = fake_step(s, token=42)
    last_block = so.new_requests[0].block_ids[4]
    run(s)
    again = greedy("again", max_tokens=3)
    s.add_request(again)
    so, out = fake_step(s, token=7)
    new = so.new_requests[0]
    assert so.num_scheduled_tokens == {} and so.kv_copies == [(last_block, new.block_ids[4])]
    assert new.token_ids == [*PROMPT, 42] and new.num_computed_tokens == 19 and new.num_prompt_tokens == 19
    assert [(o.request_id, o.new_token_ids, o.num_cached_tokens) for o in out.outputs] == [("again", [42], 19)]
    assert again.num_cached_tokens == 19 and s.first_tokens.stats().hits == 1 == s.first_tokens.stats().queries
    so, out = fake_step(s, token=7)  # decodes on: the appended token is the input at position 19
    assert so.num_scheduled_tokens == {"again": 1} and so.cached_requests[0].num_computed_tokens == 19
    assert out.outputs[0].new_token_ids == [7]


def test_max_tokens_one_finishes_in_the_step_that_admits_it():
    s = scheduler()
    run(s, greedy("first"))
    s.add_request(greedy("again", max_tokens=1))
    _, out = fake_step(s)
    assert out.outputs[0].finish_reason == "length" and s.num_unfinished_requests == 0
    s.add_request(greedy("next", range(200, 205)))
    so, _ = fake_step(s)
    assert so.finished_request_ids == ["again"]  # the runner drops the state it was given


@pytest.mark.parametrize("params", [
    {"temperature": 1.0}, {"temperature": 0.0, "logit_bias": {5: 1.0}}, {"temperature": 0.0, "min_tokens": 2},
    {"temperature": 0.0, "repetition_penalty": 1.2}, {"temperature": 0.0, "logprobs": 2},
    {"temperature": 0.0, "structured_outputs": StructuredOutputsParams(json_object=True)},
])
def test_a_request_whose_token_needs_its_logits_computes_it(params):
    s = scheduler()
    run(s, greedy("first"))
    again = make_request("again", PROMPT, **params)
    s.add_request(again)
    so, _ = fake_step(s)
    assert so.num_scheduled_tokens == {"again": 1} and s.first_tokens.num_hits == 0


def test_only_a_plain_greedy_prompt_leaves_its_token():
    s = scheduler()
    run(s, make_request("sampled", PROMPT, temperature=1.0), greedy("biased", logit_bias={5: 1.0}))
    assert len(s.first_tokens) == 0
    run(s, greedy("plain"))
    assert len(s.first_tokens) == 1


def test_another_prompt_salt_or_switch_computes_its_token():
    s = scheduler()
    run(s, greedy("first"))
    for other in (greedy("last", [*range(100, 118), 5]), greedy("salted", salt="tenant")):
        s.add_request(other)
        so, _ = fake_step(s)
        assert other.request_id in so.num_scheduled_tokens
        run(s)
    for off in (make_scheduler(last_blocks=True), make_scheduler(first_tokens=True)):  # each switch alone
        run(off, greedy("first"))
        off.add_request(greedy("again"))
        so, _ = fake_step(off)
        assert so.num_scheduled_tokens == {"again": 1 if off.kv_cache.cache_last_blocks else 3}


def test_answered_requests_take_no_budget_but_a_seat():
    s = scheduler(max_tokens=8)
    run(s, greedy("first"))
    for i in range(10):
        s.add_request(greedy(f"r{i}", max_tokens=5))
    so, out = fake_step(s)
    assert so.num_scheduled_tokens == {} and len(out.outputs) == 8  # max_num_seqs 8; no token computed
    assert len(s.running) == 8 and len(s.waiting) == 2


def test_the_cache_keeps_the_most_recently_used_entries():
    cache = FirstTokenCache(2)
    reqs = [greedy(f"r{i}", range(10 * i, 10 * i + 7)) for i in range(3)]
    for i, req in enumerate(reqs[:2]):
        cache.put(req, i)
    assert cache.get(greedy("again0", range(0, 7))) == 0  # refreshed: r1 is now the oldest
    cache.put(reqs[2], 2)
    assert cache.get(greedy("again1", range(10, 17))) is None and cache.get(greedy("x", range(20, 27))) == 2
    stats = cache.stats()
    assert (stats.queries, stats.hits, stats.evictions, stats.entries) == (3, 2, 1, 2)
    cache.check_integrity()
    with pytest.raises(ValueError):
        FirstTokenCache(0)


def test_an_embeddings_hidden_state_is_kept_beside_its_token_within_its_budget(monkeypatch):
    """An embedding request takes an entry only with the hidden state an embedding left; a plain
    token does not answer it, and a later token put keeps the state. States past HIDDEN_BYTES go
    oldest first, their tokens staying; clear drops both."""
    monkeypatch.setattr(first_tokens, "HIDDEN_BYTES", 10)
    cache = FirstTokenCache(8)
    prompts = [range(10 * i, 10 * i + 7) for i in range(3)]

    def embedding(rid, tokens):
        req = greedy(rid, tokens)
        req.return_hidden = True
        return req

    cache.put(greedy("plain", prompts[0]), 5)
    assert cache.get(embedding("e0", prompts[0])) is None and cache.get(greedy("g0", prompts[0])) == 5
    cache.put(embedding("e1", prompts[1]), 6, b"abcd")
    cache.put(greedy("g1", prompts[1]), 6)  # a plain put of the same prompt keeps the state
    assert cache.get(embedding("e1b", prompts[1])) == 6 and cache.hidden(greedy("x", prompts[1])) == b"abcd"
    cache.put(embedding("e2", prompts[2]), 7, b"efghij")  # 10 bytes: both fit
    cache.put(embedding("e0b", prompts[0]), 5, b"klm")  # 13: the oldest state goes, its token stays
    assert cache.hidden(greedy("y", prompts[1])) is None and cache.get(greedy("g1b", prompts[1])) == 6
    assert cache.get(embedding("e1c", prompts[1])) is None and cache.get(embedding("e2b", prompts[2])) == 7
    cache.check_integrity()
    assert cache.clear() == 3 and cache.hidden(greedy("z", prompts[2])) is None
    cache.check_integrity()
