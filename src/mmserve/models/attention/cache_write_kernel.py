"""Our Triton KV-cache writes: each token's key and value rows into their cache slots, as they
are or with the rotary applied to q and k on the way (one launch for a decoder layer's both).

Imported only by the triton backend (it needs `triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.models.attention.layer_kernels import load_rotation, rotate_heads
from mmserve.models.layers import QKNorm

# Shapes (T = tokens of the step, Hkv = key/value heads, Dh = head dim, N = blocks, S = block size):
#   k, v: [T, Hkv, Dh]; k_cache, v_cache: [N, S, Hkv, Dh]
#   slot_mapping: [T] int64, slot = block * S + offset; a negative slot is a padded token (a
#   captured graph's unused row) and writes nothing
# One program per BLOCK_T tokens; a token's Hkv x Dh values are one row of BLOCK_C lanes (c = head
# * Dh + d). Masks: tokens past T and padded tokens are neither loaded nor stored, nor are lanes
# c >= Hkv * Dh (padding to a power of two). The cache may be of another dtype than k's and v's
# (`--kv-cache-dtype`): each value is rounded to the cache's as it is stored.


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
    tl.store(k_cache_ptr + block * stride_kb + offset * stride_ks + head[None, :] * stride_kch + d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vb + offset * stride_vs + head[None, :] * stride_vch + d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


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


# Rotary + write (`rotary_write_kv_cache`): q [T, H, Dh] and k, v [T, Hkv, Dh] (rows may be strided
# views of a fused QKV output), cos, sin [T, Dh]; q_out [T, H, Dh] contiguous. One program per
# token: its q heads rotated into q_out, its k heads rotated into the cache at its slot, its v
# heads copied there. Masks: heads past H or Hkv and lanes past Dh / 2 or Dh (padding to powers of
# two) load 0 and store nothing; a padded token (negative slot) writes no cache row. Rotated k is
# rounded to q's dtype first (as the torch backend's rotary makes it), then to the cache's. NORM
# (Qwen3): every q and k head RMS-normalised by its weight [Dh] before the rotary, as
# `LayerOps.qk_norm` would in a launch of its own.


@triton.jit
def _rotary_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                         q_norm_ptr, k_norm_ptr, eps,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
                         stride_ot, stride_oh, stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch,
                         HQ: tl.constexpr, HK: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_H: tl.constexpr, NORM: tl.constexpr):
    t, c, ok, cos1, cos2, sin1, sin2 = load_rotation(cos_ptr, sin_ptr, stride_ct, HALF, BLOCK_HALF)
    rotate_heads(q_ptr + t * stride_qt, stride_qh, q_out_ptr + t * stride_ot, stride_oh, HQ, c, ok,
                 cos1, cos2, sin1, sin2, HALF, BLOCK_H, False, q_norm_ptr, eps, NORM)
    slot = tl.load(slot_mapping_ptr + t)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    rotate_heads(k_ptr + t * stride_kt, stride_kh, k_cache_ptr + block * stride_kb + offset * stride_ks, stride_kch,
                 HK, c, ok & (c * 0 + slot >= 0), cos1, cos2, sin1, sin2, HALF, BLOCK_H, False, k_norm_ptr, eps, NORM)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # the slot's test broadcast as a vector: the interpreter refuses a scalar inside a block mask
    mask = (h < HK)[:, None] & ((d < HEAD_DIM) & (d * 0 + slot >= 0))[None, :]
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(v_cache_ptr + block * stride_vb + offset * stride_vs + h[:, None] * stride_vch + d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotary_write_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          qk_norm: QKNorm | None = None) -> torch.Tensor:
    """q and k (each head first RMS-normalised by `qk_norm`'s weights when given: Qwen3) rotated
    by cos, sin ([T, 1, Dh], rotate-half), the rotated k and v stored at each token's slot (shapes
    above); returns the rotated q [T, H, Dh], contiguous. q, k, v are unchanged."""
    T, H, Dh = q.shape
    Hkv = k.shape[1]
    q_out = torch.empty(T, H, Dh, dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    cos, sin = cos.reshape(T, Dh), sin.reshape(T, Dh)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and cos.stride(1) == 1
    assert sin.stride() == cos.stride() and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)  # unread without norms
    _rotary_write_kernel[(T,)](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), cos.stride(0), q_out.stride(0), q_out.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HQ=H, HK=Hkv, HEAD_DIM=Dh, HALF=Dh // 2, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_HALF=triton.next_power_of_2(Dh // 2), BLOCK_D=triton.next_power_of_2(Dh),
        BLOCK_H=triton.next_power_of_2(max(H, Hkv)), NORM=qk_norm is not None, num_warps=4)
    return q_out
