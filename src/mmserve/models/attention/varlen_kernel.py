"""Our Triton variable-length attention for the vision towers: full (non-causal) attention
inside each segment of a packed sequence (an image's frame, a Qwen2.5-VL window, a CLIP image).

Imported only by the triton backend (it needs `triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.models.attention.online_softmax import attend_tile, range_loops
from mmserve.models.attention.tuning import prefill_tiles

# Shapes (P = rows of every segment packed, H = heads, Dh = head dim, S = segments):
#   q, k, v, out: [P, H, Dh]; cu: [S + 1] int32, segment s is rows cu[s] .. cu[s + 1]
# One program per (segment, block of BLOCK_M queries, head); it loops over its segment's keys in
# tiles of BLOCK_N. Masks: query rows past the segment are computed and not stored; key rows past
# the segment score -inf; head-dim lanes >= Dh (padding to BLOCK_D) load as 0. A program whose
# query block starts past its segment's end returns at once (the grid is sized by the longest).


@triton.jit
def _segment_tile(q, k_ptr, v_ptr, start, length, head, d, d_ok, m_i, l_i, acc, scale,
                  stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N: tl.constexpr):
    """The segment's keys start .. start + BLOCK_N (those < length) folded into the running
    softmax; k_ptr, v_ptr point at the segment's first row."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < length
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + keys[:, None] * stride_kt + head * stride_kh + d[None, :], mask=kv_mask,
                other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(v_ptr + keys[:, None] * stride_vt + head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    return attend_tile(q, k, v, key_ok[None, :], m_i, l_i, acc, scale)


@triton.jit
def _varlen_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, scale,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_ot, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, RANGE_LOOP: tl.constexpr):
    segment = tl.program_id(0)
    q_block = tl.program_id(1)
    head = tl.program_id(2)
    lo = tl.load(cu_ptr + segment)
    length = tl.load(cu_ptr + segment + 1) - lo
    if q_block * BLOCK_M < length:
        rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        row_ok = rows < length
        q = tl.load(q_ptr + (lo + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_seg, v_seg = k_ptr + lo * stride_kt, v_ptr + lo * stride_vt
        if RANGE_LOOP:
            for start in range(0, length, BLOCK_N):
                m_i, l_i, acc = _segment_tile(q, k_seg, v_seg, start, length, head, d, d_ok, m_i, l_i, acc, scale,
                                              stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N)
        else:
            start = length * 0
            while start < length:
                m_i, l_i, acc = _segment_tile(q, k_seg, v_seg, start, length, head, d, d_ok, m_i, l_i, acc, scale,
                                              stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N)
                start += BLOCK_N
        out = acc / l_i[:, None]
        tl.store(out_ptr + (lo + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                     scale: float) -> torch.Tensor:
    """Full attention inside each segment (shapes above); `max_len` (the longest segment) sizes the
    grid and picks the tiles (`tuning.py`, with the head size and dtype)."""
    P, H, Dh = q.shape
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    out = torch.empty_like(q)
    tiles = prefill_tiles(Dh, q.element_size(), max_len, max_len)
    grid = (cu.shape[0] - 1, triton.cdiv(max_len, tiles.block_m), H)
    _varlen_attention_kernel[grid](
        q, k, v, out, cu, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), HEAD_DIM=Dh, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(Dh)), RANGE_LOOP=range_loops(q.device), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    return out
