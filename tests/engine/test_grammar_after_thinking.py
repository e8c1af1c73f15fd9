"""A grammar that binds after the thinking (`StructuredOutputsParams.after_thinking`, the runner's
`RequestGrammar`): a tiny Qwen-VL whose tokenizer has `<think>` and `</think>` as single tokens, as
Qwen3's has. The thinking is the free run's token for token; the answer after `</think>` is the
grammar's; a prompt that did not open the block lets the first token open one; without the gate
the grammar binds from the first token (the tags masked)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.structured_outputs import StructuredOutputsParams
from helpers.tiny_models import make_qwen_checkpoint

DIGIT = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["a"], "additionalProperties": False}
OPENED = "<|im_start|>user\nWhat is it?<|im_end|>\n<|im_start|>assistant\n<think>\n"  # a Thinking template's
PLAIN = "<|im_start|>user\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
# on these random weights, greedy with `</think>` raised by 4 thinks 20 tokens before closing the block
CLOSE_BIAS = 4.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("thinking")
    path = root / "thinking"
    shutil.copytree(make_qwen_checkpoint(root), path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<think>", "</think>"])  # within the embedding's padding: ids 1252, 1253
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(model=checkpoint, num_kv_blocks=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def tags(llm) -> tuple[int, int]:
    from mmserve.entrypoints.openai.reasoning import thinking_token_ids

    ids = thinking_token_ids(llm.get_tokenizer())
    assert ids is not None
    return ids


def digit(tags: tuple[int, int] | None) -> StructuredOutputsParams:
    spec = StructuredOutputsParams.for_schema(DIGIT)
    return spec if tags is None else StructuredOutputsParams(json=spec.json, after_thinking=tags)


def test_the_thinking_is_free_and_the_answer_after_it_is_the_grammars(llm, tags):
    start, end = tags
    bias = {end: CLOSE_BIAS}
    free = llm.generate(OPENED, SamplingParams(temperature=0, max_tokens=40, logit_bias=bias))[0].outputs[0]
    closed_at = free.token_ids.index(end)
    assert closed_at >= 10  # the setup thinks first (else the test below proves little)
    gated = llm.generate(OPENED, SamplingParams(temperature=0, max_tokens=40, logit_bias=bias,
                                                structured_outputs=digit(tags)))[0].outputs[0]
    assert gated.token_ids[:closed_at + 1] == free.token_ids[:closed_at + 1]
    answer = llm.get_tokenizer().decode(gated.token_ids[closed_at + 1:], skip_special_tokens=True)
    assert gated.finish_reason == "stop" and json.loads(answer)["a"] in range(10)
    assert free.token_ids[closed_at + 1:] != gated.token_ids[closed_at + 1:]  # the free run did not answer so

    bound = llm.generate(OPENED, SamplingParams(temperature=0, max_tokens=40, logit_bias=bias,
                                                structured_outputs=digit(None)))[0].outputs[0]
    assert end not in bound.token_ids and json.loads(bound.text)["a"] in range(10)  # no gate: JSON at once


def test_a_prompt_that_did_not_open_the_block_lets_the_first_token_open_it(llm, tags):
    """`<think>` raised above everything but `</think>`: at the start the grammar masks `</think>`, so
    the model opens its thinking; inside it `</think>` wins; then the answer is JSON."""
    start, end = tags
    bias = {start: 40.0, end: 80.0}
    gated = llm.generate(PLAIN, SamplingParams(temperature=0, max_tokens=24, logit_bias=bias,
                                               structured_outputs=digit(tags)))[0].outputs[0]
    assert gated.token_ids[:2] == [start, end]
    assert json.loads(llm.get_tokenizer().decode(gated.token_ids[2:], skip_special_tokens=True))["a"] in range(10)
    bound = llm.generate(PLAIN, SamplingParams(temperature=0, max_tokens=24, logit_bias=bias,
                                               structured_outputs=digit(None)))[0].outputs[0]
    assert start not in bound.token_ids and json.loads(bound.text)["a"] in range(10)
    # the block the template closed (thinking switched off) is not reopened by the prompt's own tags
    off = PLAIN + "<think>\n\n</think>\n\n"
    again = llm.generate(off, SamplingParams(temperature=0, max_tokens=24, logit_bias=bias,
                                             structured_outputs=digit(tags)))[0].outputs[0]
    assert again.token_ids[:2] == [start, end]


def test_the_gate_sets_one_bit_and_waits_while_thinking(checkpoint, tags):
    """`RequestGrammar` on the real matcher: at the start the grammar's mask plus the one bit of
    `<think>` (any id, the sign bit of an int32 word too); while thinking it binds nothing."""
    import xgrammar as xgr

    from mmserve.worker.grammar import GrammarCache, RequestGrammar

    cache = GrammarCache(checkpoint, 1280)
    spec = digit(None)
    plain = RequestGrammar(cache.matcher(spec, None))
    want = xgr.allocate_token_bitmask(1, 1280)
    plain.fill(want, 0)
    for start in (tags[0], 31, 63, 64):
        gate = RequestGrammar(cache.matcher(spec, None), (start, tags[1]), [1, 2, 3])
        assert gate.phase == "start" and gate.binds()
        got = xgr.allocate_token_bitmask(1, 1280)
        gate.fill(got, 0)
        allowed = torch.zeros(1, 1280)
        xgr.apply_token_bitmask_inplace(allowed, got)
        expected = torch.zeros(1, 1280)
        xgr.apply_token_bitmask_inplace(expected, want)
        expected[0, start] = 0.0
        assert torch.equal(allowed, expected)
    opened = RequestGrammar(cache.matcher(spec, None), tags, [7, tags[0], 8])
    assert opened.phase == "thinking" and not opened.binds()
    for token in (5, tags[0], 9):
        opened.accept(token)
        assert not opened.binds()
    opened.accept(tags[1])
    assert opened.phase == "answer" and opened.binds()
    closed = RequestGrammar(cache.matcher(spec, None), tags, [tags[0], 8, tags[1]])
    assert closed.phase == "start"

