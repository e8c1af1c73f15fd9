"""Defaults decided from the deployment rather than fixed: what a new user's first command needs.

- The item transport: with several API servers and no `--mm-cache-type`, the node's shared
  store (shm), so that an item one API server processed is a hit on every other; lru when there
  is one API server, or when /dev/shm cannot hold `--mm-shm-cache-gb` (a warning names the fallback).
- The tool-call parser for `tool_choice` "auto": the model family's known format (Qwen2.5-VL and
  Qwen3-VL emit hermes calls) when `--tool-call-parser` is not given; a family without a known
  format keeps "auto" refused with a clear 400.
- The reasoning parser: qwen3's where the checkpoint's chat template opens the thinking block
  itself (a Thinking model: every answer starts inside it) and `--reasoning-parser` is not given.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Callable

from mmserve.config import EngineConfig

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
FAMILY_TOOL_PARSERS = {"Qwen2_5_VLForConditionalGeneration": "hermes", "Qwen3VLForConditionalGeneration": "hermes"}


def with_item_transport(config: EngineConfig, shm_dir: str = SHM_DIR) -> EngineConfig:
    """`config` with `mm_cache_type` decided when it was left unset (None): shm with several API
    servers if `shm_dir` has room for the store, else lru. A set value is kept as given."""
    mm = config.multimodal
    if mm.mm_cache_type is not None:
        return config
    choice = "lru"
    if config.parallel.api_server_count > 1 and mm.mm_shm_cache_gb > 0:
        free = shm_free_bytes(shm_dir)
        need = int(mm.mm_shm_cache_gb * (1 << 30))
        if free is not None and free >= need:
            choice = "shm"
            logger.info("%d API servers share the node's item store in shared memory (--mm-cache-type shm, "
                        "%.1f GiB); --mm-cache-type lru keeps one processor cache per API server",
                        config.parallel.api_server_count, mm.mm_shm_cache_gb)
        else:
            logger.warning("%s has %s free, less than --mm-shm-cache-gb %.1f GiB: falling back to --mm-cache-type "
                           "lru (one processor cache per API server; a repeat on another server is a miss). "
                           "Enlarge %s or lower --mm-shm-cache-gb to share items between API servers",
                           shm_dir, "no space" if free is None else f"{free / (1 << 30):.2f} GiB",
                           mm.mm_shm_cache_gb, shm_dir)
    return dataclasses.replace(config, multimodal=dataclasses.replace(mm, mm_cache_type=choice))


def shm_free_bytes(shm_dir: str) -> int | None:
    """Bytes an unprivileged process may still allocate under `shm_dir`; None when it is absent."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def template_reasoning_parser(render: Callable[[list[dict[str, Any]]], str]) -> str | None:
    """"qwen3" when the chat template (`render`: a processor's `apply_chat_template`) ends its
    reply prompt inside a `<think>` block, else None (no template, or one that refuses this turn)."""
    from mmserve.entrypoints.openai.reasoning import opens_thinking

    try:
        prompt = render([{"role": "user", "content": "?"}])
    except ValueError:
        return None
    return "qwen3" if opens_thinking(prompt) else None


def family_tool_parser(model_dir: str) -> str | None:
    """The tool-call parser of the checkpoint's family (its config.json `architectures`), or None."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            architectures = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        return None
    return next((FAMILY_TOOL_PARSERS[a] for a in architectures if a in FAMILY_TOOL_PARSERS), None)
