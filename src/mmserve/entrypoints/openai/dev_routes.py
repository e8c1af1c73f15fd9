"""vLLM's development routes, present only with `VLLM_SERVER_DEV_MODE=1` (vLLM's switch; its benchmark
sweeps set it to reset the caches between runs), behind the API key when one is set.

`POST /reset_prefix_cache` (vLLM's query parameters `reset_running_requests` and `reset_external`
are taken: a reset never needs to preempt here, as running requests keep their blocks, and there is
no external KV cache), `POST /reset_mm_cache`, `POST /reset_encoder_cache`. Each answers once every
rank has reset, 200 with what was dropped (`frontend/cache_resets.py: ResetReport`; vLLM answers an
empty 200). What a reset drops and keeps: `engine/cache_reset.py`. With several API servers the
one that takes the call resets the engine cores and the node's item store for all, and the engine
cores tell the others to empty their own processor caches and IPC senders.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter

if TYPE_CHECKING:
    from mmserve.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def dev_mode() -> bool:
    """Whether the development routes are served (`VLLM_SERVER_DEV_MODE` is 1 or true)."""
    return os.environ.get(DEV_MODE_ENV, "0").strip().lower() in ("1", "true")


def cache_reset_routes(engine: AsyncLLM, dependencies: list[Any]) -> APIRouter:
    routes = APIRouter(dependencies=dependencies)

    async def reset(what: str, **caches: bool) -> dict[str, int]:
        report = (await engine.reset_caches(**caches)).as_dict()
        logger.info("reset the %s cache: %s", what, ", ".join(f"{k} {v}" for k, v in report.items() if v))
        return report

    @routes.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False) -> dict[str, int]:
        return await reset("prefix", prefix=True)

    @routes.post("/reset_mm_cache")
    async def reset_mm_cache() -> dict[str, int]:
        return await reset("multimodal", mm=True)

    @routes.post("/reset_encoder_cache")
    async def reset_encoder_cache() -> dict[str, int]:
        return await reset("encoder", encoder=True)

    return routes

