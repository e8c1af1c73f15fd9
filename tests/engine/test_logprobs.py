"""Offline `SamplingParams(logprobs=K)`: each token's log probability, rank and top K equal the
log-softmax of transformers' logits on the same weights (greedy, so the processed distribution is
the model's own), with images, chunked prefill and batching; temperature divides the logits."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from helpers.hf_logits import hf_output_logits
from helpers.tiny_models import make_image

K = 5


def items() -> list[dict]:
    return [{"prompt": "USER: hello there, how are you today? ASSISTANT:"},
            {"prompt": "USER: <image>\nWhat is this? ASSISTANT:",
             "multi_modal_data": {"image": make_image(0, (40, 40))}}]


def check_against(path: str, item: dict, completion, temperature: float = 1.0) -> None:
    ref = torch.log_softmax(hf_output_logits(path, item, completion.token_ids) / temperature, dim=-1)  # [T, V]
    assert len(completion.logprobs) == len(completion.token_ids) > 0
    for t, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        top = ref[t].topk(K)
        assert list(entry)[:K] == top.indices.tolist()  # most likely first
        for tid, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[tid].logprob == pytest.approx(value, abs=1e-4)
        assert entry[token].logprob == pytest.approx(float(ref[t, token]), abs=1e-4)
        assert entry[token].rank == int((ref[t] > ref[t, token]).sum()) + 1
        assert entry[token].decoded_token != "" or token >= 0


def test_greedy_logprobs_equal_transformers_log_softmax(path):
    llm = LLM(model=path, max_num_batched_tokens=6, block_size=4)  # chunks split the image
    outs = llm.generate(items(), SamplingParams(temperature=0.0, max_tokens=6, logprobs=K))
    for item, out in zip(items(), outs):
        check_against(path, item, out.outputs[0])
        assert all(e[t].rank == 1 for t, e in zip(out.outputs[0].token_ids, out.outputs[0].logprobs))


def test_sampled_logprobs_are_of_the_tempered_distribution(path, llm):
    out = llm.generate(items()[0], SamplingParams(temperature=0.7, seed=3, max_tokens=5, logprobs=K))[0]
    check_against(path, items()[0], out.outputs[0], temperature=0.7)


def test_logprobs_zero_gives_the_sampled_token_alone_and_plain_requests_none(path, llm):
    asked, plain = llm.generate(items(), [SamplingParams(temperature=0.0, max_tokens=4, logprobs=0),
                                          SamplingParams(temperature=0.0, max_tokens=4)])
    assert [list(e) for e in asked.outputs[0].logprobs] == [[t] for t in asked.outputs[0].token_ids]
    assert plain.outputs[0].logprobs is None


def test_logprobs_over_the_limit_is_refused():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
