"""The runner's copy of one request (`RunnerRequest`): what it keeps between steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmserve.ipc.items import MultiModalItem
from mmserve.sampling_params import SamplingParams
from mmserve.worker.device import to_device


@dataclass
class RunnerRequest:
    """Tokens so far (the runner appends what it samples) and the request's sampler state.

    `token_ids[:num_prompt_tokens]` is the prompt; the rest are outputs (a request resumed after
    preemption arrives with its outputs so far). `grammar` is its structured-output matcher, which
    has accepted every output token. Penalty and bias state on the sampling device, built on the
    first step that needs it and kept: `output_counts` ([V] int64, each token's count among the
    outputs; `record_sampled` adds each new one), `prompt_mask` ([V] bool, tokens present in the
    prompt), `logit_bias` (ids [n] int64, values [n] float32).
    """

    token_ids: list[int]
    mm_items: list[MultiModalItem]
    params: SamplingParams
    block_ids: list[int]
    generator: torch.Generator | None
    num_computed_tokens: int = 0
    mrope: tuple[torch.Tensor, int] | None = None  # M-RoPE positions [3, L] of token_ids[:L], and the delta
    num_prompt_tokens: int = 0
    eos_token_id: int | None = None
    grammar: Any = None  # an xgrammar GrammarMatcher, or None
    prompt_mask: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def positions(self, start: int, end: int) -> torch.Tensor:
        """Positions of tokens [start, end): [end - start], or [3, end - start] with M-RoPE."""
        if self.mrope is None:
            return torch.arange(start, end)
        table, delta = self.mrope
        known_end = table.shape[1]
        known = table[:, start:min(end, known_end)]  # [3, n] from the table
        rest = torch.arange(max(start, known_end), max(end, known_end)) + delta  # generated tokens
        return torch.cat([known, rest.expand(3, -1)], dim=1)

    def scalar_position(self, index: int) -> int | None:
        """The position of token `index` when it is one number on every row (no M-RoPE, or past
        the M-RoPE table: index + delta); None inside the table."""
        if self.mrope is None:
            return index
        table, delta = self.mrope
        return index + delta if index >= table.shape[1] else None

    def stop_token_ids(self) -> list[int]:
        """The tokens `min_tokens` holds back: EOS (unless ignored) and the stop token ids."""
        eos = [] if self.eos_token_id is None or self.params.ignore_eos else [self.eos_token_id]
        return eos + list(self.params.stop_token_ids)

    def penalty_counts(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[V] int64: each token's count among the outputs so far (built once, then kept current)."""
        if self.output_counts is None:
            outputs = torch.tensor(self.output_token_ids, dtype=torch.int64)
            counts = torch.bincount(outputs[outputs < vocab_size], minlength=vocab_size)
            self.output_counts = to_device(counts, device)
        return self.output_counts

    def penalty_prompt_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[V] bool: the tokens of the prompt (built once)."""
        if self.prompt_mask is None:
            prompt = torch.tensor(self.token_ids[:self.num_prompt_tokens], dtype=torch.int64)
            prompt = prompt[prompt < vocab_size]
            mask = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, prompt, True)
            self.prompt_mask = to_device(mask, device)
        return self.prompt_mask

    def logit_bias_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's `logit_bias` as (ids [n] int64, values [n] float32) on `device` (built once)."""
        if self.logit_bias is None:
            bias = self.params.logit_bias or {}
            self.logit_bias = to_device((torch.tensor(list(bias), dtype=torch.int64),
                                         torch.tensor(list(bias.values()), dtype=torch.float32)), device)
        return self.logit_bias
