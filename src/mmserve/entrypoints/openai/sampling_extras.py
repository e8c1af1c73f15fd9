"""Request fields shared by chat and completions beyond the basic sampling ones: penalties,
`min_tokens`, `logit_bias` and `response_format` (OpenAI's names, vLLM's extras), and their
translation into `SamplingParams` values. A bad value is a `ParameterError` naming the field
(imported where raised: protocol.py builds its request bodies on `SamplingExtras`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mmserve.sampling_params import MAX_LOGPROBS
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


class SamplingExtras(BaseModel):
    """Fields both request bodies take; `extra_sampling_values` gives their `SamplingParams` values."""

    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    min_p: float | None = None  # vLLM's
    min_tokens: int | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None  # token id (as a string, as JSON keys are) -> bias
    response_format: ResponseFormat | None = None

    def extra_sampling_values(self) -> dict[str, Any]:
        values: dict[str, Any] = {"presence_penalty": self.presence_penalty,
                                  "frequency_penalty": self.frequency_penalty,
                                  "repetition_penalty": self.repetition_penalty, "min_tokens": self.min_tokens,
                                  "min_p": self.min_p,
                                  "logit_bias": _token_bias(self.logit_bias)}
        if self.response_format is not None:
            values["structured_outputs"] = self.response_format.to_structured_outputs()
        return {k: v for k, v in values.items() if v is not None}


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
