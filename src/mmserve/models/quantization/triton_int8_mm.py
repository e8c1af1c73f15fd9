"""Our Triton kernels for W8A8 on the GPU: a step's activations quantized per row in one launch
(`quantize_rows`: the arithmetic of w8a8.py's torch `quantize_rows`, bit for bit), and the GEMM
y = (q_x q_w^T) * s_x * s_w (+ b) with q_x int8 [M, K], q_w int8 [N, K], s_x float32 [M, 1], s_w
float32 [N]. `tl.dot` of int8 tiles accumulates in int32 (the tensor cores' int8 MMA on a GPU;
exact, as the interpreter's integer product is), the scales and bias applied in float32 in the
epilogue.

The quantization rounds as torch does: 127 / max|x| and max|x| / 127 (or x / s, by a static
scale s) by IEEE division (`div_rn`: Triton's `/` on float32 is an approximate division), x times
it rounded half to even by floor(p + 0.5) less one on an odd tie, with floating-point contraction
off (`enable_fp_fusion`: p + 0.5 fused into an FMA would round p's product differently).

A decode step's few rows take tiles of 16 rows (the dot's least) and K split over programs when
the output has too few column blocks to give every SM one: the splits' int32 sums go to a
buffer, added and scaled by torch (int32 sums are exact in any order). Longer steps take 64-row
tiles, no split. Grids come from shapes (no host sync: the decode graphs capture them). Imported
only where `triton` is (the CUDA path and the interpreter's tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SMALL_M = 16  # rows up to which the tile is 16 rows and K may be split
TARGET_PROGRAMS = 264  # twice an H100's SMs: what split-K aims the grid at
QUANT_BLOCK = 1024  # columns of x a quantizing program reads at a time


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK_K: tl.constexpr):
    """Row `program_id(0)` of x: its largest magnitude, then its codes and scale."""
    row = tl.program_id(0)
    peak = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(v))
    top = tl.max(peak, axis=0)
    inverse = tl.where(top > 0, tl.math.div_rn(127.0, tl.where(top > 0, top, 1.0)), 0.0)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        p = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32) * inverse
        t = tl.floor(p + 0.5)
        t = tl.where((t - p == 0.5) & (t - 2.0 * tl.floor(t * 0.5) != 0.0), t - 1.0, t)  # a tie: to even
        t = tl.minimum(tl.maximum(t, -128.0), 127.0)
        tl.store(q_ptr + row * K + k, t.to(tl.int8), mask=k < K)
    tl.store(s_ptr + row, tl.math.div_rn(top, 127.0))


@triton.jit
def _quant_static_kernel(x_ptr, q_ptr, s_ptr, scale_ptr, K, stride_xm, BLOCK_K: tl.constexpr):
    """Row `program_id(0)` of x by the one static scale: x / scale rounded half to even, clamped;
    the row's scale written out for the GEMM's epilogue."""
    row = tl.program_id(0)
    scale = tl.load(scale_ptr)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        p = tl.math.div_rn(tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32), scale)
        t = tl.floor(p + 0.5)
        t = tl.where((t - p == 0.5) & (t - 2.0 * tl.floor(t * 0.5) != 0.0), t - 1.0, t)  # a tie: to even
        t = tl.minimum(tl.maximum(t, -128.0), 127.0)
        tl.store(q_ptr + row * K + k, t.to(tl.int8), mask=k < K)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q int8 [M, K], s float32 [M, 1]): w8a8.py's `quantize_rows`
    in one launch (by the `static` scale [1] float32 where given)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.int8, device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M and static is not None:
        _quant_static_kernel[(M,)](x, q, s, static, K, x.stride(0), BLOCK_K=QUANT_BLOCK, enable_fp_fusion=False)
    elif M:
        _quant_rows_kernel[(M,)](x, q, s, K, x.stride(0), BLOCK_K=QUANT_BLOCK, enable_fp_fusion=False)
    return q, s


@triton.jit
def _int8_mm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, k_per_split, stride_xm,
                    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """Rows `program_id(0)`, columns `program_id(1)`, K's split `program_id(2)`. SPLIT: the int32
    sums to y [split, M, N]; else y [M, N] = sums * s_x * s_w (+ b) in y's dtype."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_ok, n_ok = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    for k0 in range(0, k_per_split, BLOCK_K):  # bounds not from program ids: the interpreter's range()
        k = split * k_per_split + k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        acc += tl.dot(a, tl.trans(b))
    if SPLIT:
        tl.store(y_ptr + (split * M + m[:, None]) * N + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        xs = tl.load(xs_ptr + m, mask=m_ok, other=0.0)
        ws = tl.load(ws_ptr + n, mask=n_ok, other=0.0)
        y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + m[:, None] * N + n[None, :], y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def int8_scaled_mm(q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """(q [M, K] int8 @ weight [N, K]^T int8) * s [M, 1] * scale [N] (+ bias), [M, N] in `dtype`.
    A program's int32 sum holds up to 127 * 128 * K: exact for K below 132,000 columns."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    M, K = q.shape
    N = weight.shape[0]
    s = s.reshape(-1)
    if M == 0:
        return torch.empty(0, N, dtype=dtype, device=q.device)
    if M <= SMALL_M:
        BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 128
        columns = triton.cdiv(N, BLOCK_N)
        splits = max(1, min(triton.cdiv(K, 2 * BLOCK_K), TARGET_PROGRAMS // columns))
    else:
        BLOCK_M, BLOCK_N, BLOCK_K, splits = 64, 64, 64, 1
    k_per_split = triton.cdiv(triton.cdiv(K, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(K, k_per_split)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), splits)
    if splits > 1:
        parts = torch.empty(splits, M, N, dtype=torch.int32, device=q.device)
        _int8_mm_kernel[grid](q, s, weight, scale, parts, parts, M, N, K, k_per_split, q.stride(0),
                              SPLIT=True, HAS_BIAS=False, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
        y = parts.sum(0).float() * s[:, None] * scale
        return (y if bias is None else y + bias.float()).to(dtype)
    y = torch.empty(M, N, dtype=dtype, device=q.device)
    _int8_mm_kernel[grid](q, s, weight, scale, bias if bias is not None else y, y, M, N, K, k_per_split,
                          q.stride(0), SPLIT=False, HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                          BLOCK_K=BLOCK_K)
    return y
