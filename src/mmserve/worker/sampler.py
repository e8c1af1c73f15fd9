"""Sampling the next token of each request from its logits row.

Greedy rows take the argmax. Other rows are scaled by temperature, cut by top-k and top-p,
and sampled with the exponential-race trick (argmax of p / q, q ~ Exp(1)), drawing q from the
request's own generator when it has a seed, so a seeded request samples the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import torch

from mmserve.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator) -> list[int]:
    """logits: [R, V] float32, one row per request -> one token id per row."""
    tokens = logits.argmax(dim=-1)  # [R]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    for i in random_rows:
        tokens[i] = _sample_row(logits[i], params[i], generators[i] or default_generator)
    return tokens.tolist()


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    # logits: [V]
    logits = logits / p.temperature
    if p.top_k is not None and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    q = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / q).argmax())
