"""Our Triton KV-cache write: each token's key and value rows into their cache slots.

Imported only by the triton backend (it needs `triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Shapes (T = tokens of the step, Hkv = key/value heads, Dh = head dim, N = blocks, S = block size):
#   k, v: [T, Hkv, Dh]; k_cache, v_cache: [N, S, Hkv, Dh]
#   slot_mapping: [T] int64, slot = block * S + offset; a negative slot is a padded token (a
#   captured graph's unused row) and writes nothing
# One program per BLOCK_T tokens; a token's Hkv x Dh values are one row of BLOCK_C lanes (c = head
# * Dh + d). Masks: tokens past T and padded tokens are neither loaded nor stored, nor are lanes
# c >= Hkv * Dh (padding to a power of two).


@triton.jit
def _cache_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_tokens,
                        stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch,
                        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    token = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping_ptr + token, mask=token < num_tokens, other=-1)
    c = tl.arange(0, BLOCK_C)
    head, d = c // HEAD_DIM, c % HEAD_DIM
    mask = (slot >= 0)[:, None] & (c < NUM_HEADS * HEAD_DIM)[None, :]
    block, offset = (slot // BLOCK_SIZE)[:, None], (slot % BLOCK_SIZE)[:, None]
    k = tl.load(k_ptr + token[:, None] * stride_kt + head[None, :] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + token[:, None] * stride_vt + head[None, :] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + block * stride_kb + offset * stride_ks + head[None, :] * stride_kch + d[None, :], k,
             mask=mask)
    tl.store(v_cache_ptr + block * stride_vb + offset * stride_vs + head[None, :] * stride_vch + d[None, :], v,
             mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V rows at its slot (shapes above); the caches are written in place."""
    T, Hkv, Dh = k.shape
    if T == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    block_c = triton.next_power_of_2(Hkv * Dh)
    block_t = min(16, max(1, 4096 // block_c))  # a tile of at most 4096 values
    _cache_write_kernel[(triton.cdiv(T, block_t),)](
        k, v, k_cache, v_cache, slot_mapping, T, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), NUM_HEADS=Hkv, HEAD_DIM=Dh, BLOCK_SIZE=k_cache.shape[1], BLOCK_T=block_t, BLOCK_C=block_c)
