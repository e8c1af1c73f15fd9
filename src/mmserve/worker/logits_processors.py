"""Per-request logits processing before sampling, batched over the rows that ask for it.

`process_logits` touches only rows whose `SamplingParams.needs_logits_processing` is true; a step
whose requests ask for none of it costs one pass over the batch's flags. Order: `min_tokens`
(EOS and stop tokens masked while too few tokens are out; skipped for a structured request, whose
grammar decides when it may end), `logit_bias`, the penalties (vLLM's meaning, see
`SamplingParams`), then the structured-output masks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mmserve.worker.grammar import apply_grammar_masks

if TYPE_CHECKING:
    from mmserve.worker.runner_state import RunnerRequest


def process_logits(logits: torch.Tensor, states: list[RunnerRequest], control_tokens: torch.Tensor | None) -> None:
    """logits: [R, V] float32, row i of `states[i]`; changed in place. `control_tokens`: what
    structured rows may never sample (`GrammarCache.control_tokens`)."""
    rows = [i for i, s in enumerate(states) if s.params.needs_logits_processing]
    if not rows:
        return
    for i in rows:
        state = states[i]
        params = state.params
        if params.min_tokens and state.grammar is None and len(state.output_token_ids) < params.min_tokens:
            stop = state.stop_token_ids()
            if stop:
                logits[i, stop] = float("-inf")
        if params.logit_bias is not None:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
            logits[i].index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype))
    penalized = [i for i in rows if states[i].params.has_penalties]
    if penalized:
        apply_penalties(logits, penalized, [states[i] for i in penalized])
    structured = [i for i in rows if states[i].grammar is not None and not states[i].grammar.is_terminated()]
    if structured:
        assert control_tokens is not None  # set once a grammar was compiled
        apply_grammar_masks(logits, structured, [states[i].grammar for i in structured], control_tokens)


def apply_penalties(logits: torch.Tensor, rows: list[int], states: list[RunnerRequest]) -> None:
    """Repetition, frequency and presence penalties on `rows` of logits [R, V], in place."""
    V = logits.shape[-1]
    index = torch.tensor(rows, dtype=torch.int64)
    sub = logits[index]  # [P, V]
    counts = torch.stack([torch.bincount(torch.tensor(s.output_token_ids, dtype=torch.int64), minlength=V)[:V]
                          for s in states]).to(sub.dtype)  # [P, V] each token's count in the output
    present = counts > 0
    rep = torch.tensor([s.params.repetition_penalty for s in states], dtype=sub.dtype)[:, None]  # [P, 1]
    if bool((rep != 1.0).any()):
        seen = present | torch.stack([_prompt_mask(s, V) for s in states])
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([s.params.frequency_penalty for s in states], dtype=sub.dtype)[:, None]
    pres = torch.tensor([s.params.presence_penalty for s in states], dtype=sub.dtype)[:, None]
    sub = sub - freq * counts - pres * present.to(sub.dtype)
    logits[index] = sub


def _prompt_mask(state: RunnerRequest, vocab_size: int) -> torch.Tensor:
    """[V] bool: the tokens of the request's prompt (built once per request)."""
    if state.prompt_mask is None:
        prompt = torch.tensor(state.token_ids[:state.num_prompt_tokens], dtype=torch.int64)
        prompt = prompt[prompt < vocab_size]
        state.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, prompt, True)
    return state.prompt_mask
