"""The serving base: what every OpenAI endpoint does with a request around its own part.

vLLM's `serving_engine.py: OpenAIServing` gives the shape: one base owns the engine, the served
model names and the metrics, and `OpenAIServingChat`, `OpenAIServingCompletion` and
`OpenAIServingResponses` subclass it, keeping only their request and response shapes.
- `serve`: the preamble (the body parsed into the endpoint's request type, the model checked, the
  parameters checked, the checkpoint's generation-config defaults under the request's own values
  in `SamplingParams`, the request's `PromptSettings`) into a `ServeContext`, and the request counted
  once in /metrics however it ends (`RequestRecord`).
- `start_chat`: a conversation rendered into the request's one `Prompt` (a forced tool call becomes
  the grammar; with a reasoning parser a grammar binds after the thinking) and started; `generate`
  starts any prompt with the request's routing.
- `respond`: the first output awaited, then the rest streamed (`streaming.py: SSEResponse`) or
  awaited and answered whole. The engine generator is closed however the request ends, which aborts
  it in the engine core if still running. Errors before the first output are HTTP errors (4xx /
  503); once a stream has started they are an SSE `error` event followed by `[DONE]` (`ChoiceStream`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncGenerator, Awaitable, Callable, Generic, Protocol, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import Response

from mmserve import beam_search
from mmserve.cache_report import cache_headers
from mmserve.errors import SchemaError
from mmserve.entrypoints.openai.errors import OpenAIError
from mmserve.entrypoints.openai.protocol import ParameterError
from mmserve.entrypoints.openai.reasoning import thinking_token_ids
from mmserve.entrypoints.openai.request_ids import client_request_id
from mmserve.entrypoints.openai.request_record import RequestRecord, outcome_of
from mmserve.entrypoints.openai.streaming import EventStream, SSEResponse
from mmserve.entrypoints.openai.tool_calls import ToolMode
from mmserve.frontend.request.prompt import Prompt, PromptSettings
from mmserve.metrics import ServerMetrics
from mmserve.multimodal.chat_templates import ChatTemplateOptions, ChatTemplatePolicy
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import BeamSearchParams, SamplingParams
from mmserve.structured_outputs import check_structure

if TYPE_CHECKING:
    from mmserve.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

Outputs = AsyncGenerator[RequestOutput, None]


class OpenAIRequest(Protocol):
    """What the preamble asks of an endpoint's request body (`protocol*.py`)."""

    model: str | None
    stream: bool | None
    priority: int | None  # vLLM's: the lower, the sooner (--scheduling-policy priority)

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray) -> Any: ...

    def check_supported(self) -> None: ...

    def unknown_fields(self) -> list[str]: ...

    def to_sampling_params(self, default_max_tokens: int, defaults: dict[str, Any] | None = None
                           ) -> SamplingParams: ...

    def prompt_settings(self) -> PromptSettings: ...

    def structure_param(self) -> str | None: ...


R = TypeVar("R", bound=OpenAIRequest)


@dataclass
class ServeContext(Generic[R]):
    """One request past the preamble, as its endpoint serves it (vLLM's name)."""

    raw_request: Request
    request: R
    request_id: str  # the answer's id: the endpoint's prefix and the client's id (`client_request_id`) or a fresh one
    model: str  # the served model name to answer with
    params: SamplingParams  # the request's values over the checkpoint's generation-config defaults
    settings: PromptSettings
    record: RequestRecord
    engine_id: str  # the engine's id of the request: `request_id`, made unique when the client named it

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)

    def routing(self) -> dict[str, Any]:
        """How the engine places and orders the request: `stream` (a whole answer can start over on
        another rank until its end), the rank an `X-Data-Parallel-Rank` header forces, and its
        `priority` (`--scheduling-policy priority`)."""
        routing = {"stream": self.stream, "priority": self.request.priority or 0}
        header = self.raw_request.headers.get("x-data-parallel-rank")
        if header is None:
            return routing
        if not header.strip().isdigit():
            raise ParameterError("X-Data-Parallel-Rank", f"the X-Data-Parallel-Rank header must be a rank number; "
                                 f"got {header!r}")
        return {**routing, "data_parallel_rank": int(header)}


@dataclass(frozen=True)
class ServingOptions:
    """What the server's flags decide for every answer; the defaults are a plain `mmserve serve`'s."""

    auto_tool_parser: str | None = None  # tool_choice "auto" enabled with this parser
    chat_templates: ChatTemplatePolicy = field(default_factory=ChatTemplatePolicy)  # the --chat-template flags
    reasoning_parser: str | None = None  # a reasoning model's thinking answered apart (reasoning.py)
    tokens_as_ids: bool = False  # --return-tokens-as-token-ids: log probabilities name tokens "token_id:N"
    force_usage: bool = False  # --enable-force-include-usage: every stream ends with its usage


class OpenAIServing:
    """The base of the OpenAI handlers over an `AsyncLLM`-like engine."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], metrics: ServerMetrics,
                 options: ServingOptions | None = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.metrics = metrics
        self.options = options or ServingOptions()
        self._thinking_ids: tuple[int, int] | None | bool = False  # False: not looked up yet

    def thinking_ids(self) -> tuple[int, int] | None:
        """With a reasoning parser, the `<think>` and `</think>` ids when each is one token (then a
        grammar binds after the thinking); else None."""
        if self._thinking_ids is False:
            self._thinking_ids = None if self.options.reasoning_parser is None else \
                thinking_token_ids(getattr(self.engine, "tokenizer", None))
        return None if isinstance(self._thinking_ids, bool) else self._thinking_ids

    def splits_thinking(self, ctx: ServeContext[Any], tools: ToolMode | None) -> bool:
        """Whether a chat-path answer's thinking is split off: a reasoning parser is on, and the
        answer is free or its grammar binds after the thinking (`thinking_ids`; otherwise a
        structured or forced-tool answer is the grammar's from its first token)."""
        free = ctx.params.structured_outputs is None and not (tools is not None and tools.forced)
        return self.options.reasoning_parser is not None and (free or self.thinking_ids() is not None)

    async def serve(self, raw_request: Request, request_type: type[R], id_prefix: str,
                    handler: Callable[[ServeContext[R]], Awaitable[Response]]) -> Response:
        """Run the preamble, then `handler`; every exception is counted as an error (abort if
        cancelled) and re-raised."""
        record = RequestRecord(self.metrics, time.perf_counter())
        try:
            return await handler(await self._preamble(raw_request, request_type, id_prefix, record))
        except asyncio.CancelledError:
            record.finish("abort")
            raise
        except BaseException:
            record.finish("error")
            raise

    async def _preamble(self, raw_request: Request, request_type: type[R], id_prefix: str,
                        record: RequestRecord) -> ServeContext[R]:
        request: R = request_type.model_validate_json(await raw_request.body())
        model = self.check_model(request.model)
        request.check_supported()
        named = client_request_id(raw_request, getattr(request, "request_id", None))
        request_id = f"{id_prefix}{named or uuid.uuid4().hex}"
        # two requests may carry one client id: the engine's ids stay unique
        engine_id = request_id if named is None else f"{request_id}-{uuid.uuid4().hex[:8]}"
        raw_request.state.request_id = named or request_id  # for --enable-request-id-headers
        if request.unknown_fields():
            logger.warning("request %s: ignoring unknown field(s): %s", request_id,
                           ", ".join(request.unknown_fields()))
        defaults = self.engine.generation_defaults  # the engine stops at max_model_len
        params = request.to_sampling_params(defaults.max_tokens(self.engine.max_model_len), defaults.request_defaults)
        if params.structured_outputs is not None:  # xgrammar's verdict, named by field, off the event loop
            try:
                await asyncio.to_thread(check_structure, params.structured_outputs)
            except SchemaError as e:
                param = request.structure_param() or "response_format"
                raise ParameterError(param, f"{param}: {e}") from None
        record.params = params
        return ServeContext(raw_request, request, request_id, model, params, request.prompt_settings(), record,
                            engine_id)

    def check_model(self, name: str | None) -> str:
        """The model name to answer with; a 404 for a name this server does not serve."""
        if name is None:
            return self.served_model_names[0]
        if name not in self.served_model_names:
            raise model_not_found(name, self.served_model_names)
        return name

    async def start_chat(self, ctx: ServeContext[Any], messages: list[dict[str, Any]], tools: ToolMode | None,
                         tool_specs: list[dict[str, Any]] | None, format_param: str = "response_format",
                         template: ChatTemplateOptions | None = None) -> Outputs:
        """Start a conversation, as chat and responses both do: a forced tool call becomes the
        grammar (refused next to another structure, named by `format_param`), the chat template
        renders the messages with `tool_specs` into the request's prompt as `template` says (None:
        the server's template, ending with the reply prompt). Returns the engine's outputs."""
        params = ctx.params
        if tools is not None and tools.forced:
            if params.structured_outputs is not None:
                raise ParameterError(format_param, f"{format_param} cannot be combined with a forced tool call")
            params = msgspec.structs.replace(params, structured_outputs=tools.structured())
        after_thinking = self.thinking_ids()
        if params.structured_outputs is not None and after_thinking is not None:
            params = msgspec.structs.replace(params, structured_outputs=msgspec.structs.replace(
                params.structured_outputs, after_thinking=after_thinking))
        prompt = await self.engine.build_prompt(messages, tool_specs, ctx.settings,
                                                template or self.options.chat_templates.options())
        return self.generate(ctx, prompt, params)

    def generate(self, ctx: ServeContext[Any], prompt: Prompt, params: SamplingParams | None = None,
                 request_id: str | None = None) -> Outputs:
        """The engine's outputs for `prompt`, routed as the request asks (`ServeContext.routing`);
        with vLLM's `use_beam_search`, the n best beams as one last output (`beam_search.serve`)."""
        params = params or ctx.params
        if getattr(ctx.request, "use_beam_search", False):
            if params.structured_outputs is not None:
                raise ParameterError("use_beam_search", "use_beam_search cannot answer a forced tool call")
            beams = BeamSearchParams(params.n, params.max_tokens, params.ignore_eos,
                                     length_penalty=ctx.request.length_penalty or 1.0)
            return beam_search.serve(self.engine, request_id or ctx.engine_id, prompt, beams, **ctx.routing())
        return self.engine.generate(request_id or ctx.engine_id, prompt, params, **ctx.routing())

    async def respond(self, ctx: ServeContext[Any], outputs: Outputs,
                      stream: Callable[[RequestOutput], EventStream] | None,
                      whole: Callable[[RequestOutput], Awaitable[Response]]) -> Response:
        """Await the first output; then hand the rest to `stream(first)`'s SSE response or await the
        last output and answer `whole(final)`. `outputs` is closed unless a stream took it."""
        handed_over = False
        try:
            first = await first_output(outputs)
            ctx.record.observe(first)
            if stream is not None:
                events = stream(first)
                handed_over = True
                return SSEResponse(events, cache_headers(ctx.record.report))
            final = await last_output(outputs, first, ctx.record)
        finally:
            if not handed_over:
                await outputs.aclose()
        return await whole(final)


def model_not_found(name: str, served_model_names: list[str]) -> OpenAIError:
    """The 404 for a model name this server does not serve, naming those it does."""
    return OpenAIError(404, f"the model {name!r} does not exist; this server serves "
                       f"{', '.join(map(repr, served_model_names))}", code="model_not_found", param="model")


async def first_output(outputs: Outputs) -> RequestOutput:
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        raise RuntimeError("the engine ended a request without any output") from None


async def last_output(outputs: Outputs, first: RequestOutput, record: RequestRecord) -> RequestOutput:
    """Wait for the request's last output (observed in `record`, counted as its outcome)."""
    final = first
    async for out in outputs:
        record.observe(out)
        final = out
    record.finish(outcome_of(final))
    return final
