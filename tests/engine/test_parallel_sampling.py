"""Offline n > 1: the copies share the prompt's KV blocks (reported as cached tokens) and its
image's encoder output (the encoder runs once), each samples on its own, and a seeded copy i is
exactly the single request with seed + i; stop strings and aborts end one copy or all of them."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from helpers.tiny_models import make_image

LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 4)
BS = 4


def image_prompt() -> dict:
    return {"prompt": f"USER: <image>\n{LONG} ASSISTANT:", "multi_modal_data": {"image": make_image(4, (40, 40))}}


def encoder_runs(llm: LLM) -> int:
    return llm.engine.core.executor.runner.num_encoded_items


def check_clean(llm: LLM) -> None:
    core = llm.engine.core
    core.check_integrity()
    assert core.kv_cache.num_free_blocks == core.kv_cache.pool.num_blocks
    assert not core.scheduler.groups.live and not core.scheduler.requests


@pytest.mark.parametrize("budget", [2048, 7])  # the whole prompt in one step, or chunked across the image
def test_copies_share_the_prompt_and_the_encoder_runs_once(path, budget):
    llm = LLM(model=path, block_size=BS, max_num_batched_tokens=budget)
    out = llm.generate(image_prompt(), SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6))[0]
    n_prompt = len(out.prompt_token_ids)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    assert encoder_runs(llm) == 1
    assert out.outputs[0].num_cached_tokens == 0 == out.num_cached_tokens
    for c in out.outputs[1:]:  # every full block of the prompt came from the cache
        assert c.num_cached_tokens == (n_prompt - 1) // BS * BS > 0
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "copies sample on their own"
    prefix = llm.engine.core.stats().caches["prefix"]
    assert prefix.hits == 3 * ((n_prompt - 1) // BS * BS)
    check_clean(llm)


def test_seeded_copy_i_equals_the_single_request_with_seed_plus_i(path):
    llm = LLM(model=path, block_size=BS)
    many = llm.generate(image_prompt(), SamplingParams(n=3, temperature=0.9, seed=100, max_tokens=8))[0]
    again = llm.generate(image_prompt(), SamplingParams(n=3, temperature=0.9, seed=100, max_tokens=8))[0]
    singles = llm.generate([image_prompt()] * 3, [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=8)
                                                  for i in range(3)])
    assert [c.token_ids for c in many.outputs] == [c.token_ids for c in again.outputs]
    assert [c.token_ids for c in many.outputs] == [s.outputs[0].token_ids for s in singles]
    check_clean(llm)


def test_copies_batch_with_other_requests_and_keep_their_own_options(path):
    llm = LLM(model=path, block_size=BS)
    plain = {"prompt": "USER: hello ASSISTANT:"}
    alone = llm.generate(plain, SamplingParams(temperature=0.0, max_tokens=5))[0]
    outs = llm.generate([image_prompt(), plain], [SamplingParams(n=2, temperature=0.0, max_tokens=5, logprobs=2),
                                                  SamplingParams(temperature=0.0, max_tokens=5)])
    greedy = outs[0].outputs
    assert greedy[0].token_ids == greedy[1].token_ids and len(greedy[1].logprobs) == 5
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    check_clean(llm)


def test_a_stop_string_ends_one_copy_and_the_request_ends_with_the_last(path):
    llm = LLM(model=path, block_size=BS)
    probe = llm.generate(image_prompt(), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8))[0]
    stop = probe.outputs[1].text[2:5]
    assert stop and stop not in probe.outputs[0].text[:2]
    out = llm.generate(image_prompt(), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, stop=[stop]))[0]
    ended = out.outputs[1]
    assert ended.finish_reason == "stop" and ended.stop_reason == stop and ended.text == probe.outputs[1].text[:2]
    check_clean(llm)


def test_n_zero_or_too_many_is_refused():
    for bad in (0, -1, 129):
        with pytest.raises(ValueError, match="n must be"):
            SamplingParams(n=bad)


def test_only_the_last_copy_to_finish_says_no_sibling_runs(llm):
    """P1 lets go of a request's items (shm leases) on the finished output with
    `siblings_running` false: it must come once, after every other copy has finished."""
    engine = llm.engine
    engine.add_request("r", image_prompt(), SamplingParams(n=3, temperature=1.0, seed=2, min_tokens=1,
                                                           max_tokens=3))
    engine.add_request("s", image_prompt(), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5))
    finished: dict[str, list[tuple[int, bool]]] = {"r": [], "s": []}
    while engine.core.has_unfinished_requests():
        for out in engine.core.step().outputs:
            if out.finish_reason is not None:
                finished[out.request_id].append((out.index, out.siblings_running))
    engine.output_processor.abort_requests(["r", "s"])
    for rid, n in (("r", 3), ("s", 2)):
        assert sorted(i for i, _ in finished[rid]) == list(range(n))
        assert [running for _, running in finished[rid]] == [True] * (n - 1) + [False]
    check_clean(llm)


def test_aborting_the_request_ends_every_copy_held_or_running(path):
    llm = LLM(model=path, block_size=BS, max_num_batched_tokens=7)  # the prompt takes several steps
    engine = llm.engine
    for rid in ("early", "late"):
        engine.add_request(rid, image_prompt(), SamplingParams(n=3, temperature=1.0, max_tokens=20))
    engine.step()  # "early" is mid-prompt: its copies are still held
    assert engine.core.scheduler.groups.held
    engine.abort_requests(["early"])
    while not any(o.outputs[0].token_ids for o in engine.step() if o.request_id == "late"):
        pass  # "late"'s copies now run
    assert len([r for r in engine.core.scheduler.requests if r.startswith("late")]) == 3
    engine.abort_requests(["late"])
    engine.core.step()
    assert not engine.has_unfinished_requests()
    check_clean(llm)
