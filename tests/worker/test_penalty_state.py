"""Penalties on each row's seen tokens only (`logits_processors.apply_penalties` over
`PenaltyState`) against the dense formula over the whole vocabulary, bit for bit, while the
state is kept across steps by `record_sampled` (repeated tokens, new ones, ids past the vocabulary)."""

from __future__ import annotations

import torch

from mmserve.sampling_params import SamplingParams
from mmserve.worker.logits_processors import apply_penalties, record_sampled
from mmserve.worker.runner_state import RunnerRequest

V = 300


def dense(logits: torch.Tensor, prompt: list[int], outputs: list[int], p: SamplingParams) -> torch.Tensor:
    """The penalties as [V] tensors (what the sampler computed before)."""
    counts = torch.bincount(torch.tensor([t for t in outputs if t < V], dtype=torch.int64), minlength=V).float()
    present = counts > 0
    seen = present.clone()
    seen[[t for t in prompt if t < V]] = True
    row = logits
    if p.repetition_penalty != 1.0:
        row = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty), row)
    return row - p.frequency_penalty * counts - p.presence_penalty * present.float()


def test_seen_token_penalties_equal_the_dense_ones_step_after_step():
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4),
              SamplingParams(temperature=0.0, presence_penalty=-0.7),
              SamplingParams(temperature=0.0, repetition_penalty=0.8, presence_penalty=0.5, frequency_penalty=-0.2)]
    prompts = [[5, 6, 6, 7, V + 3], [], [1, 2, 3, 299]]
    states = [RunnerRequest(list(prompt) + [6, 9], [], p, [0], None, num_prompt_tokens=len(prompt))
              for prompt, p in zip(prompts, params)]
    for step in range(6):
        logits = torch.randn(4, V, generator=g) * 3  # row 0 is a request without penalties
        want = logits.clone()
        for i, state in enumerate(states):
            want[i + 1] = dense(logits[i + 1], state.token_ids[:state.num_prompt_tokens], state.output_token_ids,
                                state.params)
        apply_penalties(logits, [1, 2, 3], states)
        assert torch.equal(logits, want)
        sampled = [int(torch.randint(0, 12, (1,), generator=g)) for _ in states]  # often a token seen before
        sampled[step % 3] = V + step  # a token the logits do not have
        for state, token in zip(states, sampled):
            state.token_ids.append(token)
        record_sampled(states, sampled)
