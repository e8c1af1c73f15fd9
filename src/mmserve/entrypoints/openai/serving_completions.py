"""`POST /v1/completions`: text prompts as they are (no chat template), answered whole or streamed.

The request path is the chat handler's (`serving_chat.py`: model check, the engine generator closed
however the request ends, errors before the first output as HTTP errors, after it as an SSE error
event); only the body and the response shapes differ. Streamed chunks carry `text` per choice and,
with `logprobs`, the legacy log-probability lists of that chunk's tokens.
"""

from __future__ import annotations

import logging
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mmserve.entrypoints.openai.choices import ChoiceDelta, ChoiceStream, completion_logprobs
from mmserve.cache_report import cache_headers
from mmserve.entrypoints.openai.protocol import UsageInfo
from mmserve.entrypoints.openai.prompt_batch import merged_outputs
from mmserve.entrypoints.openai.protocol_completions import CompletionChoice, CompletionRequest, CompletionResponse
from mmserve.entrypoints.openai.routing import routing
from mmserve.entrypoints.openai.serving_chat import OpenAIServingChat, RequestRecord, first_output, last_output
from mmserve.entrypoints.openai.streaming import SSEResponse

logger = logging.getLogger(__name__)


class OpenAIServingCompletion(OpenAIServingChat):
    """The completions handler; shares the chat handler's engine, names, metrics and model check."""

    async def create_completion(self, raw_request: Request) -> Response:
        return await self.recorded(self._create_completion, raw_request)

    async def _create_completion(self, raw_request: Request, record: RequestRecord) -> Response:
        request = CompletionRequest.model_validate_json(await raw_request.body())
        model = self.check_model(request.model)
        request.check_supported()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if request.unknown_fields():
            logger.warning("request %s: ignoring unknown field(s): %s", request_id, ", ".join(request.unknown_fields()))
        defaults = self.engine.generation_defaults
        params = request.to_sampling_params(defaults.max_tokens(self.engine.max_model_len), defaults.request_defaults)
        prompts: list[str | dict] = [text if request.cache_salt is None else
                                     {"prompt": text, "cache_salt": request.cache_salt} for text in request.prompts]
        route = routing(raw_request, bool(request.stream))
        if len(prompts) == 1:
            outputs = self.engine.generate(request_id, prompts[0], params, **route)
        else:
            outputs = merged_outputs(request_id, [self.engine.generate(f"{request_id}-{p}", prompt, params, **route)
                                                  for p, prompt in enumerate(prompts)], params.n)
        handed_over = False
        try:
            first = await first_output(outputs)
            record.observe(first)
            top = request.logprobs or 0
            if request.stream:
                include_usage = request.stream_options is not None and request.stream_options.include_usage
                stream = CompletionStream(request_id, model, outputs, first, record, include_usage, top)
                handed_over = True
                return SSEResponse(stream, cache_headers(record.report))
            final = await last_output(outputs, first, record)
            choices = [CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                        logprobs=None if c.logprobs is None else
                                        completion_logprobs(c.token_ids, c.logprobs, top))
                       for c in final.outputs]
            usage = UsageInfo.of(record.prompt_tokens, record.generation_tokens, record.cached_tokens)
            return JSONResponse(CompletionResponse(id=request_id, model=model, choices=choices,
                                                   usage=usage).model_dump(), headers=cache_headers(record.report))
        finally:
            if not handed_over:
                await outputs.aclose()


class CompletionStream(ChoiceStream):
    """Completions chunks: per choice and step its new text (with the legacy log-probability lists
    of those tokens when asked for), the finish reason in the chunk of its last text."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, int] = {}  # characters sent per choice, for text_offset

    def _delta(self, d: ChoiceDelta) -> list[str]:
        offset = self._offsets.get(d.index, 0)
        self._offsets[d.index] = offset + len(d.text)
        logprobs = None if d.logprobs is None else completion_logprobs(d.token_ids, d.logprobs, self.top_logprobs,
                                                                      offset)
        return [self._encode([CompletionChoice(index=d.index, text=d.text, logprobs=logprobs,
                                               finish_reason=d.finish_reason)], None)]

    def _usage(self, usage: UsageInfo) -> str:
        return self._encode([], usage)

    def _encode(self, choices: list[CompletionChoice], usage: UsageInfo | None) -> str:
        body = CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage).model_dump()
        if not self.include_usage:
            del body["usage"]
        return f"data: {bytes(JSONResponse(body).body).decode()}\n\n"
