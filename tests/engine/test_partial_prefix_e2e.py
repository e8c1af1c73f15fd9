"""Partial-block reuse with a tiny Qwen3-VL: the same image, then another question whose common
prefix with the first ends inside a block. The second request copies the shared tokens of that
block (the report shows them) and answers exactly as a fresh engine and transformers — greedy
tokens equal, log probabilities equal to float rounding — in one step or in prefill chunks; with
the copy skipped the answer changes (so these tests see a missing copy); preempted after a copy, a
request is recomputed exactly; two tensor-parallel ranks each copy their own shards."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.outputs import RequestOutput
from helpers.hf_reference import hf_qwen_greedy
from helpers.tiny_models import make_image, make_qwen_checkpoint

BS = 16  # the default block size: a partial block holds up to 15 shared tokens
MAX_NEW = 6
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QUESTIONS = ("What is in this picture, in a few words?", "What is the main colour of it?")
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
SMALL = dict(num_kv_blocks=128)


def prompt(question: str, seed: int = 3) -> dict:
    text = f"<|im_start|>user\n{IMAGE}{question}<|im_end|>\n<|im_start|>assistant\n"
    return {"prompt": text, "multi_modal_data": {"image": make_image(seed, (64, 64))}}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The checkpoint, transformers' tokens for question B, and a fresh engine's answer to it."""
    path = make_qwen_checkpoint(tmp_path_factory.mktemp("partial"), family="qwen3_vl")
    refs, _ = hf_qwen_greedy(path, [prompt(QUESTIONS[1])], MAX_NEW)
    fresh = LLM(model=path, enable_prefix_caching=False, **SMALL).generate([prompt(QUESTIONS[1])], PARAMS)[0]
    return path, refs[0], fresh


def logprobs(out: RequestOutput) -> list[float]:
    completion = out.outputs[0]
    assert completion.logprobs is not None
    return [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]


def a_then_b(llm: LLM) -> tuple[RequestOutput, RequestOutput]:
    first = llm.generate([prompt(QUESTIONS[0])], PARAMS)[0]
    second = llm.generate([prompt(QUESTIONS[1])], PARAMS)[0]
    llm.engine.core.check_integrity()
    return first, second


def common_prefix(a: RequestOutput, b: RequestOutput) -> int:
    return next(i for i, (x, y) in enumerate(zip(a.prompt_token_ids, b.prompt_token_ids)) if x != y)


@pytest.mark.parametrize("chunk", [None, 8])
def test_a_new_question_copies_the_shared_tokens_and_answers_as_fresh(case, chunk):
    path, ref, fresh = case
    llm = LLM(model=path, **SMALL) if chunk is None else LLM(model=path, max_num_batched_tokens=chunk, **SMALL)
    first, second = a_then_b(llm)
    common = common_prefix(first, second)
    assert common % BS, "the common prefix must end inside a block for this test to mean anything"
    assert second.num_cached_tokens == common  # to the token
    assert second.cache_report is not None
    assert second.cache_report.counts["partial_block"][0] == common % BS > 0
    assert second.outputs[0].token_ids == fresh.outputs[0].token_ids == ref
    assert logprobs(second) == pytest.approx(logprobs(fresh), abs=1e-4)
    off = LLM(model=path, enable_partial_block_caching=False, **SMALL)
    assert a_then_b(off)[1].num_cached_tokens == common // BS * BS  # the switch: full blocks only


def test_without_the_copy_the_answer_changes(case):
    """Guards the test above: the runner skips the copy, the scheduler still counts the tokens as
    computed — and the second answer is not the fresh one."""
    path, _, fresh = case
    llm = LLM(model=path, **SMALL)
    llm.engine.core.executor.runner._copy_blocks = lambda copies: None
    _, second = a_then_b(llm)
    assert second.cache_report is not None and second.cache_report.counts["partial_block"][0] > 0
    assert logprobs(second) != pytest.approx(logprobs(fresh), abs=1e-3)


def test_preempted_after_a_copy_it_is_recomputed_exactly(case):
    """Three new questions about three cached images decode together in too few blocks: they
    copy their partial blocks, preempt one another, are recomputed, and answer as fresh."""
    path = case[0]
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = LLM(model=path, num_kv_blocks=14)
    llm.generate([prompt(QUESTIONS[0], seed) for seed in (4, 5, 6)], PARAMS)
    outs = llm.generate([prompt(QUESTIONS[1], seed) for seed in (4, 5, 6)], long)
    llm.engine.core.check_integrity()
    assert llm.engine.core.scheduler.num_preemptions > 0, "the test meant to force preemption"
    assert any(o.cache_report is not None and o.cache_report.counts.get("partial_block", (0, 0))[0] > 0
               for o in outs)
    fresh = LLM(model=path, enable_prefix_caching=False, **SMALL)
    expected = fresh.generate([prompt(QUESTIONS[1], seed) for seed in (4, 5, 6)], long)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


@pytest.mark.slow  # spawns two worker processes
def test_two_tensor_parallel_ranks_each_copy_their_shards(case):
    path, ref, fresh = case
    llm = LLM(model=path, tensor_parallel_size=2, **SMALL)
    try:
        _, second = a_then_b(llm)
        assert second.cache_report is not None and second.cache_report.counts["partial_block"][0] > 0
        assert second.outputs[0].token_ids == ref
        assert logprobs(second) == pytest.approx(logprobs(fresh), abs=1e-4)
    finally:
        llm.engine.core.shutdown()
