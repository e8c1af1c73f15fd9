"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

from typing import Any

import msgspec

_GREEDY_EPS = 1e-5
_INT64 = 2**63  # every integer crosses to the engine process as msgpack int64


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to sample one request's output (vLLM's names and defaults).

    `temperature` 0 is greedy. `top_k` None (or 0 / -1, normalised to None) means no top-k cut.
    `stop` strings end the output in the frontend (excluded from the text unless
    `include_stop_str_in_output`); `stop_token_ids` and EOS end it in the engine core.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k is not None and self.top_k <= 0:
            if self.top_k not in (0, -1):
                raise ValueError(f"top_k must be a positive integer, 0 or -1 (disabled); got {self.top_k}")
            self.top_k = None
        _check(isinstance(self.max_tokens, int) and 1 <= self.max_tokens < _INT64,
               f"max_tokens must be a positive 64-bit integer; got {self.max_tokens!r:.40}")
        _check(self.top_k is None or self.top_k < _INT64, f"top_k must be a 64-bit integer; got {self.top_k!r:.40}")
        _check(0.0 <= self.temperature <= 100.0,
               f"temperature must be between 0 and 100; got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1]; got {self.top_p}")
        _check(self.seed is None or 0 <= self.seed < _INT64,
               f"seed must be a non-negative 64-bit integer; got {self.seed!r:.40}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        _check(all(isinstance(t, int) and 0 <= t < _INT64 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative 64-bit integers (token ids)")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a plain dict; unknown names are a ValueError naming them."""
        unknown = sorted(set(values) - set(cls.__struct_fields__))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**values)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
