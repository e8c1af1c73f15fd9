"""The triton backend: our Triton kernels for paged decoder attention, the KV-cache write and the
vision towers' segments (the CUDA default; on CPU only under `TRITON_INTERPRET=1`, for tests).

Every length a kernel reads is in a tensor on the backend's device; the Python ints kept beside
them (`max_query_len`, `max_len`) only size the launch grids.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar

import torch

from mmserve.models.attention.cache_write_kernel import rotary_write_kv_cache, write_kv_cache
from mmserve.models.attention.host_metadata import padded_tables, token_slots
from mmserve.models.attention.layer_kernels import TRITON_OPS
from mmserve.models.attention.paged_kernel import paged_attention
from mmserve.models.attention.varlen_kernel import varlen_attention
from mmserve.models.layers import LayerOps, QKNorm, Rope


@dataclass
class TritonMetadata:
    """Where one step's tokens read and write K/V, as the kernels read it (B requests, T tokens,
    laid out request after request)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * S + offset) of each token
    query_start: torch.Tensor  # [B + 1] int32: request b's tokens are query_start[b] .. query_start[b + 1]
    seq_lens: torch.Tensor  # [B] int32: tokens of context, the step's tokens included
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    max_query_len: int
    ops: ClassVar[LayerOps] = TRITON_OPS  # the small ops between GEMMs, fused (layer_kernels.py)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, rope: Rope | None = None,
               qk_norm: QKNorm | None = None) -> torch.Tensor:
        """Write the step's K/V at its slots (q and k normalised by `qk_norm` and rotated by `rope`
        in the same launch), then one paged-attention launch for every request."""
        if rope is None:
            if qk_norm is not None:
                q, k = self.ops.qk_norm(q, k, *qk_norm)
            write_kv_cache(k, v, k_cache, v_cache, self.slot_mapping)
            q = q.contiguous()
        else:
            q = rotary_write_kv_cache(q, k, v, *rope, k_cache, v_cache, self.slot_mapping, qk_norm)
        return paged_attention(q, k_cache, v_cache, self.query_start, self.seq_lens, self.block_tables,
                               self.max_query_len, scale)


@dataclass(frozen=True)
class TritonSegments:
    """A vision tower call's segments as the variable-length kernel reads them."""

    cu: torch.Tensor  # [S + 1] int32: segment s is rows cu[s] .. cu[s + 1]
    max_len: int
    ops: ClassVar[LayerOps] = TRITON_OPS  # the tower's small ops between GEMMs, fused (layer_kernels.py)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q, k, v: [P, H, Dh] (rows may be strided: views of the fused QKV) -> [P, H, Dh]:
        full attention within each segment."""
        return varlen_attention(q, k, v, self.cu, self.max_len, scale)


class TritonBackend:
    """Our Triton kernels on `device` (`models/attention/backend.py`'s interface)."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def build_metadata(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                       block_size: int) -> TritonMetadata:
        """Host tensors: the runner moves a step's inputs to the device in one copy."""
        tables = padded_tables(block_tables, torch.int32)  # [B, width]
        slots = token_slots(tables, query_lens, seq_lens, block_size)
        query_start = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
        return TritonMetadata(slots, query_start, torch.tensor(seq_lens, dtype=torch.int32), tables, max(query_lens))

    @staticmethod
    def graph_metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       block_size: int) -> TritonMetadata:
        """A decode step's metadata from a CUDA graph's static tensors (`worker/cuda_graphs.py`):
        one query per request, every length read from tensors."""
        B = seq_lens.shape[0]
        query_start = torch.arange(B + 1, dtype=torch.int32, device=seq_lens.device)
        return TritonMetadata(slot_mapping, query_start, seq_lens.to(torch.int32), block_tables.to(torch.int32), 1)

    def segments(self, cu: list[int], device: torch.device) -> TritonSegments:
        longest = max((hi - lo for lo, hi in zip(cu[:-1], cu[1:])), default=0)
        host = torch.tensor(cu, dtype=torch.int32)
        if device.type == "cuda":  # pinned, without blocking: the host does not wait for the GPU's queue
            return TritonSegments(host.pin_memory().to(device, non_blocking=True), longest)
        return TritonSegments(host.to(device), longest)

    def equal_segments(self, count: int, length: int, device: torch.device) -> TritonSegments:
        return self.segments([i * length for i in range(count + 1)], device)
