"""`POST /v1/embeddings` (OpenAI's, with vLLM's multimodal chat form), for `--runner pooling`.

A body gives `input` (a text, token ids, or a list of either: OpenAI's) or vLLM's chat `messages`
(text and `image_url` / `video_url` parts, rendered by the chat template without the reply header
unless `add_generation_prompt`). Each prompt's embedding is its last token's final-normed hidden
state (`AsyncLLM.embed`), L2-normalized unless the body's `normalize` (vLLM's) or `--pooler-config`
says not; `encoding_format` "base64" gives each as the little-endian float32 bytes, base64-encoded
(OpenAI's). The answer is OpenAI's `{"object": "list", "data": [{"object": "embedding", "index",
"embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}`. The prompts run as engine
requests at once; a fault in one (a bad image, a prompt past max_model_len) is the whole request's
4xx and the others are aborted. A server started for text answers this route with a 400 naming
`--runner pooling`, and a pooling server its text routes likewise (`require_runner`).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from mmserve.entrypoints.openai.errors import OpenAIError
from mmserve.entrypoints.openai.protocol import ChatMessage, ParameterError
from mmserve.entrypoints.openai.protocol_completions import each_prompt
from mmserve.entrypoints.openai.request_ids import client_request_id
from mmserve.entrypoints.openai.serving_base import OpenAIServing
from mmserve.frontend.request.prompt import Prompt, PromptSettings
from mmserve.outputs import EmbeddingRequestOutput

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body, and vLLM's chat form and pooling fields."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None  # vLLM's: None takes --pooler-config's choice (true unless it says)
    truncate_prompt_tokens: int | None = None
    add_generation_prompt: bool = False  # vLLM's chat form: an embedding reads the conversation alone
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    priority: int = 0
    request_id: str | None = None


def require_runner(engine: Any, pooling: bool, api: str) -> None:
    """A 400 unless the server runs for `api`: embeddings need `--runner pooling`, text the other."""
    if engine.config.model.pools == pooling:
        return
    fix = "start the server with --runner pooling" if pooling else "this server runs --runner pooling (embeddings)"
    raise OpenAIError(400, f"the model does not serve the {api} API: {fix}", code="unsupported_model_task")


class OpenAIServingEmbedding(OpenAIServing):
    """The embeddings handler."""

    async def create_embedding(self, raw_request: Request) -> JSONResponse:
        require_runner(self.engine, True, "Embeddings")
        request = EmbeddingRequest.model_validate_json(await raw_request.body())
        model = self.check_model(request.model)
        if request.dimensions is not None:
            raise ParameterError("dimensions", f"dimensions {request.dimensions}: this model does not support "
                                 "Matryoshka embeddings (leave dimensions unset)", code="unsupported_parameter")
        prompts = await self._prompts(request)
        named = client_request_id(raw_request, request.request_id)
        request_id = f"embd-{named or uuid.uuid4().hex}"
        raw_request.state.request_id = request_id
        normalize = self.engine.config.model.pooling_normalize if request.normalize is None else request.normalize
        outs = await self._embed_all(request_id, prompts, normalize, request)
        # up to MAX_INPUTS vectors of the hidden size encoded: in a worker thread, not on the event loop
        return await asyncio.to_thread(_response, request_id, model, outs, request.encoding_format)

    async def _prompts(self, request: EmbeddingRequest) -> list[Prompt]:
        settings = PromptSettings(mm_processor_kwargs=request.mm_processor_kwargs)
        if (request.input is None) == (request.messages is None):
            raise ParameterError("input", "give either input or messages")
        if request.messages is not None:
            template = self.options.chat_templates.options(request.chat_template, request.chat_template_kwargs,
                                                           request.add_generation_prompt,
                                                           request.continue_final_message)
            messages = [m.model_dump(exclude_none=True) for m in request.messages]
            return [await self.engine.build_prompt(messages, None, settings, template)]
        inputs = each_prompt(request.input) if request.input else []
        if not inputs or len(inputs) > MAX_INPUTS:
            raise ParameterError("input", f"input must hold 1 to {MAX_INPUTS} texts or token lists; got {len(inputs)}")
        return [Prompt(p, settings=settings) if isinstance(p, str) else Prompt("", settings=settings, token_ids=p)
                for p in inputs]

    async def _embed_all(self, request_id: str, prompts: list[Prompt], normalize: bool,
                         request: EmbeddingRequest) -> list[EmbeddingRequestOutput]:
        """Every prompt's embedding, run at once; the first fault cancels (aborts) the others and
        is raised as it is (a client's fault stays a 4xx)."""
        tasks = [asyncio.ensure_future(self.engine.embed(f"{request_id}-{i}-{uuid.uuid4().hex[:8]}", prompt,
                                                         normalize, request.truncate_prompt_tokens, request.priority))
                 for i, prompt in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise


def _response(request_id: str, model: str, outs: list[EmbeddingRequestOutput], encoding_format: str) -> JSONResponse:
    """OpenAI's embeddings answer for `outs`, in the prompts' order."""
    data = [{"object": "embedding", "index": i, "embedding": _encoded(out, encoding_format)}
            for i, out in enumerate(outs)]
    tokens = sum(len(out.prompt_token_ids) for out in outs)
    return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()), "model": model,
                         "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _encoded(out: EmbeddingRequestOutput, encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return out.outputs.embedding
    return base64.b64encode(np.asarray(out.outputs.embedding, dtype="<f4").tobytes()).decode("ascii")
