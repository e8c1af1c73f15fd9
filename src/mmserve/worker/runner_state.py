"""The runner's copy of one request (`RunnerRequest`): what it keeps between steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mmserve.ipc.items import MultiModalItem
from mmserve.sampling_params import SamplingParams
from mmserve.worker.device import to_device

if TYPE_CHECKING:
    from mmserve.worker.grammar import RequestGrammar


@dataclass
class RunnerRequest:
    """Tokens so far (the runner appends what it samples, once it reaches the host) and the
    request's sampler state.

    `token_ids[:num_prompt_tokens]` is the prompt; the rest are outputs (a request resumed after
    preemption arrives with its outputs so far). `grammar` is its structured-output matcher, which
    has accepted every output token. Penalty and bias state on the sampling device, built on the
    first step that needs it and kept: `penalty` (the tokens seen so far and their counts among the
    outputs, `PenaltyState`; `record_sampled` adds each new one), `logit_bias` (ids [n] int64,
    values [n] float32), `allowed` (allowed_token_ids).
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
    grammar: RequestGrammar | None = None  # its structured-output matcher (worker/grammar.py)
    penalty: PenaltyState | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None
    allowed: torch.Tensor | None = None  # allowed_token_ids [n] int64, on the sampling device
    return_first_logits: bool = False  # the first token sampled after the prompt returns its raw logits row
    num_in_flight: int = 0  # 1 while its last sampled token is on its way to the host (not in token_ids yet)

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

    def penalty_state(self, vocab_size: int, device: torch.device) -> PenaltyState:
        """The request's seen tokens (built once, from its prompt and outputs so far, then kept)."""
        if self.penalty is None:
            self.penalty = PenaltyState.build(self.token_ids[:self.num_prompt_tokens], self.output_token_ids,
                                              vocab_size, device)
        return self.penalty

    def logit_bias_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's `logit_bias` as (ids [n] int64, values [n] float32) on `device` (built once)."""
        if self.logit_bias is None:
            bias = self.params.logit_bias or {}
            self.logit_bias = to_device((torch.tensor(list(bias), dtype=torch.int64),
                                         torch.tensor(list(bias.values()), dtype=torch.float32)), device)
        return self.logit_bias

    def allowed_tensor(self, device: torch.device) -> torch.Tensor:
        """The request's `allowed_token_ids` [n] int64 on `device` (built once)."""
        if self.allowed is None:
            self.allowed = to_device(torch.tensor(self.params.allowed_token_ids or [], dtype=torch.int64), device)
        return self.allowed


class PenaltyState:
    """A penalised request's seen tokens, the only ones penalties change, kept as it samples:
    `ids` [n] int64 (the prompt's distinct tokens, then each new output token), `counts` [n]
    float32 (each one's count among the outputs), `in_prompt` [n] bool; on the sampling device.
    The token -> position map stays on the host, so adding a token costs no device sync."""

    def __init__(self, ids: list[int], counts: list[float], in_prompt: list[bool], vocab_size: int,
                 device: torch.device) -> None:
        self.position = {token: i for i, token in enumerate(ids)}
        self.vocab_size = vocab_size
        self.ids, self.counts, self.in_prompt = to_device(
            (torch.tensor(ids, dtype=torch.int64), torch.tensor(counts, dtype=torch.float32),
             torch.tensor(in_prompt, dtype=torch.bool)), device)

    @classmethod
    def build(cls, prompt: list[int], outputs: list[int], vocab_size: int, device: torch.device) -> PenaltyState:
        counts: dict[int, float] = dict.fromkeys((t for t in prompt if t < vocab_size), 0.0)
        in_prompt = set(counts)
        for token in outputs:
            if token < vocab_size:
                counts[token] = counts.get(token, 0.0) + 1
        return cls(list(counts), list(counts.values()), [t in in_prompt for t in counts], vocab_size, device)

    def add(self, token: int) -> None:
        """Count one more output `token` (a new one appended to the seen tokens)."""
        if token >= self.vocab_size:
            return
        i = self.position.get(token)
        if i is not None:
            self.counts[i] += 1
            return
        self.position[token] = len(self.position)
        device = self.ids.device
        self.ids = torch.cat([self.ids, torch.tensor([token], dtype=torch.int64, device=device)])
        self.counts = torch.cat([self.counts, torch.ones(1, device=device)])
        self.in_prompt = torch.cat([self.in_prompt, torch.zeros(1, dtype=torch.bool, device=device)])
