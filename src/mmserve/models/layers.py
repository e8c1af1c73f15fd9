"""Building blocks shared by the decoder and the vision tower: norms, rotary, paged attention.

Shapes: T = tokens of the whole step (all requests flattened), B = requests, H = heads,
Hkv = key/value heads, Dh = head dim, S = block size, N = blocks in the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama's RMSNorm, computed in float32 like transformers."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported")
    return ACTIVATIONS[name]


class RotaryEmbedding(nn.Module):
    """Llama's default rotary embedding (rotate-half), cos/sin looked up by position."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        # a plain float32 attribute, not a buffer: it stays float32 under --dtype, and is real
        # even when the model is built on the meta device
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self.inv_freq = 1.0 / (theta**exponents)  # [Dh/2]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, H, Dh]; k: [T, Hkv, Dh]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, Dh]
        cos = emb.cos().to(q.dtype)[:, None, :]
        sin = emb.sin().to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class AttentionMetadata:
    """Where one step's tokens read and write K/V.

    Tokens are laid out request after request. Attention runs padded: request b's queries sit
    in row b of `q_index` (`q_valid` marks real ones), its keys are its block table's slots.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * S + offset) of each token
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    q_index: torch.Tensor  # [B, max_q] int64: flat token index of each query (0 where padded)
    q_valid: torch.Tensor  # [B, max_q] bool
    attn_mask: torch.Tensor  # [B, 1, max_q, max_blocks * S] bool: True where a query may attend

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int) -> AttentionMetadata:
        """`query_lens[b]` new tokens of request b end its `seq_lens[b]` tokens of context."""
        B, max_q = len(query_lens), max(query_lens)
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.zeros(B, max_blocks, dtype=torch.int64)
        for b, t in enumerate(block_tables):
            tables[b, : len(t)] = torch.tensor(t, dtype=torch.int64)
        q_lens = torch.tensor(query_lens)
        s_lens = torch.tensor(seq_lens)
        starts = torch.cumsum(q_lens, 0) - q_lens  # [B]
        j = torch.arange(max_q)
        q_valid = j[None, :] < q_lens[:, None]  # [B, max_q]
        q_index = torch.where(q_valid, starts[:, None] + j[None, :], 0)
        q_pos = (s_lens - q_lens)[:, None] + j[None, :]  # [B, max_q] absolute position
        kv_pos = torch.arange(max_blocks * block_size)
        mask = kv_pos[None, None, :] <= q_pos[:, :, None]  # causal, also bounds by seq_len
        mask = mask | ~q_valid[:, :, None]  # padded rows attend everywhere (discarded) to avoid NaN
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
        block_idx = tables.repeat_interleave(q_lens, dim=0)  # [T, max_blocks]
        slots = block_idx.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
        return cls(slots, tables, q_index, q_valid, mask[:, None])


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend over each request's cached context.

    q: [T, H, Dh]; k, v: [T, Hkv, Dh]; k_cache, v_cache: [N, S, Hkv, Dh]. Returns [T, H, Dh].
    """
    N, S, Hkv, Dh = k_cache.shape
    k_cache.view(N * S, Hkv, Dh).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(N * S, Hkv, Dh).index_copy_(0, meta.slot_mapping, v)
    B = meta.block_tables.shape[0]
    keys = k_cache[meta.block_tables].view(B, -1, Hkv, Dh).transpose(1, 2)  # [B, Hkv, L, Dh]
    values = v_cache[meta.block_tables].view(B, -1, Hkv, Dh).transpose(1, 2)
    queries = q[meta.q_index].transpose(1, 2)  # [B, H, max_q, Dh]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.attn_mask, scale=scale,
                                         enable_gqa=q.shape[1] != Hkv)  # [B, H, max_q, Dh]
    return out.transpose(1, 2)[meta.q_valid]  # [T, H, Dh]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
