"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec

from mmserve.errors import ClientError
from mmserve.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5
_INT64 = 2**63  # every integer crosses to the engine process as msgpack int64
MAX_LOGPROBS = 20  # the most alternatives per token `logprobs` may ask for (OpenAI's top_logprobs limit)
MAX_N = 128  # the most completions one request may ask for
MAX_STOP_STRINGS = 128  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to sample one request's output (vLLM's names and defaults).

    `temperature` 0 is greedy. `top_k` None (or 0 / -1, normalised to None) means no top-k cut.
    `min_p` (vLLM's) drops the tokens less likely than `min_p` times the most likely one (after the
    temperature, before top-k / top-p); 0 drops none.
    `stop` strings end the output in the frontend (excluded from the text unless
    `include_stop_str_in_output`); at most `MAX_STOP_STRINGS` of at most `MAX_STOP_CHARS`
    characters each; `stop_token_ids` and EOS end it in the engine core.

    `n` completions share the prompt (see engine/policies/siblings.py); seeded, completion i uses `seed + i`.
    `logprobs` K: each sampled token's log probability, its rank and the K most likely
    alternatives, from the distribution it was sampled from: after the penalties, `logit_bias`,
    `min_tokens` and a structured-output mask, divided by the temperature (1 when greedy), before
    top-k / top-p (vLLM's "processed_logprobs"; its default is the raw logits). Penalties have vLLM's
    meaning: `repetition_penalty` divides a positive logit (multiplies a negative one) of every token
    in the prompt or the output; `frequency_penalty` subtracts itself times the token's count in the
    output, `presence_penalty` subtracts itself once per token present in the output. `min_tokens`
    masks EOS and `stop_token_ids` (and holds back stop strings) until that many tokens are out.
    `logit_bias` adds to a token id's logit. `allowed_token_ids` (vLLM's) keeps only those tokens
    sampleable; `bad_words` (vLLM's) are never completed: each word's tokens (as it would start
    the text and after a space, `bad_words_token_ids`, filled by the input processor) has its last
    token masked wherever the output ends with the ones before it. `structured_outputs` constrains the output to JSON, a
    regex, a choice or a grammar. `truncate_prompt_tokens` K (vLLM's) keeps the prompt's last K
    tokens, -1 as many as fit (frontend/request/truncation.py). `prompt_logprobs` K: each prompt
    token's log probability after the tokens before it (the first has none), its rank and the K
    most likely tokens there, from the raw logits (vLLM's default); such a request computes its
    whole prompt (no prefix-cache read).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None  # the input processor's tokenization of `bad_words`
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last K tokens (-1: the most that fit)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k is not None and self.top_k <= 0:
            if self.top_k not in (0, -1):
                raise ClientError(f"top_k must be a positive integer, 0 or -1 (disabled); got {self.top_k}")
            self.top_k = None
        _check(isinstance(self.max_tokens, int) and 1 <= self.max_tokens < _INT64,
               f"max_tokens must be a positive 64-bit integer; got {self.max_tokens!r:.40}")
        _check(self.top_k is None or self.top_k < _INT64, f"top_k must be a 64-bit integer; got {self.top_k!r:.40}")
        _check(0.0 <= self.temperature <= 100.0,
               f"temperature must be between 0 and 100; got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1]; got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1]; got {self.min_p}")
        _check(self.seed is None or 0 <= self.seed < _INT64,
               f"seed must be a non-negative 64-bit integer; got {self.seed!r:.40}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        _check(len(self.stop) <= MAX_STOP_STRINGS,
               f"stop takes at most {MAX_STOP_STRINGS} strings; got {len(self.stop)}")
        _check(all(len(s) <= MAX_STOP_CHARS for s in self.stop),
               f"each stop string has at most {MAX_STOP_CHARS} characters")
        _check(all(isinstance(t, int) and 0 <= t < _INT64 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative 64-bit integers (token ids)")
        self._check_extras()

    def _check_extras(self) -> None:
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"n must be between 1 and {MAX_N}; got {self.n!r:.40}")
        k = self.truncate_prompt_tokens
        _check(k is None or (isinstance(k, int) and (k == -1 or 1 <= k < _INT64)),
               f"truncate_prompt_tokens must be a positive integer or -1 (the most that fit); got {k!r:.40}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                   f"{name} must be between 0 and {MAX_LOGPROBS}; got {value!r:.40}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, f"{name} must be between -2 and 2; got {value}")
        _check(0.0 < self.repetition_penalty <= 2.0**31,
               f"repetition_penalty must be greater than 0; got {self.repetition_penalty}")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be between 0 and max_tokens ({self.max_tokens}); got {self.min_tokens!r:.40}")
        if self.logit_bias is not None:
            _check(all(isinstance(t, int) and 0 <= t < _INT64 for t in self.logit_bias),
                   "logit_bias keys must be token ids (non-negative integers)")
            _check(all(-100.0 <= b <= 100.0 for b in self.logit_bias.values()),
                   "logit_bias values must be between -100 and 100")
            self.logit_bias = self.logit_bias or None
        if self.allowed_token_ids is not None:
            _check(bool(self.allowed_token_ids) and all(isinstance(t, int) and 0 <= t < _INT64
                                                        for t in self.allowed_token_ids),
                   "allowed_token_ids must be a non-empty list of token ids (non-negative integers)")
        if self.bad_words is not None:
            _check(all(isinstance(w, str) and w.strip() for w in self.bad_words),
                   "bad_words must be a list of words (non-empty strings)")
            _check(len(self.bad_words) <= MAX_STOP_STRINGS and all(len(w) <= MAX_STOP_CHARS for w in self.bad_words),
                   f"bad_words takes at most {MAX_STOP_STRINGS} words of at most {MAX_STOP_CHARS} characters")
            self.bad_words = self.bad_words or None

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_logits_processing(self) -> bool:
        """Whether any step of the logits processing applies (plain requests skip it all)."""
        return (self.has_penalties or self.min_tokens > 0 or self.logit_bias is not None
                or self.allowed_token_ids is not None or self.bad_words is not None
                or self.structured_outputs is not None)

    def for_sibling(self, index: int) -> SamplingParams:
        """Completion `index`'s own parameters when `n` > 1: one completion, seed + index; the prompt's
        log probabilities are completion 0's alone."""
        seed = None if self.seed is None else (self.seed + index) % _INT64
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return msgspec.structs.replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a plain dict; unknown names are a ValueError naming them."""
        unknown = sorted(set(values) - set(cls.__struct_fields__))
        if unknown:
            raise ClientError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**values)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ClientError(message)



MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # a beam search step asks for 2 x beam_width log probabilities


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's: `beam_width` answers of at most `max_tokens` tokens each (`beam_search.py` runs them)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # accepted as vLLM's; the ranking uses the model's own log probabilities
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}]; got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1; got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0; got {self.temperature}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number; got {self.length_penalty}")

    def step_params(self) -> SamplingParams:
        """One step of a beam: one greedy token and the 2 x beam_width most likely next tokens."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.beam_width, ignore_eos=True,
                              skip_special_tokens=False)
