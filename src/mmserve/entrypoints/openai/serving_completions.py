"""`POST /v1/completions`: text prompts as they are (no chat template), answered whole or streamed.

The request's path is the serving base's (`serving_base.py`); only the prompts and the response
shapes are completions' own. Several prompts run as one request (`prompt_batch.py`). Streamed
chunks carry `text` per choice and, with `logprobs`, the legacy log-probability lists of that
chunk's tokens. With `echo` (`Echo`) each choice's first text is its prompt's, and with `logprobs`
its first lists are its prompt tokens' (the engine scores them: `SamplingParams.prompt_logprobs`).
"""

from __future__ import annotations

from typing import Any, AsyncGenerator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mmserve.cache_report import cache_headers
from mmserve.entrypoints.openai.choices import (ChoiceDelta, ChoiceStream, StreamUsage, completion_logprobs,
                                                drop_unasked, prompt_logprobs_json)
from mmserve.entrypoints.openai.prompt_batch import merged_outputs
from mmserve.entrypoints.openai.protocol import UsageInfo
from mmserve.entrypoints.openai.protocol_completions import CompletionChoice, CompletionRequest, CompletionResponse
from mmserve.entrypoints.openai.serving_base import OpenAIServing, Outputs, ServeContext
from mmserve.frontend.request.prompt import Prompt
from mmserve.outputs import Logprob, RequestOutput, SampleLogprobs


class OpenAIServingCompletion(OpenAIServing):
    """The completions handler."""

    def _text(self, token_ids: list[int]) -> str:
        """Token ids' text, special tokens kept (an echoed prompt of token ids, as vLLM decodes it)."""
        tokenizer = getattr(self.engine, "tokenizer", None)
        return "" if tokenizer is None else tokenizer.decode(token_ids, skip_special_tokens=False)

    async def create_completion(self, raw_request: Request) -> Response:
        return await self.serve(raw_request, CompletionRequest, "cmpl-", self._create)

    async def _create(self, ctx: ServeContext[CompletionRequest]) -> Response:
        request = ctx.request
        prompts = [Prompt(p, settings=ctx.settings) if isinstance(p, str) else
                   Prompt("", settings=ctx.settings, token_ids=p) for p in request.prompts]
        echo = None
        if request.echo or ctx.params.prompt_logprobs is not None or request.return_token_ids:
            echo = Echo(request.prompts, ctx.params.n, self._text, bool(request.echo), request.echo_only)
        runs = [self.generate(ctx, prompt, request_id=None if len(prompts) == 1 else f"{ctx.engine_id}-{p}")
                for p, prompt in enumerate(prompts)]
        if echo is not None:
            runs = [echo.tap(p, run) for p, run in enumerate(runs)]
        outputs = runs[0] if len(runs) == 1 else merged_outputs(ctx.request_id, runs, ctx.params.n)
        top = request.logprobs or 0
        usage = StreamUsage.of(request.stream_options, self.options.force_usage)
        as_ids = request.tokens_as_ids(self.options.tokens_as_ids)

        def stream(first: RequestOutput) -> CompletionStream:
            return CompletionStream(ctx.request_id, ctx.model, outputs, first, ctx.record, usage, top, as_ids,
                                    echo=echo, token_ids=bool(request.return_token_ids))

        async def whole(final: RequestOutput) -> Response:
            choices = []
            for c in final.outputs:
                text, token_ids = c.text, c.token_ids
                own_ids = [] if request.echo_only else list(token_ids)
                logprobs: list[dict[int, Logprob] | None] | None = None if c.logprobs is None else list(c.logprobs)
                if echo is not None and echo.echo:
                    text, token_ids, logprobs = echo.before(c.index, text, token_ids, c.logprobs)
                choices.append(CompletionChoice(
                    index=c.index, text=text, finish_reason=c.finish_reason,
                    logprobs=None if logprobs is None else completion_logprobs(
                        token_ids, logprobs, top, text_of=None if echo is None else echo.text_of, as_ids=as_ids),
                    prompt_logprobs=None if echo is None else echo.prompt_logprobs(c.index),
                    prompt_token_ids=echo.prompt_ids(c.index) if request.return_token_ids and echo else None,
                    token_ids=own_ids if request.return_token_ids else None))
            record = ctx.record
            generated = 0 if request.echo_only else record.generation_tokens
            usage = UsageInfo.of(record.prompt_tokens, generated, record.cached_tokens)
            body = drop_unasked(CompletionResponse(id=ctx.request_id, model=ctx.model, choices=choices,
                                                   usage=usage).model_dump())
            return JSONResponse(body, headers=cache_headers(record.report))

        return await self.respond(ctx, outputs, stream if request.stream else None, whole)


class Echo:
    """What a choice shows of its prompt: with `echo` its text, tokens and log probabilities before
    the choice's own (`before`), and vLLM's `prompt_logprobs`. `tap` each prompt's engine outputs
    (their first carries the prompt's ids and log probabilities); choice i is prompt i // n's.
    `decode` gives token ids' text: a prompt of token ids, echoed (decoded once its request was
    accepted, so within max_model_len), and a token's alone (the prompt's first has no entry).
    `only`: the prompt alone is answered (`CompletionRequest.echo_only`): the choice's own tokens
    are dropped."""

    def __init__(self, prompts: list[str | list[int]], n: int, decode: Callable[[list[int]], str], echo: bool = True,
                 only: bool = False) -> None:
        self.prompts = prompts
        self.n = n
        self.decode = decode
        self.echo = echo
        self.only = only
        self.outputs: list[RequestOutput | None] = [None] * len(prompts)

    async def tap(self, p: int, run: Outputs) -> AsyncGenerator[RequestOutput, None]:
        try:
            async for out in run:
                self.outputs[p] = out
                yield out
        finally:
            await run.aclose()

    def text_of(self, token_id: int) -> str:
        return self.decode([token_id])

    def prompt_text(self, p: int) -> str:
        """Prompt `p`'s text (a prompt of token ids decoded the first time)."""
        prompt = self.prompts[p]
        if not isinstance(prompt, str):
            prompt = self.prompts[p] = self.decode(prompt)
        return prompt

    def prompt_ids(self, index: int) -> list[int] | None:
        """Choice `index`'s prompt's token ids, once its first output came."""
        out = self.outputs[index // self.n]
        return None if out is None else list(out.prompt_token_ids)

    def prompt_logprobs(self, index: int) -> list[dict[str, Any] | None] | None:
        """Choice `index`'s prompt's `prompt_logprobs` (vLLM's shape), when the engine scored it."""
        out = self.outputs[index // self.n]
        return None if out is None or out.prompt_logprobs is None else prompt_logprobs_json(out.prompt_logprobs)

    def before(self, index: int, text: str, token_ids: list[int], logprobs: SampleLogprobs | None
               ) -> tuple[str, list[int], list[dict[int, Logprob] | None] | None]:
        """Choice `index`'s text, tokens and log probabilities with its prompt's before them (log
        probabilities when both were asked for and the prompt's came)."""
        p = index // self.n
        out = self.outputs[p]
        if self.only:
            text, token_ids, logprobs = "", [], None if logprobs is None else []
        if logprobs is None or out is None or out.prompt_logprobs is None:
            return self.prompt_text(p) + text, token_ids, None if logprobs is None else list(logprobs)
        return self.prompt_text(p) + text, out.prompt_token_ids + token_ids, [*out.prompt_logprobs, *logprobs]


class CompletionStream(ChoiceStream):
    """Completions chunks: per choice and step its new text (with the legacy log-probability lists
    of those tokens when asked for), the finish reason in the chunk of its last text; with `echo`,
    a choice's first chunk begins with its prompt."""

    def __init__(self, *args: Any, echo: Echo | None = None, token_ids: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo
        self.token_ids = token_ids  # vLLM's return_token_ids: a choice's prompt ids first, then each chunk's tokens
        self._offsets: dict[int, int] = {}  # characters sent per choice, for text_offset

    def _delta(self, d: ChoiceDelta) -> list[str]:
        first = d.index not in self._offsets
        prompt_ids = self.echo.prompt_ids(d.index) if self.token_ids and first and self.echo is not None else None
        generated = d.token_ids if self.token_ids else None
        entries: list[dict[int, Logprob] | None] | None = None if d.logprobs is None else list(d.logprobs)
        if self.echo is not None and self.echo.echo and first:
            d.text, d.token_ids, entries = self.echo.before(d.index, d.text, d.token_ids, d.logprobs)
        if self.echo is not None and self.echo.only:  # the prompt alone: nothing of the choice's own
            generated = [] if generated is not None else None
            if not first:
                d.text, d.token_ids, entries = "", [], None if entries is None else []
        offset = self._offsets.get(d.index, 0)
        self._offsets[d.index] = offset + len(d.text)
        text_of = None if self.echo is None else self.echo.text_of
        logprobs = None if entries is None else completion_logprobs(d.token_ids, entries, self.top_logprobs,
                                                                    offset, text_of, self.as_ids)
        return [self._encode([CompletionChoice(index=d.index, text=d.text, logprobs=logprobs,
                                               finish_reason=d.finish_reason, prompt_token_ids=prompt_ids,
                                               token_ids=generated)], None)]

    def _counts(self) -> UsageInfo:
        if self.echo is not None and self.echo.only:  # the sampled token was dropped
            return UsageInfo.of(self.record.prompt_tokens, 0, self.record.cached_tokens)
        return super()._counts()

    def _usage(self, usage: UsageInfo) -> str:
        return self._encode([], usage)

    def _encode(self, choices: list[CompletionChoice], usage: UsageInfo | None) -> str:
        body = self._with_usage(drop_unasked(CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage).model_dump()))
        return f"data: {bytes(JSONResponse(body).body).decode()}\n\n"
