"""`mmserve serve`'s main (P0): one API server over its engine cores, serving `app.py`'s app.

Lifecycle: SIGTERM or Ctrl-C stops uvicorn gracefully, then the engine cores are shut down and
the process exits 0 (`start_signals.py`: also while it starts). An engine core that dies is
survived by the frontend (`AsyncLLM`: its requests that showed nothing move to a live rank, it is
restarted up to `--engine-restart-limit` times); only when no rank serves and none can come back
do in-flight requests fail with 503 (or an error event in a stream), /health turn 503 and the
process exit with `ENGINE_DEAD_EXIT_CODE` within a few seconds, for a supervisor to restart the
whole server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import uvicorn

from mmserve import log_levels
from mmserve.config import EngineConfig
from mmserve.deployment_defaults import family_tool_parser, template_reasoning_parser
from mmserve.entrypoints.openai.access_log import take_over_uvicorn_access_log
from mmserve.entrypoints.openai.app import build_app
from mmserve.entrypoints.openai.read_timeout import read_timeout_protocol
from mmserve.entrypoints.openai.request_ids import RequestIdHeaderMiddleware
from mmserve.entrypoints.openai.server_config import ServerConfig
from mmserve.entrypoints.openai.serving_base import ServingOptions
from mmserve.entrypoints.openai.start_signals import StartSignals
from mmserve.entrypoints.openai.user_middleware import add_user_middleware
from mmserve.lazy_imports import keep_triton_out
from mmserve.malloc_tuning import HeapReserve
from mmserve.serving_process import ServingProcess

if TYPE_CHECKING:
    from mmserve.frontend.async_llm import AsyncLLM
    from mmserve.frontend.engine_client.attached_engine import Attachment

logger = logging.getLogger(__name__)

ENGINE_DEAD_EXIT_CODE = 3  # no engine core serves and none can come back
GRACEFUL_SHUTDOWN_S = 5  # longest uvicorn waits for open connections when stopping
HEAP_PAD_BYTES = 64 << 20  # P0's heap reserve (malloc_tuning.HeapReserve), as P1's
RESERVE_POLL_S = 0.05  # how often an idle P0 looks at its heap reserve
HEALTH_POLL_S = 0.5


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
        server = _uvicorn_server(server_config, engine, model, attachment)
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


def _uvicorn_server(server_config: ServerConfig, engine: AsyncLLM, model: str,
                    attachment: Attachment | None) -> uvicorn.Server:
    """uvicorn's server of `app.py`'s app over `engine` serving `model`, as the flags configure them."""
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
    return uvicorn.Server(config)


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


