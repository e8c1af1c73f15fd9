"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Requests accept fields mmserve does not know (`extra="allow"`): they are ignored and named in one
warning per request, as vLLM does. Parameters it knows but cannot honour (tool calling) are
refused with a 400 naming the parameter rather than ignored. Penalties, `min_tokens`, `logit_bias`
and `response_format` come from `sampling_extras.SamplingExtras`, shared with completions.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from mmserve.errors import ClientError
from mmserve.entrypoints.openai.sampling_extras import SamplingExtras, check_top_logprobs
from mmserve.frontend.request.prompt import PromptSettings
from mmserve.multimodal.chat_templates import ChatTemplateOptions, ChatTemplatePolicy
from mmserve.sampling_params import SamplingParams


class ParameterError(ClientError):
    """A request parameter mmserve refuses (a 400 whose body names `param`)."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message, param=param, code=code)


# Union members are picked by a discriminator, so a bad value gets one error naming one member.
# Their tags start with UNION_TAG so that error locations can drop them (see errors.py).
UNION_TAG = "#"


TEXT, PARTS, IMAGE_URL = UNION_TAG + "text", UNION_TAG + "parts", UNION_TAG + "image_url"
VIDEO_URL = UNION_TAG + "video_url"


def _content_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return TEXT
    if isinstance(value, list):
        return PARTS
    return None


def _part_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return UNION_TAG + kind if kind in ("text", "image_url", "video_url") else None


# ---- requests --------------------------------------------------------------------------------


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="allow")
    url: str | None = None  # may be left out when the part's uuid names an image sent before
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(BaseModel):
    """An image by URL (data:, file:// or http(s)); `uuid` names the item instead of hashing it,
    and alone (no url) reuses an image sent before under that uuid."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url"]
    image_url: ImageURL | None = None
    uuid: str | None = None

    @model_validator(mode="after")
    def _url_or_uuid(self) -> ImageURLPart:
        if (self.image_url is None or not self.image_url.url) and not self.uuid:
            raise ClientError("an image_url part needs image_url.url (or a uuid naming an image sent before)")
        return self


class VideoURLPart(BaseModel):
    """A video by URL (data:, file:// or http(s)), as vLLM has it; `uuid` as for images."""

    model_config = ConfigDict(extra="allow")
    type: Literal["video_url"]
    video_url: ImageURL | None = None
    uuid: str | None = None

    @model_validator(mode="after")
    def _url_or_uuid(self) -> VideoURLPart:
        if (self.video_url is None or not self.video_url.url) and not self.uuid:
            raise ClientError("a video_url part needs video_url.url (or a uuid naming a video sent before)")
        return self


ContentPart = Annotated[
    Annotated[TextPart, Tag(TEXT)] | Annotated[ImageURLPart, Tag(IMAGE_URL)]
    | Annotated[VideoURLPart, Tag(VIDEO_URL)],
    Discriminator(_part_kind, custom_error_type="invalid_part",
                  custom_error_message="a content part's type must be 'text', 'image_url' or 'video_url'"),
]
MessageContent = Annotated[
    Annotated[str, Tag(TEXT)] | Annotated[list[ContentPart], Tag(PARTS)],
    Discriminator(_content_kind, custom_error_type="invalid_content",
                  custom_error_message="content must be a string or a list of content parts"),
]


class ChatMessage(BaseModel):
    """One message; the role's allowed values are checked when the prompt is built."""

    model_config = ConfigDict(extra="allow")  # tool_calls, tool_call_id, name: checked in frontend/request/chat.py
    role: str
    content: MessageContent | None = None  # None: an assistant turn that only calls tools


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: every chunk carries the usage so far


class ChatCompletionRequest(SamplingExtras):
    """`POST /v1/chat/completions` body: OpenAI's fields plus vLLM's sampling extras."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # None: the first served model name
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool | None = False  # every optional field also takes null, as some clients send it
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: Any = None  # a string or a list of strings (checked below, for a one-line error)
    seed: int | None = None
    cache_salt: str | None = None  # isolates this tenant in every cache (vLLM's name)
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's: this request's min_pixels / max_pixels
    media_io_kwargs: dict[str, Any] | None = None  # vLLM's: {"video": {"fps": ..., "num_frames": ...}}
    n: int | None = 1
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # function tools (entrypoints/openai/tool_calls.py)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras
    add_generation_prompt: bool | None = True  # the template's assistant header ends the prompt
    continue_final_message: bool | None = False  # the prompt ends inside the last message: the model continues it
    chat_template: str | None = None  # a template of the request's own (with --trust-request-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None  # template variables, e.g. {"add_vision_id": true}
    echo: bool | None = False  # the answer starts with the last message's text when that is the assistant's
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ClientError("stop must be a string or a list of strings")

    def check_supported(self) -> None:
        """Raise `ParameterError` naming the first parameter mmserve cannot honour."""
        check_top_logprobs("top_logprobs", self.top_logprobs)
        self.check_prompt_logprobs(self.stream)
        self.check_beam_search(self.stream, bool(self.logprobs))
        if self.top_logprobs is not None and not self.logprobs:
            raise ParameterError("top_logprobs", "top_logprobs needs logprobs to be true")
        if self.stream_options is not None and not self.stream:
            raise ParameterError("stream_options", "stream_options is only allowed when stream is true")

    def unknown_fields(self) -> list[str]:
        """Names of the body's top-level fields mmserve ignores."""
        return sorted(self.model_extra or {})

    def to_sampling_params(self, default_max_tokens: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The engine's sampling parameters; ValueError for a bad value. `defaults` (the checkpoint's
        generation config, `GenerationDefaults.request_defaults`) fill the fields the request leaves unset."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        values: dict[str, Any] = {
            "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens, "n": self.n,
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            **self.extra_sampling_values(),
        }
        return SamplingParams(**{**(defaults or {}), **{k: v for k, v in values.items() if v is not None}})

    def prompt_settings(self) -> PromptSettings:
        return PromptSettings(self.cache_salt, self.mm_processor_kwargs, self.media_io_kwargs)

    def template_options(self, policy: ChatTemplatePolicy) -> ChatTemplateOptions:
        """How the template renders this request's messages, under the server's `policy`."""
        return policy.options(self.chat_template, self.chat_template_kwargs,
                              self.add_generation_prompt is not False, bool(self.continue_final_message))

    def echoed(self) -> str:
        """What `echo` puts before the answer: the last message's text when it is an assistant's
        (a prefilled answer continued), else nothing (vLLM's rule)."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant" or last.content is None:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "".join(part.text for part in last.content if isinstance(part, TextPart))

    def messages_as_dicts(self) -> list[dict[str, Any]]:
        """The messages as plain OpenAI-style dicts, for `AsyncLLM.build_prompt`."""
        return [m.model_dump(exclude_none=True) for m in self.messages]


def _unsupported(param: str, message: str) -> None:
    raise ParameterError(param, message, code="unsupported_parameter")


# ---- responses -------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # a reasoning model's thinking (--reasoning-parser; vLLM's name)
    tool_calls: list[dict[str, Any]] | None = None  # [{"id", "type": "function", "function": {"name", "arguments"}}]


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None  # {"content": [...]} (choices.py: chat_logprobs)
    finish_reason: str | None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when asked (choices.py)
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # [{"index", "id"?, "type"?, "function": {...}}]


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the chunk's new tokens


class ChatCompletionStreamResponse(BaseModel):
    """One SSE chunk; `usage` is set (null but present) on every chunk when usage was asked for."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids: in the first chunk


class ErrorInfo(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "code", "param"}}`."""

    error: ErrorInfo
