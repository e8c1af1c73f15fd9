"""Shadow requests (the cache verifier's re-runs) in the scheduler, with no model: they read and
write no cache, run last and one at a time, are preempted first; and every request reports what
each cache layer did for its prompt in its first output (the offline engine's last, with a model)."""

from __future__ import annotations

from mmserve.engine.block_hash import BlockHasher
from mmserve.engine.request import Request
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.sampling_params import SamplingParams
from helpers.mm_prompts import one
from helpers.scheduler_sim import BS, IMG, fake_step, make_request, make_scheduler, run

PROMPT = list(range(100, 100 + 4 * BS + 2))  # four full blocks and two tokens


def shadow(rid: str, tokens: list[int], images=(), max_tokens: int = 3) -> Request:
    """A shadow request as P1 makes it from a message with `bypass_caches`."""
    tokens = list(tokens)
    items = []
    for h, off, length in images:
        tokens[off:off + length] = [IMG] * length
        items.append(MultiModalItem("image", h, None, PlaceholderRange(off, length)))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    message = EngineCoreRequest(rid, tokens, items, params, None, 0.0, bypass_caches=True)
    return Request.from_engine_core_request(message, BlockHasher(BS))


def test_a_shadow_reads_and_writes_no_cache():
    s = make_scheduler(last_blocks=True, first_tokens=True)
    run(s, make_request("a", PROMPT, images=[("img", 2, 6)], temperature=0))
    cached_blocks, first_tokens = s.kv_cache.pool.num_cached_blocks, len(s.first_tokens)
    twin = shadow("a-shadow", PROMPT, images=[("img", 2, 6)])
    assert twin.block_hashes == [] and twin.mm_items[0].mm_hash.startswith("shadow/")
    s.add_request(twin)
    so, outs = fake_step(s)
    assert so.num_scheduled_tokens == {"a-shadow": len(PROMPT)} and not so.kv_copies  # no hit: all of it
    assert so.scheduled_encoder_inputs == {"a-shadow": [0]}  # encoded again, under its private hash
    assert so.new_requests[0].return_first_logits
    assert outs.outputs[0].cache_counts == {"encoder": (0, 1)}  # no prefix, last-block or first-token lookup
    while s.has_request("a-shadow"):
        fake_step(s)
    fake_step(s)
    assert s.kv_cache.pool.num_cached_blocks == cached_blocks and len(s.first_tokens) == first_tokens
    assert not s.encoder_cache.contains(twin.mm_items[0].mm_hash)  # dropped once unused, never kept
    assert s.encoder_cache.contains("img")


def test_a_shadow_waits_until_no_request_waits_and_runs_one_at_a_time():
    s = make_scheduler(max_tokens=8)
    s.add_request(shadow("s1", PROMPT))
    s.add_request(shadow("s2", PROMPT))
    s.add_request(make_request("user", PROMPT))
    so, _ = fake_step(s)
    assert list(so.num_scheduled_tokens) == ["user"]  # it took the whole budget; the shadows wait
    while s.requests["user"].num_output_tokens == 0:
        so, _ = fake_step(s)
    so, _ = fake_step(s)
    assert list(so.num_scheduled_tokens) == ["user", "s1"]  # a decode, then the shadow in the rest
    assert so.num_scheduled_tokens["s1"] == 7
    so, _ = fake_step(s)
    assert "s2" not in so.num_scheduled_tokens  # one shadow at a time
    s.add_request(make_request("late", range(500, 505)))
    so, _ = fake_step(s)
    assert list(so.num_scheduled_tokens) == ["late", "s1"]  # a user's request goes before the running shadow
    assert so.num_scheduled_tokens["late"] == 5



def test_two_waiting_shadows_run_one_at_a_time_even_when_the_budget_holds_both():
    s = make_scheduler(max_tokens=64)
    s.add_request(shadow("s1", PROMPT[:8]))
    s.add_request(shadow("s2", PROMPT[:8]))
    so, _ = fake_step(s)
    assert list(so.num_scheduled_tokens) == ["s1"] and [r.request_id for r in s.shadows] == ["s2"]
    run(s)
    assert s.num_unfinished_requests == 0

def test_a_shadow_is_preempted_first_and_waits_again_behind_users():
    s = make_scheduler(num_blocks=8, max_tokens=64)
    s.add_request(make_request("user", PROMPT[:8], max_tokens=20))
    fake_step(s)
    s.add_request(shadow("s", PROMPT[:8], max_tokens=20))
    fake_step(s)
    assert {r.request_id for r in s.running} == {"user", "s"}
    while s.has_request("user") and not s.shadows:
        fake_step(s)
    assert [r.request_id for r in s.shadows] == ["s"]  # the shadow gave its blocks back, not the user
    assert s.requests["user"].num_preemptions == 0


def test_a_waiting_request_takes_the_blocks_of_a_running_shadow():
    s = make_scheduler(num_blocks=6, max_tokens=64)
    s.add_request(shadow("s", PROMPT, max_tokens=2))  # 18 tokens: 5 of the 6 blocks
    fake_step(s)
    s.add_request(make_request("user", PROMPT[:8]))  # needs 2 blocks now
    so, _ = fake_step(s)
    assert list(so.num_scheduled_tokens) == ["user"] and [r.request_id for r in s.shadows] == ["s"]
    run(s)
    assert not s.has_request("s") and s.num_unfinished_requests == 0  # it ran again once there was room


def test_the_first_output_reports_each_layer_for_its_request():
    s = make_scheduler(last_blocks=True, first_tokens=True)
    run(s, make_request("a", PROMPT, temperature=0))
    n = len(PROMPT)
    s.add_request(make_request("b", PROMPT, temperature=0))
    _, outs = fake_step(s)
    assert outs.outputs[0].cache_counts == {"prefix": (n, n), "last_block": (1, 1), "first_token": (1, 1)}
    s.add_request(make_request("c", PROMPT[:-1] + [5]))  # the same full blocks, another last token
    _, outs = fake_step(s)
    assert counts(outs, "c") == {"prefix": (4 * BS, n), "last_block": (0, 1)}
    _, outs = fake_step(s)
    assert counts(outs, "c") is None  # on the first output only


def counts(outs, rid: str):
    return next(out.cache_counts for out in outs.outputs if out.request_id == rid)


def test_the_offline_engine_reports_its_layers_too(llm):
    params = SamplingParams(temperature=0, max_tokens=2)
    cold, warm = (llm.generate([one(5)], params)[0] for _ in range(2))
    n = len(cold.prompt_token_ids)
    assert cold.cache_report.counts == {"processor": (0, 1), "encoder": (0, 1), "prefix": (0, n)}
    assert warm.cache_report.counts == {"processor": (1, 1), "prefix": (n, n), "last_block": (1, 1),
                                        "first_token": (1, 1)}
    assert warm.cache_report.header_value() == f"processor=1/1 prefix={n}/{n} last_block=1/1 first_token=1/1"
