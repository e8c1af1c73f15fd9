"""Our Triton kernels for quantized weights on the GPU: y = x W^T (+ b) with W dequantized in
registers, tile by tile: a GEMM for prefill (`tl.dot` over [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N])
and a GEMV for decode (a few rows of x: no padding to the dot's 16 rows), split over K when the
output has too few columns to give every SM a program (partial sums added by one torch sum).

Formats (the resident forms of int4.py, int8.py and fp8.py, `KIND`): int4 — `w` int32 [N, K / 8]
(nibble k of word j = column 8j + k), `scales` float32 and `zeros` uint8 [N, K / group], W = (code -
zero) * scale; int8 — `w` uint8 [N, K] codes, `scales` float32 and `zeros` int16 [N, K / group], W =
(code - zero) * scale; FP8 — `w` the e4m3fn weight viewed as uint8 [N, K], `scales` float32 [N] (per row) or
[ceil(N / bo), ceil(K / bi)] (per block), W = e4m3(w) * scale, e4m3 decoded by bit shifts (exact,
and the same under the interpreter, which has no FP8). W's tile is cast to x's dtype before the
dot (what dequantize-then-matmul in that dtype multiplies); sums are float32.

Shapes and masks: x [M, K] (row stride `stride_xm`), y [M, N]; rows of x past M and columns of W
past N load as 0 and are not stored; K need not be a multiple of BLOCK_K (columns past K load as
0). No host sync: grids come from shapes, so the decode graphs can capture them.
Imported only where `triton` is (the CUDA path and the interpreter's tests).

At the 7B's shapes (Qwen2.5-VL-7B: hidden 3584, MLP 18944, 28 query and 4 KV heads of 128), a
decode step's GEMVs are Q/K/V fused N 4608 x K 3584 (144 column blocks of 32: one split), o_proj
3584 x 3584 (112 blocks: 2 splits), gate/up fused 37888 x 3584 (1184 blocks), down 3584 x 18944
(112 blocks: 2 splits): 144 to 1184 programs, every SM busy at batch 1. A prefill's GEMM tiles
64 x 64: 1,024 tokens give 16 x 72 programs for Q/K/V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 2^120: an e4m3 exponent field moved to float32's, rebiased. A kernel reads a global only when it
# is a `tl.constexpr` (the compiler refuses a plain float; the interpreter does not).
TWO_TO_120 = tl.constexpr(1.329227995784916e36)
GEMV_MAX_ROWS = 16  # rows of x up to which the GEMV runs (the dot wants 16 rows or more)
TARGET_PROGRAMS = 264  # twice an H100's SMs: what split-K aims the GEMV's grid at
BLOCK_K = 64  # columns of W per tile, in both kernels
FP8, INT4, INT8 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # the weight's format (`KIND`)


@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, n, k_start, n_ok, K, group, bo, bi, KIND: tl.constexpr,
                 BLOCKED: tl.constexpr, ONE_SCALE: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[n, k_start .. k_start + BLOCK_K] float32 [BLOCK_N, BLOCK_K] (0 where masked). ONE_SCALE: the
    tile lies inside one quantization group (int4, int8) or block column (FP8), so each row's
    scale (and zero) is one load, not one per lane. int4 words are loaded once each ([BLOCK_N,
    BLOCK_K / 8]) and widened in registers: each word repeated over its 8 lanes by three
    interleaves, then each lane's nibble shifted out."""
    k = k_start + tl.arange(0, BLOCK_K)
    k_ok = k < K
    mask = n_ok[:, None] & k_ok[None, :]
    if KIND != FP8:
        if KIND == INT4:
            j = k_start // 8 + tl.arange(0, BLOCK_K // 8)  # the tile's words along K
            words = tl.load(w_ptr + n[:, None] * (K // 8) + j[None, :], mask=n_ok[:, None] & (j < K // 8)[None, :],
                            other=0)  # [BLOCK_N, BLOCK_K / 8]
            words = tl.interleave(words, words)
            words = tl.interleave(words, words)
            words = tl.interleave(words, words)  # [BLOCK_N, BLOCK_K]: lane k holds word k // 8
            codes = (words >> ((k % 8) * 4)[None, :]) & 15
        else:
            codes = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=mask, other=0).to(tl.int32)
        if ONE_SCALE:
            at = n * (K // group) + k_start // group  # [BLOCK_N]
            zeros = tl.load(z_ptr + at, mask=n_ok, other=0).to(tl.int32)[:, None]
            scales = tl.load(s_ptr + at, mask=n_ok, other=0.0)[:, None]
        else:
            at = n[:, None] * (K // group) + (k // group)[None, :]
            zeros = tl.load(z_ptr + at, mask=mask, other=0).to(tl.int32)
            scales = tl.load(s_ptr + at, mask=mask, other=0.0)
        return tl.where(mask, (codes - zeros).to(tl.float32) * scales, 0.0)
    b = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=mask, other=0).to(tl.int32)
    bits = ((b & 0x7F) << 20) | ((b & 0x80) << 24)
    values = bits.to(tl.float32, bitcast=True) * TWO_TO_120
    if BLOCKED and ONE_SCALE:
        scales = tl.load(s_ptr + (n // bo) * tl.cdiv(K, bi) + k_start // bi, mask=n_ok, other=0.0)[:, None]
    elif BLOCKED:
        scales = tl.load(s_ptr + (n // bo)[:, None] * tl.cdiv(K, bi) + (k // bi)[None, :], mask=mask, other=0.0)
    else:
        scales = tl.load(s_ptr + n, mask=n_ok, other=0.0)[:, None]
    return values * scales


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, group, bo, bi, stride_xm, stride_ym,
                 KIND: tl.constexpr, BLOCKED: tl.constexpr, ONE_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = _weight_tile(w_ptr, s_ptr, z_ptr, n, k0, n_ok, K, group, bo, bi, KIND, BLOCKED, ONE_SCALE, BLOCK_K)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, part_ptr, M, N, K, k_per_split, group, bo, bi, stride_xm,
                 KIND: tl.constexpr, BLOCKED: tl.constexpr, ONE_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """One row of x, BLOCK_N outputs, K's split `program_id(2)`: partial sums [split, M, N] float32."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row, split = tl.program_id(1), tl.program_id(2)
    n_ok = n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):  # bounds not from program ids: the interpreter's range()
        k_start = split * k_per_split + k0
        k = k_start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0)
        w = _weight_tile(w_ptr, s_ptr, z_ptr, n, k_start, n_ok, K, group, bo, bi, KIND, BLOCKED, ONE_SCALE, BLOCK_K)
        acc += tl.sum(w.to(x.dtype).to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(part_ptr + (split * M + row) * N + n, acc, mask=n_ok)


def _run(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, N: int, K: int,
         group: int, block: tuple[int, int] | None, bias: torch.Tensor | None, kind: int) -> torch.Tensor:
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    bo, bi = block or (1, 1)
    zeros = scales if zeros is None else zeros  # unread by the FP8 tiles
    one_scale = (bi if kind == FP8.value else group) % BLOCK_K == 0
    if M <= GEMV_MAX_ROWS:
        BLOCK_N = 32
        columns = triton.cdiv(N, BLOCK_N) * M
        splits = max(1, min(triton.cdiv(K, 4 * BLOCK_K), TARGET_PROGRAMS // columns))
        k_per_split = triton.cdiv(triton.cdiv(K, splits), BLOCK_K) * BLOCK_K
        splits = triton.cdiv(K, k_per_split)
        parts = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
        _gemv_kernel[(triton.cdiv(N, BLOCK_N), M, splits)](
            rows, w, scales, zeros, parts, M, N, K, k_per_split, group, bo, bi, rows.stride(0),
            KIND=kind, BLOCKED=block is not None, ONE_SCALE=one_scale,
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
        y = parts.sum(0) if bias is None else parts.sum(0) + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], N)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    BLOCK_M, BLOCK_N = 64, 64
    _gemm_kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))](
        rows, w, scales, zeros, bias if bias is not None else y, y, M, N, K, group, bo, bi, rows.stride(0),
        y.stride(0), KIND=kind, BLOCKED=block is not None, ONE_SCALE=one_scale,
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y.reshape(*x.shape[:-1], N)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [.., K] @ W^T (+ bias) for an int4 weight (int4.py's resident form)."""
    return _run(x, qweight, scales, zeros, qweight.shape[0], qweight.shape[1] * 8, group, None, bias, kind=INT4.value)


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [.., K] @ W^T (+ bias) for an int8 weight (int8.py's resident form)."""
    return _run(x, codes, scales, zeros, codes.shape[0], codes.shape[1], group, None, bias, kind=INT8.value)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None) -> torch.Tensor:
    """x [.., K] @ W^T (+ bias) for an FP8 weight (fp8.py's resident form: per row or per block)."""
    N, K = weight.shape
    return _run(x, weight.view(torch.uint8), scale, None, N, K, 1, block, bias, kind=FP8.value)
