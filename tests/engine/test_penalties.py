"""Offline penalties, logit_bias and min_tokens against a direct reference: transformers' logits
along our output, processed by the textbook formulas one token at a time, must pick our tokens and
give our log probabilities; plain requests in the same batch are untouched."""

from __future__ import annotations

import pytest
import torch

from mmserve import SamplingParams
from helpers.hf_logits import hf_output_logits
from mmserve.models.hf_config import eos_token_id


PROMPT = {"prompt": "USER: the cat sat on the mat and the cat sat on the mat ASSISTANT:"}


def reference_logits(row: torch.Tensor, prompt: list[int], outputs: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's meaning, written out token by token."""
    row = row.clone()
    for tid, bias in (p.logit_bias or {}).items():
        row[tid] += bias
    for tid in set(prompt) | set(outputs):
        if p.repetition_penalty != 1.0:
            row[tid] = row[tid] / p.repetition_penalty if row[tid] > 0 else row[tid] * p.repetition_penalty
    for tid in set(outputs):
        row[tid] -= p.frequency_penalty * outputs.count(tid) + p.presence_penalty
    return row


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5),
                                       dict(presence_penalty=-1.2, repetition_penalty=0.7),
                                       dict(frequency_penalty=0.6, presence_penalty=0.9, logit_bias={7: 4.0})])
def test_penalties_equal_the_reference(path, llm, penalties):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, **penalties)
    out, plain = llm.generate([PROMPT, PROMPT], [params, SamplingParams(temperature=0.0, max_tokens=12,
                                                                        ignore_eos=True)])
    tokens = out.outputs[0].token_ids
    hf = hf_output_logits(path, PROMPT, tokens)
    moved = 0.0  # how far the penalties moved the sampled tokens' log probabilities
    for t, token in enumerate(tokens):
        row = reference_logits(hf[t], out.prompt_token_ids, tokens[:t], params)
        assert int(row.argmax()) == token
        ref_lp = float(torch.log_softmax(row, -1)[token])
        assert out.outputs[0].logprobs[t][token].logprob == pytest.approx(ref_lp, abs=1e-4)
        moved = max(moved, abs(ref_lp - float(torch.log_softmax(hf[t], -1)[token])))
    assert moved > 0.01, "the penalties must change the distribution, or the test proves nothing"
    plain_hf = hf_output_logits(path, PROMPT, plain.outputs[0].token_ids)
    assert plain.outputs[0].token_ids == plain_hf.argmax(-1).tolist()


def test_min_tokens_holds_back_eos_then_lets_it_through(path, llm):
    eos = eos_token_id(path)
    pushed = {eos: 100.0}  # EOS is the only likely token
    short, held = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0.0, max_tokens=10, logit_bias=pushed),
                                                  SamplingParams(temperature=0.0, max_tokens=10, logit_bias=pushed,
                                                                 min_tokens=4)])
    assert short.outputs[0].token_ids == [eos]
    assert len(held.outputs[0].token_ids) == 5 and held.outputs[0].token_ids[-1] == eos
    assert eos not in held.outputs[0].token_ids[:4] and held.outputs[0].finish_reason == "stop"


def test_bad_values_are_refused(llm):
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                dict(min_tokens=20, max_tokens=5), dict(logit_bias={1: 101.0})):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPT, SamplingParams(logit_bias={10**6: 1.0}))
