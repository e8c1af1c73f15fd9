"""min_p (vLLM's, and a generation_config.json default): a token less likely than min_p times the
most likely one is never drawn; the rows around it sample as before."""

from __future__ import annotations

import pytest
import torch

from mmserve.sampling_params import SamplingParams
from mmserve.worker.sampler import sample


def draws(logits: torch.Tensor, params: list[SamplingParams], n: int = 400) -> list[set[int]]:
    """The tokens each row drew over `n` steps (seeded)."""
    seen: list[set[int]] = [set() for _ in params]
    generator = torch.Generator().manual_seed(0)
    for _ in range(n):
        for row, token in enumerate(sample(logits.clone(), params, [None] * len(params), generator).tolist()):
            seen[row].add(token)
    return seen


def test_min_p_keeps_only_the_tokens_near_the_most_likely():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])  # relative to the top: 1, .6, .2, .12, .08
    logits = probs.log().repeat(3, 1)
    params = [SamplingParams(min_p=0.5), SamplingParams(min_p=0.15), SamplingParams(min_p=0.0)]
    assert draws(logits, params) == [{0, 1}, {0, 1, 2}, {0, 1, 2, 3, 4}]


def test_min_p_applies_after_the_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0]])  # at temperature 2: 1, .61, .37 of the top
    assert draws(logits, [SamplingParams(min_p=0.5, temperature=2.0)]) == [{0, 1}]
    assert draws(logits, [SamplingParams(min_p=0.5, temperature=1.0)]) == [{0}]  # .37, .14 of the top


@pytest.mark.parametrize("min_p", [-0.1, 1.5])
def test_min_p_out_of_range_is_refused(min_p):
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingParams(min_p=min_p)
