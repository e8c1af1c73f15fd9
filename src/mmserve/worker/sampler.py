"""Sampling the next token of each request from its logits row.

The rows are first processed per request (`logits_processors.py`: min_tokens, logit_bias,
penalties, structured-output masks; rows asking for none of these are not touched). Greedy rows
then take the argmax. Other rows are scaled by temperature, cut by top-k and top-p, and sampled
with the exponential-race trick (argmax of p / q, q ~ Exp(1)), drawing q from the request's own
generator when it has a seed, so a seeded request samples the same tokens whatever else shares
its batch.

Log probabilities (`SamplingParams.logprobs`) are the log-softmax of the processed row divided by
the temperature (1 when greedy), before top-k / top-p: the distribution the token was sampled
from, with every alternative still finite (see `SamplingParams`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mmserve.ipc.messages import TokenLogprobs
from mmserve.sampling_params import SamplingParams
from mmserve.worker.logits_processors import process_logits

if TYPE_CHECKING:
    from mmserve.worker.runner_state import RunnerRequest


def sample_requests(logits: torch.Tensor, states: list[RunnerRequest], default_generator: torch.Generator,
                    control_tokens: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [R, V] float32, row i of `states[i]` -> one token per row, and its log
    probabilities where the request asked for them (None elsewhere). Structured requests'
    matchers accept their token here."""
    process_logits(logits, states, control_tokens)
    params = [s.params for s in states]
    tokens = sample(logits, params, [s.generator for s in states], default_generator)
    logprobs = compute_logprobs(logits, params, tokens)
    for state, token in zip(states, tokens):
        if state.grammar is not None and not state.grammar.is_terminated():
            state.grammar.accept_token(token)
    return tokens, logprobs


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator) -> list[int]:
    """logits: [R, V] float32, one row per request -> one token id per row."""
    tokens = logits.argmax(dim=-1)  # [R]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    for i in random_rows:
        tokens[i] = _sample_row(logits[i], params[i], generators[i] or default_generator)
    return tokens.tolist()


def compute_logprobs(logits: torch.Tensor, params: list[SamplingParams],
                     tokens: list[int]) -> list[TokenLogprobs | None]:
    """Each asking row's sampled-token log probability, rank (1 = most likely) and top K."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    index = torch.tensor(rows, dtype=torch.int64)
    temps = torch.tensor([1.0 if params[i].greedy else params[i].temperature for i in rows])[:, None]
    lp = torch.log_softmax(logits[index] / temps, dim=-1)  # [L, V]
    chosen = torch.tensor([tokens[i] for i in rows], dtype=torch.int64)
    chosen_lp = lp.gather(1, chosen[:, None])  # [L, 1]
    ranks = (lp > chosen_lp).sum(-1) + 1  # [L]
    k_max = max(params[i].logprobs or 0 for i in rows)
    top = lp.topk(k_max, dim=-1) if k_max else None
    for j, i in enumerate(rows):
        k = params[i].logprobs or 0
        ids = top.indices[j, :k].tolist() if top is not None else []
        vals = top.values[j, :k].tolist() if top is not None else []
        result[i] = TokenLogprobs(tokens[i], float(chosen_lp[j, 0]), int(ranks[j]), ids, vals)
    return result


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
