"""Our Triton variable-length attention for the vision towers: full (non-causal) attention
inside each segment of a packed sequence (an image's frame, a Qwen2.5-VL window, a CLIP image).

Imported only by the triton backend (it needs `triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.models.attention.online_softmax import range_loops
from mmserve.models.attention.tuning import device_arch, head_parts, prefill_tiles

# Shapes (P = rows of every segment packed, H = heads, Dh = head dim, S = segments):
#   q, k, v, out: [P, H, Dh]; cu: [S + 1] int32, segment s is rows cu[s] .. cu[s + 1]
# One program per (segment, block of BLOCK_M queries, head); it loops over its segment's keys in
# tiles of BLOCK_N. The head is held in two parts of power-of-two lanes (`tuning.head_parts`, as
# `tl.dot` wants): D0 lanes from 0, and D1 lanes from D0 (none when D1 == 0), so a head of 80 is
# 64 + 16 lanes, not 128; each score is the sum of both parts' dots, each part of the output its own
# dot with the probabilities. Masks: query rows past the segment are computed and not stored; key
# rows past the segment score -inf; lanes >= Dh (padding of the last part) load as 0. A program
# whose query block starts past its segment's end returns at once (the grid is sized by the longest).


@triton.jit
def _rows(ptr, rows, row_ok, stride_t, FIRST: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[len(rows), WIDTH]: lanes FIRST .. FIRST + WIDTH of `rows` of the head `ptr` points at (0 past
    Dh or a row not ok)."""
    d = FIRST + tl.arange(0, WIDTH)
    return tl.load(ptr + rows[:, None] * stride_t + d[None, :], mask=row_ok[:, None] & (d < HEAD_DIM)[None, :],
                   other=0.0)


@triton.jit
def _store_rows(ptr, x, rows, row_ok, stride_t, FIRST: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Store x [len(rows), WIDTH] at lanes FIRST .. FIRST + WIDTH of `rows` of the head `ptr` points at."""
    d = FIRST + tl.arange(0, WIDTH)
    tl.store(ptr + rows[:, None] * stride_t + d[None, :], x.to(ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])


@triton.jit
def _head(ptr, lo, stride_t, head, stride_h, ALIGN: tl.constexpr):
    """Where one head of a segment's first row starts: `ALIGN` (elements) divides its offset, so
    rows load in vectors of up to ALIGN lanes when the strides allow (a head of 72: 8, not 1)."""
    return ptr + lo * stride_t + tl.multiple_of(head * stride_h, ALIGN)


@triton.jit
def _segment_tile(q0, q1, k_ptr, v_ptr, start, length, m_i, l_i, acc0, acc1, scale, stride_kt, stride_vt,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr):
    """The segment's keys start .. start + BLOCK_N (those < length) folded into the running softmax
    (m_i, l_i: [BLOCK_M] float32) and the two parts of its sum of values (acc0 [BLOCK_M, D0], acc1
    [BLOCK_M, D1]; acc1 and q1 pass through untouched when D1 == 0); k_ptr, v_ptr point at the
    head of the segment's first row."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < length
    k0 = _rows(k_ptr, keys, key_ok, stride_kt, 0, D0, HEAD_DIM)  # [BLOCK_N, D0]
    s = tl.dot(q0, tl.trans(k0), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    if D1 > 0:
        k1 = _rows(k_ptr, keys, key_ok, stride_kt, D0, D1, HEAD_DIM)  # [BLOCK_N, D1]
        s += tl.dot(q1, tl.trans(k1), input_precision="ieee")
    s = tl.where(key_ok[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    v0 = _rows(v_ptr, keys, key_ok, stride_vt, 0, D0, HEAD_DIM)
    acc0 = acc0 * alpha[:, None] + tl.dot(p.to(v0.dtype), v0, input_precision="ieee")
    if D1 > 0:
        v1 = _rows(v_ptr, keys, key_ok, stride_vt, D0, D1, HEAD_DIM)
        acc1 = acc1 * alpha[:, None] + tl.dot(p.to(v1.dtype), v1, input_precision="ieee")
    return m_new, l_i * alpha + tl.sum(p, 1), acc0, acc1


@triton.jit
def _varlen_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, scale,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_ot, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, ALIGN: tl.constexpr,
                             RANGE_LOOP: tl.constexpr):
    segment = tl.program_id(0)
    q_block = tl.program_id(1)
    head = tl.program_id(2)
    lo = tl.load(cu_ptr + segment)
    length = tl.load(cu_ptr + segment + 1) - lo
    if q_block * BLOCK_M < length:
        rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < length
        q_seg = _head(q_ptr, lo, stride_qt, head, stride_qh, ALIGN)
        k_seg = _head(k_ptr, lo, stride_kt, head, stride_kh, ALIGN)
        v_seg = _head(v_ptr, lo, stride_vt, head, stride_vh, ALIGN)
        q0 = _rows(q_seg, rows, row_ok, stride_qt, 0, D0, HEAD_DIM)  # [BLOCK_M, D0]
        acc0 = tl.zeros([BLOCK_M, D0], tl.float32)
        if D1 > 0:
            q1 = _rows(q_seg, rows, row_ok, stride_qt, D0, D1, HEAD_DIM)  # [BLOCK_M, D1]
            acc1 = tl.zeros([BLOCK_M, D1], tl.float32)
        else:  # one part: the second's placeholders, never read
            q1, acc1 = q0, acc0
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        if RANGE_LOOP:
            for start in range(0, length, BLOCK_N):
                m_i, l_i, acc0, acc1 = _segment_tile(q0, q1, k_seg, v_seg, start, length, m_i, l_i, acc0, acc1,
                                                     scale, stride_kt, stride_vt, HEAD_DIM, BLOCK_N, D0, D1)
        else:
            start = length * 0
            while start < length:
                m_i, l_i, acc0, acc1 = _segment_tile(q0, q1, k_seg, v_seg, start, length, m_i, l_i, acc0, acc1,
                                                     scale, stride_kt, stride_vt, HEAD_DIM, BLOCK_N, D0, D1)
                start += BLOCK_N
        o_seg = _head(out_ptr, lo, stride_ot, head, stride_oh, ALIGN)
        _store_rows(o_seg, acc0 / l_i[:, None], rows, row_ok, stride_ot, 0, D0, HEAD_DIM)
        if D1 > 0:
            _store_rows(o_seg, acc1 / l_i[:, None], rows, row_ok, stride_ot, D0, D1, HEAD_DIM)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                     scale: float, parts: tuple[int, int] | None = None) -> torch.Tensor:
    """Full attention inside each segment (shapes above); `max_len` (the longest segment) sizes the
    grid and picks the tiles (`tuning.py`, with the head size and dtype); `parts` overrides the
    head's lanes (`head_parts`; the benchmark times one padded part beside them)."""
    P, H, Dh = q.shape
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    out = torch.empty_like(q)
    tiles = prefill_tiles(Dh, q.element_size(), max_len, max_len, device_arch(q.device))
    d0, d1 = parts or head_parts(Dh)
    grid = (cu.shape[0] - 1, triton.cdiv(max_len, tiles.block_m), H)
    _varlen_attention_kernel[grid](
        q, k, v, out, cu, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), HEAD_DIM=Dh, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, D0=d0, D1=d1,
        ALIGN=head_alignment([t.stride(1) for t in (q, k, v, out)], q.element_size()),
        RANGE_LOOP=range_loops(q.device), num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def head_alignment(head_strides: list[int], itemsize: int) -> int:
    """The largest power of two of elements, at most 16 bytes' worth, dividing every head stride:
    what `_head` promises the compiler of each head's offset (Triton specialises an int argument
    divisible by 16 itself, not one of 72)."""
    align = 16 // itemsize
    while any(stride % align for stride in head_strides):
        align //= 2
    return align
