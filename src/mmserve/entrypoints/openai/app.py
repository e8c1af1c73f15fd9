"""The OpenAI-compatible HTTP app (P0's FastAPI app over an `AsyncLLM`), as `api_server.py` serves it.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses` (text: the default
runner), `POST /v1/embeddings` (`--runner pooling`: `serving_embedding.py`), `GET /v1/models`
(behind the API key when one is set), vLLM's `/tokenize` and `/detokenize` (behind it too), and
`server_routes.py`'s `/health` (200 while the engine core lives, else 503), `/ping`, `/version`
and `/metrics`.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from mmserve.entrypoints.openai.access_log import AccessLogMiddleware
from mmserve.entrypoints.openai.body_limit import BodyLimitMiddleware, default_body_limit
from mmserve.entrypoints.openai.dev_routes import cache_reset_routes, dev_mode
from mmserve.entrypoints.openai.errors import OpenAIError, install_error_handlers
from mmserve.entrypoints.openai.response_store import KeptResponses, ResponseStore
from mmserve.entrypoints.openai.response_store_client import ResponseStoreClient
from mmserve.entrypoints.openai.server_routes import add_model_routes, status_routes
from mmserve.entrypoints.openai.serving_base import ServingOptions
from mmserve.entrypoints.openai.serving_chat import OpenAIServingChat
from mmserve.entrypoints.openai.serving_completions import OpenAIServingCompletion
from mmserve.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, require_runner
from mmserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from mmserve.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from mmserve.entrypoints.openai.streaming import cancel_on_disconnect
from mmserve.metrics import ServerMetrics

if TYPE_CHECKING:
    from mmserve.frontend.async_llm import AsyncLLM


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: str | None = None,
              max_body_bytes: int | None = None, options: ServingOptions | None = None,
              responses_store_bytes: int = 256 << 20, responses_store: str | None = None,
              cors: dict[str, Any] | None = None, docs: bool = True) -> FastAPI:
    """The FastAPI app over `engine`; `app.state.metrics` holds its `ServerMetrics`. Bodies over
    `max_body_bytes` (default: derived from the media limits) are refused with 413 unread;
    `options` are the flags' choices for every answer (tool parser, chat templates, reasoning
    parser, logprob tokens, usage); finished responses are kept for previous_response_id in
    `responses_store_bytes`, or in the node's store at the address `responses_store` (a
    launcher's, shared by its API servers); `cors` (CORSMiddleware's arguments) answers browsers'
    cross-origin requests; without `docs`, no /openapi.json, /docs or /redoc."""
    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    pages: dict[str, Any] = {} if docs else {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="mmserve", description="OpenAI-compatible API of a vision-language model server.", **pages)
    mm = engine.config.multimodal
    app.add_middleware(BodyLimitMiddleware,
                       max_bytes=max_body_bytes or default_body_limit(mm.max_media_bytes, mm.max_images))
    install_error_handlers(app)  # its catch-all middleware around the body limit, inside the access log
    app.add_middleware(AccessLogMiddleware)  # it sees the 413s too
    if cors is not None:  # outermost: a preflight is answered before the API key, and every answer gets the headers
        app.add_middleware(CORSMiddleware, **cors)
    app.state.engine = engine
    parallel = engine.config.parallel
    app.state.metrics = metrics = ServerMetrics(engine.stats, getattr(engine, "dp_figures", None),
                                                parallel.api_server_index if parallel.api_server_count > 1 else None,
                                                getattr(engine, "verify_figures", None), served_model_names[0])
    chat = OpenAIServingChat(engine, served_model_names, metrics, options)
    store = ResponseStore(responses_store_bytes) if responses_store is None else ResponseStoreClient(responses_store)
    text = OpenAIServingCompletion(engine, served_model_names, metrics, options)
    responses = OpenAIServingResponses(engine, served_model_names, metrics, KeptResponses(store), options)
    embeddings = OpenAIServingEmbedding(engine, served_model_names, metrics, options)
    v1 = _v1_routes(engine, served_model_names, chat, text, responses, embeddings, api_key)
    tokens = OpenAIServingTokenization(engine, served_model_names, metrics, options)
    behind_key = [Depends(_api_key_check(api_key))]
    root = APIRouter(dependencies=behind_key)  # vLLM's routes, behind the key too
    root.add_api_route("/tokenize", tokens.tokenize, methods=["POST"])
    root.add_api_route("/detokenize", tokens.detokenize, methods=["POST"])

    app.include_router(status_routes(engine, metrics))
    app.include_router(v1)
    app.include_router(root)
    if dev_mode():
        app.include_router(cache_reset_routes(engine, behind_key))
    return app


def _v1_routes(engine: AsyncLLM, served_model_names: list[str], chat: OpenAIServingChat,
               text: OpenAIServingCompletion, responses: OpenAIServingResponses,
               embeddings: OpenAIServingEmbedding, api_key: str | None) -> APIRouter:
    """The OpenAI routes under /v1, behind the API key when one is set."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(api_key))])

    @v1.post("/chat/completions")
    async def chat_completions(raw_request: Request) -> Response:
        require_runner(engine, False, "Chat Completions")
        return await cancel_on_disconnect(chat.create_chat_completion(raw_request), raw_request)

    @v1.post("/completions")
    async def completions(raw_request: Request) -> Response:
        require_runner(engine, False, "Completions")
        return await cancel_on_disconnect(text.create_completion(raw_request), raw_request)

    @v1.post("/responses")
    async def create_response(raw_request: Request) -> Response:
        require_runner(engine, False, "Responses")
        return await cancel_on_disconnect(responses.create_response(raw_request), raw_request)

    @v1.post("/embeddings")
    async def create_embedding(raw_request: Request) -> Response:
        return await cancel_on_disconnect(embeddings.create_embedding(raw_request), raw_request)

    add_model_routes(v1, engine, served_model_names)
    return v1


def _api_key_check(api_key: str | None) -> Any:
    """A dependency refusing requests without `Authorization: Bearer <api_key>` (none when unset)."""
    expected = None if api_key is None else api_key.encode("utf-8")

    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise OpenAIError(401, "missing API key: send it as 'Authorization: Bearer <key>'",
                              code="invalid_api_key")
        # the server decoded the header's bytes as latin-1: encode back to compare raw bytes, so a
        # non-ASCII key (sent as UTF-8) can match
        if not secrets.compare_digest(given.strip().encode("latin-1", "replace"), expected):
            raise OpenAIError(401, "invalid API key", code="invalid_api_key")

    return check
