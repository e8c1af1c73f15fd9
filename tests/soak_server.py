"""The soak's server (see tests/soak.py): `AsyncLLM`, the OpenAI app and uvicorn on 127.0.0.1,
served from a thread of this process so the soak can read P0's state on the server's own event
loop; P1 is the real engine-core process. Also the soak's engine arguments and its idle checks."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Awaitable, Callable

import uvicorn

from mmserve.config import EngineConfig
from mmserve.entrypoints.openai.app import build_app
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.ipc.messages import CacheStats
from mmserve.multimodal.cache import ENTRY_OVERHEAD_BYTES
from helpers.tiny_models import llava_item_bytes

SHM_DIR = "/dev/shm"


def soak_engine_args(model_dir: str, cache_type: str, media_dir: Path, cache_items: int,
                     verify_rate: float = 0.0) -> dict[str, Any]:
    """Engine arguments for a soak: every cache a few items big, KV for a few requests (so they
    wait and get preempted), two images per prompt, local files from `media_dir` only, the
    shadow cache verifier at `verify_rate`, and a stream unread for a second aborted."""
    vision = json.loads((Path(model_dir) / "config.json").read_text())["vision_config"]
    side, patch = vision["image_size"], vision["patch_size"]
    item_bytes = llava_item_bytes(side) + ENTRY_OVERHEAD_BYTES  # one crop
    image_tokens = (side // patch) ** 2
    gib = cache_items * item_bytes / (1 << 30)
    block_size = 16
    return dict(model=model_dir, mm_cache_type=cache_type, mm_processor_cache_gb=gib, mm_ipc_cache_gb=gib,
                mm_shm_cache_gb=(cache_items + 1) * (item_bytes + 4096) / (1 << 30),
                encoder_cache_tokens=cache_items * image_tokens, max_model_len=2 * image_tokens + 128,
                block_size=block_size, num_kv_blocks=4 * (2 * image_tokens + 128) // block_size,
                limit_mm_per_prompt={"image": 2}, max_media_bytes=300_000,
                allowed_local_media_path=str(media_dir), cache_verify_rate=verify_rate,
                stalled_stream_abort_s=1.0, engine_restart_limit=3)


class LoopbackServer:
    """A context manager: serving on `base_url` once entered; stopped (engine shut down) on exit."""

    def __init__(self, served_name: str, engine_args: dict[str, Any]) -> None:
        self.served_name = served_name
        self.engine_args = engine_args
        self._started: Future[None] = Future()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="soak-server", daemon=True)
        self._pids = {os.getpid()}

    def __enter__(self) -> LoopbackServer:
        start = time.monotonic()
        self._thread.start()
        self._started.result(timeout=300)
        self.startup_s = time.monotonic() - start
        self._pids.add(self.engine.client.proc.pid)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(60)

    async def _main(self) -> None:
        try:
            self.loop = asyncio.get_running_loop()
            self.engine = AsyncLLM(EngineConfig.from_kwargs(**self.engine_args))
        except BaseException as e:
            self._started.set_exception(e)
            return
        try:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            app = build_app(self.engine, [self.served_name])
            self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
            serving = asyncio.create_task(self.server.serve(sockets=[sock]))
            while not self.server.started and not serving.done():
                await asyncio.sleep(0.01)
            self._started.set_result(None)
            await serving
        except BaseException as e:
            if not self._started.done():
                self._started.set_exception(e)
        finally:
            self.engine.shutdown()

    def call(self, fn: Callable[[AsyncLLM], Awaitable[Any]], timeout_s: float = 30.0) -> Any:
        """`await fn(engine)` on the server's event loop; its result."""
        return asyncio.run_coroutine_threadsafe(fn(self.engine), self.loop).result(timeout_s)

    def shm_segments(self) -> set[str]:
        """Shared-memory segments of this process and its engine core (names carry the writer's pid)."""
        return {n for n in os.listdir(SHM_DIR) if n.startswith("mmserve_") and int(n.split("_")[1]) in self._pids}


async def idle_state(engine: AsyncLLM, timeout_s: float = 30.0) -> dict[str, tuple[Any, Any]]:
    """{what: (got, expected)} once every expectation holds, or as it is after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        state = _state(engine)
        if all(got == want for got, want in state.values()) or loop.time() > deadline:
            return state
        await asyncio.sleep(0.1)


def _state(engine: AsyncLLM) -> dict[str, tuple[Any, Any]]:
    stats = engine.stats()
    processor = engine.input_processor
    state: dict[str, tuple[Any, Any]] = {
        "requests running": (stats.num_running, 0), "requests waiting": (stats.num_waiting, 0),
        "free KV blocks": (stats.num_free_blocks, stats.num_total_blocks),
        "P0 request queues": (sorted(engine.requests.queues), []), "P0 requests sent": (engine.requests.ids(), []),
        "P0 output state": (engine.output_processor.has_unfinished_requests(), False),
        "P0 items pending commit": (sorted(r.request_id for r in engine.requests.values() if r.pending), []),
        "P0 items in flight": (sorted(processor.items.inflight.futures), []),
        "processor cache intact": (_intact(processor.processor_cache), True),
        "IPC sender intact": (_intact(engine.transport.sender), True),
        "cache verifier running": (engine.verifier.busy, False),
        "cache verifier mismatches": (engine.verifier.figures.mismatches, 0),
    }
    if engine.transport.sender.enabled:
        sender, receiver = stats.caches["ipc"], stats.caches.get("ipc_receiver", CacheStats())
        state["IPC keys, P0 vs P1 (digest, entries, bytes)"] = (
            (sender.keys_digest, sender.entries, sender.bytes_used),
            (receiver.keys_digest, receiver.entries, receiver.bytes_used))
    if engine.transport.shm is not None:
        state["shm pins"] = (engine.transport.shm.store.pinned_requests(), [])
        state["shm store intact"] = (_intact(engine.transport.shm.store), True)
    return state


def _intact(cache: Any) -> bool:
    try:
        cache.check_integrity()
    except AssertionError:
        return False
    return True
