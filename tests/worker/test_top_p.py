"""Top-p from the most likely candidates (`sampler.top_p_cut`) against the sort of the whole
vocabulary (`top_p_cut_sorted`): peaked rows (nucleus among the candidates), flat rows (the sort
decides), rows asking no cut, and rows already cut by top-k (-inf entries)."""

from __future__ import annotations

import torch

from mmserve.worker.sampler import TOP_P_CANDIDATES, top_p_cut, top_p_cut_sorted


def both(logits: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fast, sorted_ = logits.clone(), logits.clone()
    top_p_cut(fast, top_p)
    top_p_cut_sorted(sorted_, top_p)
    return fast, sorted_


def test_candidates_cut_as_the_sort_does():
    g = torch.Generator().manual_seed(0)
    V = TOP_P_CANDIDATES * 5
    peaked = torch.randn(6, V, generator=g) * 6  # nuclei of a few tokens
    peaked[2, 100:] = float("-inf")  # a row cut by top-k before
    top_p = torch.tensor([[0.9], [0.5], [0.99], [1.0], [0.1], [0.95]])
    fast, sorted_ = both(peaked, top_p)
    assert torch.equal(fast.isinf(), sorted_.isinf()) and torch.equal(fast, sorted_)
    assert fast[3].isfinite().all()  # top_p 1: no cut
    assert (fast[1].isfinite().sum() < 50) and (fast[0].isfinite().sum() < TOP_P_CANDIDATES)


def test_a_nucleus_past_the_candidates_falls_back_to_the_sort():
    g = torch.Generator().manual_seed(1)
    V = TOP_P_CANDIDATES * 5
    logits = torch.randn(3, V, generator=g) * 0.1  # nearly flat: the nucleus is most of the vocabulary
    top_p = torch.tensor([[0.9], [0.3], [1.0]])
    fast, sorted_ = both(logits, top_p)
    assert torch.equal(fast, sorted_)
    assert fast[0].isfinite().sum() > TOP_P_CANDIDATES
