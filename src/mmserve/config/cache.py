"""The KV cache layer's config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mmserve.config.fields import opt
from mmserve.kv_cache_dtype import check_kv_cache_dtype


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = opt(16, "Tokens per KV cache block.")
    kv_cache_memory_gb: float | None = opt(
        None, "Memory for the KV cache in GiB, per tensor-parallel rank (ignored with --num-kv-blocks; default: "
        "1 on CPU, on CUDA what --gpu-memory-utilization leaves).")
    num_kv_blocks: int | None = opt(None, "Exact number of KV cache blocks (overrides --kv-cache-memory-gb).")
    enable_prefix_caching: bool = opt(True, "Reuse the KV blocks of identical prompt prefixes (images included).")
    enable_last_block_caching: bool = opt(
        True, "With prefix caching, also keep each prompt's last KV block (full or partial): an identical "
        "prompt copies it and computes only its last token, instead of up to a block of tokens.")
    enable_partial_block_caching: bool = opt(
        True, "With prefix caching, also reuse the leading tokens of a computed block after the full-block hits (the "
        "same image, then another question): the block is copied and only the tokens after the common prefix are "
        "computed, instead of up to a block of them.")
    enable_first_token_caching: bool = opt(
        True, "With last-block caching, also keep the first token of each greedy prompt (no penalties, "
        "logit_bias, min_tokens or grammar): an identical greedy prompt asking no logprobs takes it and runs no "
        "forward for its first token.")
    cache_verify_rate: float = opt(
        0.0, "Share of requests (0 to 1) that, when a cache served them, are run once more with every cache "
        "bypassed, at the lowest priority after they finish, to check the caches changed nothing (mismatches are "
        "logged and counted in mmserve_cache_verify_total).")
    prefix_caching_hash_algo: str = opt(
        "sha256", "Block hash: sha256 or blake3 (collision-resistant), xxh3_128 (fast, not collision-resistant).",
        choices=("sha256", "blake3", "xxh3_128"))
    kv_events_config: dict[str, Any] | None = opt(
        None, 'Publish the prefix cache\'s changes for external routers, in vLLM\'s format and names, as JSON: '
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"} '
        "(kv_events_config.py).", parse=json.loads)
    kv_cache_dtype: str = opt(
        "auto", "KV cache element type: auto (the model's dtype), float16 or bfloat16 (half a float32 model's cache "
        "bytes; K/V rounded as they are written, read widened: not exact). vLLM's fp8 values are refused "
        "(kv_cache_dtype.py).")

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_events_config is not None:
            from mmserve.kv_events_config import KVEventsConfig

            KVEventsConfig.from_dict(self.kv_events_config)  # a ValueError names the fault
        if self.prefix_caching_hash_algo not in ("sha256", "blake3", "xxh3_128"):
            raise ValueError(f"unknown prefix_caching_hash_algo {self.prefix_caching_hash_algo!r}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024]; got {self.block_size}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be positive; got {self.kv_cache_memory_gb}")
        if not 0.0 <= self.cache_verify_rate <= 1.0:
            raise ValueError(f"cache_verify_rate must be in [0, 1]; got {self.cache_verify_rate}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1; got {self.num_kv_blocks}")
