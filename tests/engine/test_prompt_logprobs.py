"""Offline `SamplingParams(prompt_logprobs=K)`: each prompt token's log probability, rank and top K
equal the log-softmax of transformers' logits on the same weights, with images, chunked prefill
(chunks cut inside the image), batching and --async-scheduling; such a request computes its whole
prompt (no prefix-cache read) and answers the same warm or cold; completion 0 alone carries them;
a chunk computed again after a preemption adds none twice."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from helpers.hf_logits import hf_prompt_logits
from helpers.tiny_models import make_image

K = 3


def items() -> list[dict]:
    return [{"prompt": "USER: hello there, how are you today? ASSISTANT:"},
            {"prompt": "USER: <image>\nWhat is this? ASSISTANT:",
             "multi_modal_data": {"image": make_image(0, (40, 40))}}]


def check_against(path: str, item: dict, out, k: int = K) -> None:
    ids, logits = hf_prompt_logits(path, item)
    ref = torch.log_softmax(logits, dim=-1)  # [n, V]: row p scores token p + 1
    assert out.prompt_token_ids == ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for p, (token, entry) in enumerate(zip(ids[1:], out.prompt_logprobs[1:])):
        top = ref[p].topk(k)
        assert [t for t in entry if entry[t].rank <= k][:k] == top.indices.tolist()
        for tid, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[tid].logprob == pytest.approx(value, abs=1e-4)
        assert entry[token].logprob == pytest.approx(float(ref[p, token]), abs=1e-4)
        assert entry[token].rank == int((ref[p] > ref[p, token]).sum()) + 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_equal_transformers_log_softmax(path, async_scheduling):
    with LLM(model=path, max_num_batched_tokens=6, block_size=4, async_scheduling=async_scheduling) as llm:
        outs = llm.generate(items(), SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K))
    for item, out in zip(items(), outs):
        check_against(path, item, out)


def test_a_warm_cache_gives_the_same_prompt_logprobs_and_is_not_read(path):
    with LLM(model=path, block_size=4) as llm:
        plain = SamplingParams(temperature=0.0, max_tokens=3)
        asking = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0)
        cold = llm.generate(items()[1], asking)[0]
        warm = llm.generate(items()[1], asking)[0]
        again = llm.generate(items()[1], plain)[0]
    assert warm.num_cached_tokens == 0 and again.num_cached_tokens > 0  # it computed all; others still hit
    assert warm.prompt_logprobs == cold.prompt_logprobs and warm.outputs[0].token_ids == again.outputs[0].token_ids
    assert [list(e) for e in cold.prompt_logprobs[1:]] == [[t] for t in cold.prompt_token_ids[1:]]  # K = 0
    assert again.prompt_logprobs is None


def test_n_completions_share_one_prompt_logprobs(path, llm):
    out = llm.generate(items()[0], SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=3, prompt_logprobs=1))[0]
    assert len(out.outputs) == 2 and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    check_against(path, items()[0], out, k=1)


def test_chunks_computed_again_after_a_preemption_add_nothing_twice(path):
    prompts = [{"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": make_image(i)}}
               for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    with LLM(model=path, block_size=4) as roomy:
        expected = roomy.generate(prompts, params)
    blocks = sum(-(-len(o.prompt_token_ids) // 4) for o in expected)
    with LLM(model=path, block_size=4, num_kv_blocks=blocks, max_model_len=4 * blocks // 2) as tight:
        got = tight.generate(prompts, params)
        assert tight.engine.core.scheduler.num_preemptions > 0, "the test meant to force preemption"
    for want, out in zip(expected, got):
        assert out.prompt_logprobs == want.prompt_logprobs and out.outputs[0].token_ids == want.outputs[0].token_ids


def test_prompt_logprobs_over_the_limit_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_a_request_keeps_each_prompt_tokens_logprob_once():
    from mmserve.engine.request import Request
    from mmserve.ipc.messages import TokenLogprobs

    req = Request("r", [5, 6, 7, 8, 9], [], SamplingParams(prompt_logprobs=0), None, 0.0)
    scored = [TokenLogprobs(t, -float(t), 1, [], []) for t in (6, 7, 8, 9)]
    req.add_prompt_logprobs(1, scored[:2])  # the first chunk: tokens 1 and 2
    req.add_prompt_logprobs(1, scored[:3])  # computed again from the start after a preemption
    req.add_prompt_logprobs(3, scored[2:])
    assert req.prompt_logprobs == scored
    with pytest.raises(AssertionError):
        req.add_prompt_logprobs(9, scored)  # a gap: a chunk was never scored
    assert Request("p", [5, 6], [], SamplingParams(), None, 0.0).prompt_logprobs is None
