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
# One program per token, its [Hkv, Dh] rows as one tile. Masks: head lanes >= Hkv and head-dim
# lanes >= Dh (padding to powers of two) are neither loaded nor stored.


@triton.jit
def _cache_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                        stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch,
                        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(k_cache_ptr + block * stride_kb + offset * stride_ks + h[:, None] * stride_kch + d[None, :], k,
                 mask=mask)
        tl.store(v_cache_ptr + block * stride_vb + offset * stride_vs + h[:, None] * stride_vch + d[None, :], v,
                 mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V rows at its slot (shapes above); the caches are written in place."""
    T, Hkv, Dh = k.shape
    if T == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    _cache_write_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), NUM_HEADS=Hkv, HEAD_DIM=Dh, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(Hkv), BLOCK_D=triton.next_power_of_2(Dh))
