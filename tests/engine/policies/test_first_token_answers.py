"""The first-token policy alone (`engine/policies/first_tokens.py: FirstTokenAnswers`): a token is
looked up only when the hits reach a last block, an answer is handed out once after its step, and
a failed step takes it back."""

from __future__ import annotations

import pytest

from mmserve.engine.block_hash import BlockHasher
from mmserve.engine.policies.first_tokens import FirstTokenAnswers, FirstTokenCache
from mmserve.engine.request import Request
from mmserve.sampling_params import SamplingParams

PROMPT = list(range(100, 111))  # two full blocks of 4 and 3 tokens


def greedy(rid: str) -> Request:
    return Request(rid, PROMPT, [], SamplingParams(max_tokens=4, temperature=0), None, 0.0,
                   block_hasher=BlockHasher(4))


def learned() -> FirstTokenAnswers:
    answers = FirstTokenAnswers(FirstTokenCache(8))
    first = greedy("first")
    first.num_computed_tokens = len(PROMPT)
    first.append_output_token_ids([42])
    answers.learn(first, [42])
    return answers


def test_a_token_is_looked_up_only_when_the_hits_reach_the_last_block():
    answers = learned()
    assert answers.token_for(greedy("again"), reaches_last_block=False) is None
    assert answers.cache.num_queries == 0
    assert answers.token_for(greedy("again"), reaches_last_block=True) == 42


def test_a_token_sampled_mid_prompt_or_after_the_first_is_not_learned():
    answers = FirstTokenAnswers(FirstTokenCache(8))
    req = greedy("r")
    req.num_computed_tokens = len(PROMPT) - 1  # a chunk that ends before the prompt does
    req.append_output_token_ids([5])
    answers.learn(req, [5])
    assert len(answers.cache) == 0


def test_an_answer_is_drained_once():
    answers = learned()
    again = greedy("again")
    answers.answer(again, 42)
    assert again.output_token_ids == [42]
    with pytest.raises(AssertionError, match="not sent"):
        answers.check_integrity()
    assert answers.drain() == [again] and answers.drain() == []
    answers.check_integrity()


def test_a_failed_step_takes_the_token_back():
    answers = learned()
    again = greedy("again")
    hashes = list(again.block_hashes)
    answers.answer(again, 42)
    assert answers.take_back() == [again]
    assert again.output_token_ids == [] and again.all_token_ids == PROMPT and again.block_hashes == hashes
    answers.check_integrity()
