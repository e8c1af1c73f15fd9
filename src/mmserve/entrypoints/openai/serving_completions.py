"""`POST /v1/completions`: text prompts as they are (no chat template), answered whole or streamed.

The request's path is the serving base's (`serving_base.py`); only the prompts and the response
shapes are completions' own. Several prompts run as one request (`prompt_batch.py`). Streamed
chunks carry `text` per choice and, with `logprobs`, the legacy log-probability lists of that
chunk's tokens.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mmserve.cache_report import cache_headers
from mmserve.entrypoints.openai.choices import ChoiceDelta, ChoiceStream, completion_logprobs
from mmserve.entrypoints.openai.prompt_batch import merged_outputs
from mmserve.entrypoints.openai.protocol import UsageInfo
from mmserve.entrypoints.openai.protocol_completions import CompletionChoice, CompletionRequest, CompletionResponse
from mmserve.entrypoints.openai.serving_base import OpenAIServing, Outputs, ServeContext
from mmserve.frontend.request.prompt import Prompt
from mmserve.outputs import RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    """The completions handler."""

    async def create_completion(self, raw_request: Request) -> Response:
        return await self.serve(raw_request, CompletionRequest, "cmpl-", self._create)

    async def _create(self, ctx: ServeContext[CompletionRequest]) -> Response:
        request = ctx.request
        prompts = [Prompt(text, settings=ctx.settings) for text in request.prompts]
        outputs: Outputs
        if len(prompts) == 1:
            outputs = self.generate(ctx, prompts[0])
        else:
            outputs = merged_outputs(ctx.request_id, [self.generate(ctx, prompt, request_id=f"{ctx.request_id}-{p}")
                                                      for p, prompt in enumerate(prompts)], ctx.params.n)
        top = request.logprobs or 0
        include_usage = request.stream_options is not None and request.stream_options.include_usage

        def stream(first: RequestOutput) -> CompletionStream:
            return CompletionStream(ctx.request_id, ctx.model, outputs, first, ctx.record, include_usage, top)

        async def whole(final: RequestOutput) -> Response:
            choices = [CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                        logprobs=None if c.logprobs is None else
                                        completion_logprobs(c.token_ids, c.logprobs, top))
                       for c in final.outputs]
            record = ctx.record
            usage = UsageInfo.of(record.prompt_tokens, record.generation_tokens, record.cached_tokens)
            return JSONResponse(CompletionResponse(id=ctx.request_id, model=ctx.model, choices=choices,
                                                   usage=usage).model_dump(), headers=cache_headers(record.report))

        return await self.respond(ctx, outputs, stream if request.stream else None, whole)


class CompletionStream(ChoiceStream):
    """Completions chunks: per choice and step its new text (with the legacy log-probability lists
    of those tokens when asked for), the finish reason in the chunk of its last text."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
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
