"""Request and response bodies of `POST /v1/completions` (OpenAI's legacy text completions, with
vLLM's sampling extras). Text prompts: a string, or a list of strings (each runs as its own engine
request, `n` choices each; see `prompt_batch.py`); or token ids: a list of ints, or a list of such
lists (as lm-evaluation-harness sends them). `echo` puts each choice's prompt before its text
and, with `logprobs`, its prompt tokens' log probabilities before its own (the first token's null),
as lm-evaluation-harness reads them to score a continuation; with `max_tokens` 0 the prompt alone."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mmserve.errors import ClientError
from mmserve.entrypoints.openai.protocol import ParameterError, StreamOptions, UsageInfo
from mmserve.entrypoints.openai.sampling_extras import SamplingExtras, check_top_logprobs
from mmserve.frontend.request.prompt import PromptSettings, check_token_ids
from mmserve.sampling_params import MAX_N, SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class CompletionRequest(SamplingExtras):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = 1
    best_of: int | None = None
    logprobs: int | None = None  # the legacy API's: K alternatives per token
    echo: bool | None = False
    suffix: str | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    cache_salt: str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None

    @field_validator("prompt")
    @classmethod
    def _some_prompts(cls, value: str | list[str] | list[int] | list[list[int]]) -> Any:
        prompts = each_prompt(value)
        if not 1 <= len(prompts) <= MAX_N:
            raise ClientError(f"prompt must be a string, a list of 1 to {MAX_N} strings, a list of token ids or "
                              f"a list of 1 to {MAX_N} lists of token ids")
        for prompt in prompts:
            if not isinstance(prompt, str):
                check_token_ids(prompt)
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text, or token ids."""
        return each_prompt(self.prompt)

    def check_supported(self) -> None:
        check_top_logprobs("logprobs", self.logprobs)
        self.check_prompt_logprobs(self.stream)
        self.check_beam_search(self.stream, self.logprobs is not None)
        if self.suffix:
            raise ParameterError("suffix", "suffix is not supported by mmserve", code="unsupported_parameter")
        if self.best_of not in (None, self.n or 1):
            raise ParameterError("best_of", "best_of other than n is not supported by mmserve",
                                 code="unsupported_parameter")
        if len(self.prompts) * (self.n or 1) > MAX_N:
            raise ParameterError("n", f"n times the number of prompts must be at most {MAX_N}")
        if self.stream_options is not None and not self.stream:
            raise ParameterError("stream_options", "stream_options is only allowed when stream is true")

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens` 0: the prompt alone is answered (its log probabilities the point;
        the engine samples one token, dropped), as vLLM and OpenAI's legacy scoring clients do."""
        return bool(self.echo) and self.max_tokens == 0

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def prompt_settings(self) -> PromptSettings:
        return PromptSettings(self.cache_salt)

    def to_sampling_params(self, default_max_tokens: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """As `ChatCompletionRequest.to_sampling_params`."""
        values: dict[str, Any] = {
            "max_tokens": default_max_tokens if self.max_tokens is None else 1 if self.echo_only else self.max_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
            "n": self.n, "logprobs": self.logprobs, "prompt_logprobs": self.logprobs if self.echo else None,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens, **self.extra_sampling_values(),
        }
        return SamplingParams(**{**(defaults or {}), **{k: v for k, v in values.items() if v is not None}})


def each_prompt(value: Any) -> list[str | list[int]]:
    """`prompt`'s (or the embeddings' `input`'s) prompts: one text, one list of ids, or a list of either."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return list(value)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None  # tokens, token_logprobs, top_logprobs, text_offset
    finish_reason: str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when asked
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids (a stream's first chunk)
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: this choice's (or chunk's) tokens


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
