"""vLLM's `allowed_token_ids` and `bad_words`, offline, against a direct reference: transformers'
logits along our output, masked by the rule one token at a time (only the allowed tokens; a bad
word's last token wherever the output ends with the tokens before it), must pick our tokens and
give our log probabilities; a plain request in the same batch is untouched."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from mmserve import SamplingParams
from helpers.hf_logits import hf_output_logits

PROMPT = {"prompt": "USER: the cat sat on the mat and the cat sat on the mat ASSISTANT:"}
GREEDY = dict(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)


def word_sequences(path: str, words: list[str]) -> list[list[int]]:
    """Bad words' token sequences: as written, and after a space when those tokens differ."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    sequences = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences += [plain] + ([spaced] if spaced != plain else [])
    return sequences


def check_against_reference(path: str, out, mask) -> None:
    """Each output token is the argmax of transformers' logits after `mask(row, outputs so far)`,
    with that distribution's log probability."""
    tokens = out.outputs[0].token_ids
    hf = hf_output_logits(path, PROMPT, tokens)
    for t, token in enumerate(tokens):
        row = mask(hf[t].clone(), tokens[:t])
        assert int(row.argmax()) == token, t
        expected = float(torch.log_softmax(row, -1)[token])
        assert out.outputs[0].logprobs[t][token].logprob == pytest.approx(expected, abs=1e-4)


def test_allowed_token_ids_equal_the_reference(path, llm):
    plain = llm.generate(PROMPT, SamplingParams(**GREEDY))[0].outputs[0].token_ids
    allowed = [t for t in range(5, 400, 7) if t not in plain][:12]  # none of what it says freely
    out, free = llm.generate([PROMPT, PROMPT], [SamplingParams(**GREEDY, allowed_token_ids=allowed),
                                                SamplingParams(**GREEDY)])
    assert set(out.outputs[0].token_ids) <= set(allowed) and free.outputs[0].token_ids == plain

    def only_allowed(row: torch.Tensor, _: list[int]) -> torch.Tensor:
        kept = torch.full_like(row, float("-inf"))
        kept[allowed] = row[allowed]
        return kept

    check_against_reference(path, out, only_allowed)
    repeats = SamplingParams(**GREEDY, allowed_token_ids=allowed * 5000)
    repeated = llm.engine.input_processor.process("r", PROMPT, repeats)
    assert repeated.sampling_params.allowed_token_ids == sorted(allowed)  # P1's sampler gets each id once


@pytest.mark.parametrize("span", [1, 2])  # a one-token word, and a word of two tokens
def test_bad_words_equal_the_reference(path, llm, span):
    plain = llm.generate(PROMPT, SamplingParams(**GREEDY))[0]
    tokenizer = AutoTokenizer.from_pretrained(path)
    word = tokenizer.decode(plain.outputs[0].token_ids[2:2 + span])  # one the free answer says
    sequences = word_sequences(path, [word])
    assert any(len(s) == span for s in sequences)
    out = llm.generate(PROMPT, SamplingParams(**GREEDY, bad_words=[word]))[0]
    assert out.outputs[0].token_ids != plain.outputs[0].token_ids  # the word changed the answer

    def banned(row: torch.Tensor, outputs: list[int]) -> torch.Tensor:
        for seq in sequences:
            before = seq[:-1]
            if len(before) <= len(outputs) and (not before or outputs[len(outputs) - len(before):] == before):
                row[seq[-1]] = float("-inf")
        return row

    check_against_reference(path, out, banned)
    tokens = out.outputs[0].token_ids
    for seq in sequences:  # the word never appears whole in the output
        assert not any(tokens[i:i + len(seq)] == seq for i in range(len(tokens)))


def test_bad_values_are_refused(llm):
    for bad in (dict(allowed_token_ids=[]), dict(allowed_token_ids=[-1]), dict(bad_words=[""]),
                dict(bad_words=["  "]), dict(bad_words=["x" * 300])):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[1, 10**6]))
