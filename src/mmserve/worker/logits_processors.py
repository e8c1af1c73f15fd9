"""Per-request logits processing before sampling, batched over the rows that ask for it.

`process_logits` touches only rows whose `SamplingParams.needs_logits_processing` is true; a step
whose requests ask for none of it costs one pass over the batch's flags. Order: `allowed_token_ids`
(every other token masked), `bad_words` (a word's last token masked where the output ends with the
tokens before it), `min_tokens` (EOS and stop tokens masked while too few tokens are out; skipped
for a structured request, whose grammar decides when it may end), `logit_bias`, the penalties
(vLLM's meaning, see `SamplingParams`), then the structured-output masks. Each kind is one indexed
op over its rows.

Penalty state lives on the logits' device and is kept incrementally: a penalised request's seen
tokens (its prompt's, then its outputs') with their output counts (`PenaltyState`, not [V]
tensors) are built on its first processed step and updated with each sampled token
(`record_sampled`), never rebuilt from its tokens; a step gathers, penalises and writes back only
those entries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mmserve.worker.device import to_device
from mmserve.worker.grammar import apply_grammar_masks

if TYPE_CHECKING:
    from mmserve.worker.runner_state import RunnerRequest


def process_logits(logits: torch.Tensor, states: list[RunnerRequest], control_tokens: torch.Tensor | None) -> None:
    """logits: [R, V] float32, row i of `states[i]`; changed in place. `control_tokens`: what
    structured rows may never sample (`GrammarCache.control_tokens`)."""
    rows = [i for i, s in enumerate(states) if s.params.needs_logits_processing]
    if not rows:
        return
    _keep_allowed(logits, [i for i in rows if states[i].params.allowed_token_ids is not None], states)
    _mask_indexed(logits, [(i, token) for i in rows if states[i].params.bad_words_token_ids
                           for token in _banned_now(states[i])])
    _mask_indexed(logits, [(i, token) for i in rows if _holds_back_stop(states[i])
                           for token in states[i].stop_token_ids()])
    _add_logit_bias(logits, [i for i in rows if states[i].params.logit_bias], states)
    penalized = [i for i in rows if states[i].params.has_penalties]
    if penalized:
        apply_penalties(logits, penalized, [states[i] for i in penalized])
    grammars = {i: g for i in rows if (g := states[i].grammar) is not None and g.binds()}
    if grammars:
        assert control_tokens is not None  # set once a grammar was compiled
        apply_grammar_masks(logits, list(grammars), list(grammars.values()), control_tokens,
                            [_is_json(states[i]) for i in grammars])


def _is_json(state: RunnerRequest) -> bool:
    spec = state.params.structured_outputs
    return spec is not None and spec.is_json


def _holds_back_stop(state: RunnerRequest) -> bool:
    params = state.params
    return bool(params.min_tokens) and state.grammar is None and len(state.output_token_ids) < params.min_tokens


def _mask_indexed(logits: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Each (row, token) of `pairs` to -inf, in one indexed write."""
    if pairs:
        where = to_device(torch.tensor(pairs, dtype=torch.int64), logits.device)  # [n, 2]
        logits[where[:, 0], where[:, 1]] = float("-inf")


def _keep_allowed(logits: torch.Tensor, rows: list[int], states: list[RunnerRequest]) -> None:
    """allowed_token_ids: every other token of `rows` to -inf (the allowed values gathered, the
    rows filled, the values written back)."""
    if not rows:
        return
    allowed = [states[i].allowed_tensor(logits.device) for i in rows]
    lengths = torch.tensor([ids.shape[0] for ids in allowed])  # host sizes: no device sync
    row_index = to_device(torch.tensor(rows, dtype=torch.int64).repeat_interleave(lengths), logits.device)
    ids = torch.cat(allowed)
    kept = logits[row_index, ids]
    logits[to_device(torch.tensor(rows, dtype=torch.int64), logits.device)] = float("-inf")
    logits[row_index, ids] = kept


def _banned_now(state: RunnerRequest) -> list[int]:
    """bad_words: the last token of each word whose other tokens end the output so far."""
    tokens, outputs = state.token_ids, len(state.token_ids) - state.num_prompt_tokens
    banned = []
    for word in state.params.bad_words_token_ids or ():
        before = len(word) - 1
        if before <= outputs and (before == 0 or tokens[len(tokens) - before:] == word[:-1]):
            banned.append(word[-1])
    return banned


def _add_logit_bias(logits: torch.Tensor, rows: list[int], states: list[RunnerRequest]) -> None:
    """Each row's `logit_bias` added, in one indexed add (each request's bias tensors built once)."""
    if not rows:
        return
    biases = [states[i].logit_bias_tensors(logits.device) for i in rows]
    lengths = torch.tensor([ids.shape[0] for ids, _ in biases])  # host sizes: no device sync
    row_index = to_device(torch.tensor(rows, dtype=torch.int64).repeat_interleave(lengths), logits.device)
    ids = torch.cat([ids for ids, _ in biases])
    values = torch.cat([values for _, values in biases]).to(logits.dtype)
    logits.index_put_((row_index, ids), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: list[int], states: list[RunnerRequest]) -> None:
    """Repetition, frequency and presence penalties on `rows` of logits [R, V], in place, on each
    row's seen tokens only (`PenaltyState`): on any other token every penalty is the identity."""
    V, device = logits.shape[-1], logits.device
    seen = [s.penalty_state(V, device) for s in states]
    lengths = [p.ids.shape[0] for p in seen]
    weights = torch.tensor([[s.params.repetition_penalty, s.params.frequency_penalty, s.params.presence_penalty]
                            for s in states], dtype=logits.dtype).repeat_interleave(torch.tensor(lengths), 0)
    row_index = torch.tensor(rows, dtype=torch.int64).repeat_interleave(torch.tensor(lengths))  # [M]
    row_index, weights = to_device((row_index, weights), device)
    rep, freq, pres = weights[:, 0], weights[:, 1], weights[:, 2]  # each [M]
    ids = torch.cat([p.ids for p in seen])  # [M]
    counts = torch.cat([p.counts for p in seen]).to(logits.dtype)
    values = logits[row_index, ids]  # [M]
    present = counts > 0
    if any(s.params.repetition_penalty != 1.0 for s in states):
        touched = present | torch.cat([p.in_prompt for p in seen])
        values = torch.where(touched, torch.where(values > 0, values / rep, values * rep), values)
    logits[row_index, ids] = values - freq * counts - pres * present.to(values.dtype)


def record_sampled(states: list[RunnerRequest], tokens: list[int]) -> None:
    """Count each penalised request's sampled token (row i of `states[i]`; host ids)."""
    for state, token in zip(states, tokens):
        if state.penalty is not None:
            state.penalty.add(token)
