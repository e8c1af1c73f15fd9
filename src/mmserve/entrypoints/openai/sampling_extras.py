"""Request fields shared by chat and completions beyond the basic sampling ones: penalties,
`min_tokens`, `logit_bias`, `response_format` and vLLM's `structured_outputs` (`{"json" |
"json_object" | "regex" | "choice" | "grammar": ...}`, and its older top-level names `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`; one structure per request), and their
translation into `SamplingParams` values. A bad value is a `ParameterError` naming the field
(imported where raised: protocol.py builds its request bodies on `SamplingExtras`)."""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from mmserve.sampling_params import MAX_BEAM_WIDTH, MAX_LOGPROBS
from mmserve.structured_outputs import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: Any = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}`."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def to_structured_outputs(self) -> StructuredOutputsParams | None:
        schema = None if self.json_schema is None else self.json_schema.json_schema
        return structured_outputs_of(self.type, schema, "response_format", "json_schema.schema")


def structured_outputs_of(kind: str, schema: Any, param: str, schema_name: str) -> StructuredOutputsParams | None:
    """The structure an answer format asks for (chat's `response_format`, responses' `text.format`):
    None for "text"; a `ParameterError` naming `param` for a missing or unsupported schema."""
    from mmserve.entrypoints.openai.protocol import ParameterError

    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if schema is None:
        raise ParameterError(param, f"{param} of type json_schema needs {schema_name}")
    try:
        return StructuredOutputsParams.for_schema(schema)
    except ValueError as e:
        raise ParameterError(param, f"{param}: {e}") from None


# what beam search does not use (beam_search.py: it ranks by the model's own log probabilities), and
# each field's values that ask for nothing (a client that always sends top_p 1.0 is not refused)
_NOT_WITH_BEAMS: dict[str, tuple[Any, ...]] = {
    "top_p": (1.0,), "top_k": (-1, 0), "min_p": (0.0,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,), "min_tokens": (0,), "logit_bias": ({},), "allowed_token_ids": (),
    "bad_words": ([],), "prompt_logprobs": (), "stop": ([], ""), "stop_token_ids": ([],), "response_format": (),
    "structured_outputs": (), "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "echo": (False,)}


class SamplingExtras(BaseModel):
    """Fields both request bodies take; `extra_sampling_values` gives their `SamplingParams` values."""

    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    min_p: float | None = None  # vLLM's
    min_tokens: int | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None  # token id (as a string, as JSON keys are) -> bias
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: {"regex": "[0-9]+"}, {"choice": [...]}, ...
    guided_json: Any = None  # vLLM's older names for structured_outputs' kinds
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's log probability and top K (not streamed)
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be sampled
    bad_words: list[str] | None = None  # vLLM's: words the output never completes
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last K tokens (-1: the most that fit)
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:N" (default: the flag)
    return_token_ids: bool | None = False  # vLLM's: the prompt's and each choice's token ids in the answer
    request_id: str | None = None  # vLLM's: the answer's id (after the endpoint's prefix); X-Request-Id wins
    priority: int | None = 0  # vLLM's: the lower, the sooner it runs (--scheduling-policy priority)
    use_beam_search: bool | None = False  # vLLM's: the n best of n beams (beam_search.py)
    length_penalty: float | None = None  # vLLM's, with use_beam_search: a beam's score is over length ** it

    def tokens_as_ids(self, server_default: bool) -> bool:
        """Whether log probabilities name tokens "token_id:N": the request's choice, else the server's."""
        return server_default if self.return_tokens_as_token_ids is None else self.return_tokens_as_token_ids

    def check_beam_search(self, stream: bool | None, logprobs: bool) -> None:
        """`use_beam_search` answers whole, with n (1 to MAX_BEAM_WIDTH) beams and no log probabilities;
        a sampling field beam search does not use is refused by name, not ignored."""
        from mmserve.entrypoints.openai.protocol import ParameterError

        if not self.use_beam_search:
            if self.length_penalty not in (None, 1.0):
                raise ParameterError("length_penalty", "length_penalty needs use_beam_search")
            return
        if stream:
            raise ParameterError("use_beam_search", "use_beam_search answers whole: not when stream is true")
        if logprobs:
            raise ParameterError("use_beam_search", "use_beam_search gives no log probabilities")
        if not 1 <= (getattr(self, "n", 1) or 1) <= MAX_BEAM_WIDTH:
            raise ParameterError("n", f"with use_beam_search, n (the beam width) must be 1 to {MAX_BEAM_WIDTH}")
        for name, neutral in _NOT_WITH_BEAMS.items():
            value = getattr(self, name, None)
            if value is not None and value not in neutral:
                raise ParameterError(name, f"{name} is not used by beam search (use_beam_search)")
        if self.length_penalty is not None and not math.isfinite(self.length_penalty):
            raise ParameterError("length_penalty", "length_penalty must be a finite number")

    def check_prompt_logprobs(self, stream: bool | None) -> None:
        """`prompt_logprobs`: 0 to 20, and not in a stream (vLLM's rule); a `ParameterError` otherwise."""
        from mmserve.entrypoints.openai.protocol import ParameterError

        check_top_logprobs("prompt_logprobs", self.prompt_logprobs)
        if self.prompt_logprobs is not None and stream:
            raise ParameterError("prompt_logprobs", "prompt_logprobs are not available when stream is true")

    def extra_sampling_values(self) -> dict[str, Any]:
        values: dict[str, Any] = {"presence_penalty": self.presence_penalty, "prompt_logprobs": self.prompt_logprobs,
                                  "frequency_penalty": self.frequency_penalty,
                                  "repetition_penalty": self.repetition_penalty, "min_tokens": self.min_tokens,
                                  "min_p": self.min_p,
                                  "logit_bias": _token_bias(self.logit_bias),
                                  "allowed_token_ids": self.allowed_token_ids, "bad_words": self.bad_words,
                                  "truncate_prompt_tokens": self.truncate_prompt_tokens,
                                  "structured_outputs": self._structure()}
        return {k: v for k, v in values.items() if v is not None}

    def structure_param(self) -> str | None:
        """The field that asks for a structure (the first, if several: `_structure` refuses that)."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        if self.structured_outputs is not None:
            return "structured_outputs"
        return next((f"guided_{k}" for k in ("json", "regex", "choice", "grammar")
                     if getattr(self, f"guided_{k}") is not None), None)

    def _structure(self) -> StructuredOutputsParams | None:
        """The one structure the request asks for, whichever field names it; a `ParameterError`
        naming the second field when two do."""
        from mmserve.entrypoints.openai.protocol import ParameterError

        asked: list[tuple[str, StructuredOutputsParams]] = []
        if self.response_format is not None:
            spec = self.response_format.to_structured_outputs()
            asked += [("response_format", spec)] if spec is not None else []
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", structure_of(self.structured_outputs)))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                asked.append((f"guided_{kind}", structure_of({kind: value}, f"guided_{kind}")))
        if len(asked) > 1:
            raise ParameterError(asked[1][0], f"{asked[0][0]} and {asked[1][0]} both constrain the output; "
                                 "give one")
        return asked[0][1] if asked else None


# vLLM's structured_outputs keys: the kinds, switches that are what mmserve does anyway (compact
# JSON, no fallback backend, no properties beyond a schema's), and what it cannot honour
STRUCTURE_KINDS = ("json", "json_object", "regex", "choice", "grammar")
STRUCTURE_AS_DONE = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")


def structure_of(fields: Any, param: str = "structured_outputs") -> StructuredOutputsParams:
    """vLLM's `structured_outputs` object (or one `guided_*` field, as `{kind: value}`) as the
    engine's spec, checked; a `ParameterError` naming `param` otherwise."""
    from mmserve.entrypoints.openai.protocol import ParameterError

    if not isinstance(fields, dict):
        raise ParameterError(param, f"{param} must be an object with one of {', '.join(STRUCTURE_KINDS)}")
    unknown = sorted(set(fields) - set(STRUCTURE_KINDS) - set(STRUCTURE_AS_DONE))
    if unknown:
        raise ParameterError(param, f"{param}.{unknown[0]} is not supported (mmserve takes "
                             f"{', '.join(STRUCTURE_KINDS)})", code="unsupported_parameter")
    kinds = {k: v for k, v in fields.items() if k in STRUCTURE_KINDS and v is not None and v is not False}
    try:
        if set(kinds) == {"json_object"} and kinds["json_object"] is not True:
            raise ValueError("json_object must be true")
        if set(kinds) == {"json"}:
            return StructuredOutputsParams.for_schema(kinds["json"])
        return StructuredOutputsParams(**kinds)
    except (ValueError, TypeError, msgspec.ValidationError) as e:
        raise ParameterError(param, f"{param}: {e}") from None


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    from mmserve.entrypoints.openai.protocol import ParameterError

    if not bias:
        return None
    try:
        return {int(key): value for key, value in bias.items()}
    except ValueError:
        raise ParameterError("logit_bias", "logit_bias keys must be token ids (integers as strings)") from None


def check_top_logprobs(param: str, value: int | None) -> None:
    from mmserve.entrypoints.openai.protocol import ParameterError

    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ParameterError(param, f"{param} must be between 0 and {MAX_LOGPROBS}; got {value}")
