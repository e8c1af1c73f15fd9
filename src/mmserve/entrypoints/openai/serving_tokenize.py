"""`POST /tokenize` and `POST /detokenize` (vLLM's routes): the prompt tokens a request would run.

`/tokenize` takes a completions-style `prompt` or chat `messages` (with vLLM's chat-template
fields, tools and `mm_processor_kwargs`) and answers `{"count", "max_model_len", "tokens",
"token_strs"}`. The tokens are the engine's: the prompt goes through the same input processor as a
request (a message's image counts as its placeholder tokens, at the size the processor gives it;
the processed image joins the processor cache, so the request that follows finds it there), so
`count` equals the `usage.prompt_tokens` of the same request. A prompt past max_model_len is the
same 400 as its request. `/detokenize` decodes token ids (`{"tokens"}` -> `{"prompt"}`), at most
max_model_len of them.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from mmserve.entrypoints.openai.protocol import ChatMessage, ParameterError
from mmserve.entrypoints.openai.serving_base import OpenAIServing
from mmserve.frontend.request.prompt import Prompt, PromptSettings
from mmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mmserve.frontend.async_llm import AsyncLLM


class TokenizeRequest(BaseModel):
    """A `prompt`, or chat `messages` with the chat request's template fields."""

    model_config = ConfigDict(extra="allow")  # add_special_tokens and the like: the engine's own choice stands
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class OpenAIServingTokenization(OpenAIServing):
    """The tokenize and detokenize handlers."""

    async def tokenize(self, raw_request: Request) -> JSONResponse:
        request = TokenizeRequest.model_validate_json(await raw_request.body())
        self.check_model(request.model)
        prompt = await self._prompt(request)
        tokens = await tokenize(self.engine, prompt)
        strs = None
        if request.return_token_strs:
            strs = await asyncio.to_thread(self.engine.tokenizer.convert_ids_to_tokens, tokens)
        return JSONResponse({"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens,
                             "token_strs": strs})

    async def detokenize(self, raw_request: Request) -> JSONResponse:
        request = DetokenizeRequest.model_validate_json(await raw_request.body())
        self.check_model(request.model)
        if len(request.tokens) > self.engine.max_model_len:  # no sequence of this model is longer
            raise ParameterError("tokens", f"{len(request.tokens)} tokens: more than max_model_len "
                                 f"({self.engine.max_model_len})")
        vocab = self.engine.input_processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise ParameterError("tokens", f"tokens {bad[:3]} are not token ids of this model (vocabulary of {vocab})")
        text = await asyncio.to_thread(self.engine.tokenizer.decode, request.tokens)
        return JSONResponse({"prompt": text})

    async def _prompt(self, request: TokenizeRequest) -> Prompt:
        settings = PromptSettings(mm_processor_kwargs=request.mm_processor_kwargs)
        if (request.prompt is None) == (request.messages is None):
            raise ParameterError("prompt", "give either prompt or messages")
        if request.prompt is not None:
            return Prompt(request.prompt, settings=settings)
        template = self.options.chat_templates.options(request.chat_template, request.chat_template_kwargs,
                                               request.add_generation_prompt is not False,
                                               bool(request.continue_final_message))
        messages = [m.model_dump(exclude_none=True) for m in request.messages or []]
        return await self.engine.build_prompt(messages, request.tools, settings, template)


async def tokenize(engine: AsyncLLM, prompt: Prompt) -> list[int]:
    """The prompt tokens the engine would run for `prompt` (its input processor, in a worker thread)."""
    processed = await asyncio.to_thread(engine.input_processor.process, f"tokenize-{uuid.uuid4().hex}", prompt,
                                        SamplingParams(max_tokens=1))
    return processed.prompt_token_ids
