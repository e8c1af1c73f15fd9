"""A debugging hook that makes cache hits wrong on purpose, so tests can show the shadow verifier
(`frontend/cache_verifier.py`) catches a cache that serves a stale value.

`MMSERVE_DEBUG_CACHE_FAULT` (read here only, once per runner) names what to alter:
- `kv`: a request admitted after a prefix-cache hit finds its first cached KV block altered in
  every layer (in place: later hits on that block read the altered values too);
- `encoder`: an encoder output read from the encoder cache (not encoded in the same step) is
  altered where it is scattered into the prompt.
A shadow run reads no cache, so it computes the right values; unset (the default) nothing changes.
"""

from __future__ import annotations

import os

import torch

ENV = "MMSERVE_DEBUG_CACHE_FAULT"
_KINDS = ("kv", "encoder")


class CacheFault:
    """Which cache hits to alter (`kind`), and how (adding `delta` to every value)."""

    def __init__(self, kind: str, delta: float = 1.0) -> None:
        if kind not in _KINDS:
            raise ValueError(f"{ENV} must be one of {', '.join(_KINDS)}; got {kind!r}")
        self.kind = kind
        self.delta = delta

    @classmethod
    def from_env(cls) -> CacheFault | None:
        """The fault the environment asks for, or None (the normal case)."""
        kind = os.environ.get(ENV)
        return cls(kind) if kind else None

    def on_prefix_hit(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_id: int) -> None:
        """A request's prompt hit the prefix cache; `block_id` is its first cached block."""
        if self.kind == "kv":
            for k, _ in kv_caches:  # each [num_blocks, block_size, Hkv, Dh]
                k[block_id] += self.delta

    def on_encoder_hit(self, feats: torch.Tensor) -> torch.Tensor:
        """Rows of an encoder output read from the cache ([n, D']) as the decoder will see them."""
        return feats + self.delta if self.kind == "encoder" else feats
