"""The OpenAI-compatible HTTP server (P0): the FastAPI app and `mmserve serve`'s main.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses`, `GET /v1/models`
(behind the API key when one is set), vLLM's `/tokenize` and `/detokenize` (behind it too), and
`server_routes.py`'s `/health` (200 while the engine core lives, else 503), `/ping`, `/version`
and `/metrics`.

Lifecycle: SIGTERM or Ctrl-C stops uvicorn gracefully, then the engine cores are shut down and
the process exits 0. An engine core that dies is survived by the frontend (`AsyncLLM`: its
requests that showed nothing move to a live rank, it is restarted up to
`--engine-restart-limit` times); only when no rank serves and none can come back do in-flight
requests fail with 503 (or an error event in a stream), /health turn 503 and the process exit
with `ENGINE_DEAD_EXIT_CODE` within a few seconds, for a supervisor to restart the whole server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from mmserve import log_levels
from mmserve.config import EngineConfig
from mmserve.deployment_defaults import family_tool_parser, template_reasoning_parser
from mmserve.entrypoints.openai.read_timeout import read_timeout_protocol
from mmserve.entrypoints.openai.access_log import AccessLogMiddleware, take_over_uvicorn_access_log
from mmserve.entrypoints.openai.body_limit import BodyLimitMiddleware, default_body_limit
from mmserve.entrypoints.openai.dev_routes import cache_reset_routes, dev_mode
from mmserve.entrypoints.openai.errors import OpenAIError, install_error_handlers
from mmserve.entrypoints.openai.server_config import ServerConfig
from mmserve.entrypoints.openai.server_routes import add_model_routes, status_routes
from mmserve.entrypoints.openai.start_signals import StartSignals
from mmserve.entrypoints.openai.serving_base import ServingOptions
from mmserve.entrypoints.openai.serving_chat import OpenAIServingChat
from mmserve.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from mmserve.entrypoints.openai.request_ids import RequestIdHeaderMiddleware
from mmserve.entrypoints.openai.streaming import cancel_on_disconnect
from mmserve.entrypoints.openai.user_middleware import add_user_middleware
from mmserve.entrypoints.openai.serving_completions import OpenAIServingCompletion
from mmserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from mmserve.entrypoints.openai.response_store import KeptResponses, ResponseStore
from mmserve.entrypoints.openai.response_store_client import ResponseStoreClient
from mmserve.metrics import ServerMetrics
from mmserve.malloc_tuning import HeapReserve
from mmserve.serving_process import ServingProcess
from mmserve.lazy_imports import keep_triton_out

if TYPE_CHECKING:
    from mmserve.frontend.async_llm import AsyncLLM
    from mmserve.frontend.engine_client.attached_engine import Attachment

logger = logging.getLogger(__name__)

ENGINE_DEAD_EXIT_CODE = 3  # no engine core serves and none can come back
GRACEFUL_SHUTDOWN_S = 5  # longest uvicorn waits for open connections when stopping
HEAP_PAD_BYTES = 64 << 20  # P0's heap reserve (malloc_tuning.HeapReserve), as P1's
RESERVE_POLL_S = 0.05  # how often an idle P0 looks at its heap reserve
HEALTH_POLL_S = 0.5


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
    v1 = _v1_routes(engine, served_model_names, chat, text, responses, api_key)
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
               api_key: str | None) -> APIRouter:
    """The OpenAI routes under /v1, behind the API key when one is set."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(api_key))])

    @v1.post("/chat/completions")
    async def chat_completions(raw_request: Request) -> Response:
        return await cancel_on_disconnect(chat.create_chat_completion(raw_request), raw_request)

    @v1.post("/completions")
    async def completions(raw_request: Request) -> Response:
        return await cancel_on_disconnect(text.create_completion(raw_request), raw_request)

    @v1.post("/responses")
    async def create_response(raw_request: Request) -> Response:
        return await cancel_on_disconnect(responses.create_response(raw_request), raw_request)

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


# ---- mmserve serve ---------------------------------------------------------------------------


@dataclass
class _RunState:
    exit_code: int = 0


def serve_api_server(server_config: ServerConfig, engine_config: EngineConfig, attachment: Attachment | None = None,
                     sock: socket.socket | None = None, started: Callable[[], None] | None = None) -> int:
    """One API server until SIGTERM / Ctrl-C (0) or its engine cores' death, on `sock` (bound by the
    caller before anything loads: `listen.py`; None: uvicorn binds the configured port); once it
    returns the process ignores SIGINT and SIGTERM (`StartSignals.stopped`: it is exiting). With
    `attachment` it is API server `engine_config.parallel.api_server_index` of a launcher's several:
    it calls `started()` once it accepts connections instead of announcing itself."""
    log_levels.configure(server_config.log_level)
    # before any other thread starts; the processor cache keeps each new item's pixels
    process = ServingProcess(f"api_server_{engine_config.parallel.api_server_index}",
                             min(HEAP_PAD_BYTES, engine_config.processor_cache_bytes_per_server))
    keep_triton_out()  # before the processor's transformers import (lazy_imports.py)
    signals = StartSignals()  # Ctrl-C and SIGTERM stop the start at once; uvicorn takes them once serving
    signals.install()
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(_serve(server_config, engine_config, attachment, sock, started, process, signals))
    except KeyboardInterrupt:
        return 0
    finally:
        signals.stopped()


def _auto_tool_parser(server_config: ServerConfig, engine: AsyncLLM) -> str | None:
    """tool_choice "auto"'s parser: the flag's, else the model family's (said once at start-up)."""
    family = family_tool_parser(engine.model_dir)
    parser = server_config.auto_tool_parser(family)
    if server_config.tool_call_parser is None and parser is not None and engine.config.parallel.api_server_index == 0:
        logger.info('tool_choice "auto" reads %s tool calls (the model family\'s format; --tool-call-parser '
                    "overrides)", parser)
    return parser


def _reasoning_parser(server_config: ServerConfig, engine: AsyncLLM) -> str | None:
    """The flag's parser, else the checkpoint template's (`template_reasoning_parser`), said once at start-up."""
    if server_config.reasoning_parser is not None:
        return server_config.reasoning_parser
    if template_reasoning_parser(engine.input_processor.processor.apply_chat_template) is None:
        return None
    if engine.config.parallel.api_server_index == 0:
        logger.info("the chat template opens a <think> block: answers' thinking is their reasoning_content "
                    "(--reasoning-parser qwen3, the default for this checkpoint)")
    return "qwen3"


def _loop_factory() -> Any:
    """uvloop's event loop when installed (a faster loop for every request's hops), else asyncio's;
    MMSERVE_EVENT_LOOP=asyncio forces asyncio's."""
    if os.environ.get("MMSERVE_EVENT_LOOP", "uvloop") == "uvloop":
        try:
            import uvloop

            return uvloop.new_event_loop
        except ImportError:
            pass
    return None


async def _serve(server_config: ServerConfig, engine_config: EngineConfig, attachment: Attachment | None,
                 sock: socket.socket | None, started: Callable[[], None] | None, process: ServingProcess,
                 signals: StartSignals) -> int:
    with signals.raising():  # the engine cores' start, in this first step: a stop signal raises in it
        from mmserve.frontend.async_llm import AsyncLLM

        engine = AsyncLLM(engine_config, attachment)
    reserve = process.reserve
    launcher = attachment.launcher_pid if attachment is not None else None  # it may die while the engine starts
    engine.log_stats = not server_config.disable_log_stats
    keeper = asyncio.create_task(_keep_heap_reserve(reserve, engine)) if reserve.enabled else None
    try:
        engine.start()
        model = engine_config.model.model
        limit = server_config.max_request_body_mb
        options = ServingOptions(_auto_tool_parser(server_config, engine), server_config.chat_template_policy(),
                                 _reasoning_parser(server_config, engine), server_config.return_tokens_as_token_ids,
                                 server_config.enable_force_include_usage)
        app = build_app(engine, server_config.served_model_names(model), server_config.api_key,
                        None if limit is None else int(limit * (1 << 20)), options,
                        int(server_config.responses_store_mb * (1 << 20)),
                        attachment.responses if attachment is not None else None, server_config.cors(),
                        docs=not server_config.disable_fastapi_docs)
        if server_config.enable_request_id_headers:
            app.add_middleware(RequestIdHeaderMiddleware)  # outside the error handlers: a 4xx has it too
        add_user_middleware(app, server_config.middleware or [])
        # lifespan off: the app has no startup or shutdown handlers, and uvicorn's force exit (a second
        # Ctrl-C) skips the lifespan's shutdown, leaving its task to be cancelled as the loop closes,
        # which logged a CancelledError traceback
        config = uvicorn.Config(app, host=server_config.host, port=server_config.port, lifespan="off",
                                log_level=server_config.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                http=read_timeout_protocol(server_config.request_read_timeout_s),
                                **server_config.uvicorn_args())
        take_over_uvicorn_access_log()  # AccessLogMiddleware writes the line, after the first bytes
        server = uvicorn.Server(config)
        process.serve()  # a full collection would stall the event loop: every stream, every admission
        state = _RunState()
        if not signals.serving(server):  # stopped during the start's last steps
            return 0
        supervisor = asyncio.create_task(_supervise(server, engine, model, state, started, launcher))
        try:
            await server.serve(sockets=None if sock is None else [sock])
        finally:
            supervisor.cancel()
        return state.exit_code
    finally:
        if keeper is not None:
            keeper.cancel()
        engine.shutdown()


async def _supervise(server: uvicorn.Server, engine: AsyncLLM, model: str, state: _RunState,
                     started: Callable[[], None] | None, launcher: int | None) -> None:
    """Announce readiness (or call `started`), then stop the server (non-zero exit) if the engine core
    dies — or, for one of a launcher's API servers, if the launcher does (its engine cores go with it)."""
    while not server.started:
        await asyncio.sleep(0.05)
    if started is not None:
        started()
    else:
        scheme = "https" if server.config.ssl_certfile else "http"
        print(f"mmserve: serving {model} on {scheme}://{server.config.host}:{_bound_port(server)}", flush=True)
    while engine.is_healthy:
        await asyncio.sleep(HEALTH_POLL_S)
        if launcher is not None and os.getppid() != launcher:
            logger.error("the launcher died; stopping the server")
            state.exit_code = 1
            server.should_exit = True
            return
    logger.error("the engine core died (%s); stopping the server",
                 getattr(engine, "dead_error", None) or "process not running")
    state.exit_code = ENGINE_DEAD_EXIT_CODE
    server.should_exit = True


async def _keep_heap_reserve(reserve: HeapReserve, engine: AsyncLLM) -> None:
    """Populate P0's heap reserve a chunk at a time while no request is in flight, so that the
    pixels of the next new item (kept by the processor cache) land in pages already there."""
    while True:
        await asyncio.sleep(RESERVE_POLL_S)
        while engine.num_requests == 0 and reserve.pending():
            reserve.refill()
            await asyncio.sleep(0)


def _bound_port(server: uvicorn.Server) -> int:
    for s in getattr(server, "servers", []):
        for sock in s.sockets:
            return sock.getsockname()[1]
    return server.config.port


