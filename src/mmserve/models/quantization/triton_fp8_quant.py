"""FP8 (e4m3) activations for `torch._scaled_mm` on the GPU in one launch: each row of x [M, K]
(a step's tokens) scaled by its own s = max(max|x| / 448, 1e-12) (dynamic, vLLM's per-token scheme)
or by one static s [1], divided, clamped to +-448 and rounded to e4m3, to nearest even: fp8.py's
`quantize_rows`, bit for bit. Torch's ops for the same (abs, amax, two divisions, two clamps, the
cast) are seven launches per linear layer of a decode step.

The rounding is done in float32 before the cast: p's quantum is 2^(e - 3) for its binary exponent
e (at least -6: e4m3's subnormals share the quantum 2^-9), p / quantum is exact (a power of two),
rounded half to even by floor(t + 0.5) less one on an odd tie, and times the quantum again exact;
the cast of a value on the e4m3 grid is then exact on every backend (Triton's interpreter rounds
an fp8 cast's ties away from zero, the hardware to even). Divisions are IEEE's (`div_rn`) and
contraction off (`enable_fp_fusion`), as in triton_int8_mm.py. Imported only where `triton` is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

QUANT_BLOCK = 1024  # columns of x a program reads at a time
FP8_MAX = 448.0


@triton.jit
def _round_e4m3(p):
    """p (float32, |p| <= 448) to the nearest e4m3 value, ties to even, as float32 (its sign kept:
    a negative p that rounds to zero is -0, as the cast gives it)."""
    bits = p.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # biased; below e4m3's least normal: the subnormals'
    quantum = ((exponent - 3) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    inverse = ((254 - (exponent - 3)) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    t = tl.abs(p) * inverse
    r = tl.floor(t + 0.5)
    r = tl.where((r - t == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)  # a tie: to even
    return tl.where(bits < 0, -(r * quantum), r * quantum)


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_xm, STATIC: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row `program_id(0)` of x: its scale (or the static one), then its e4m3 codes."""
    row = tl.program_id(0)
    if STATIC:
        s = tl.load(static_ptr)
    else:
        peak = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            peak = tl.maximum(peak, tl.abs(tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)))
        s = tl.maximum(tl.math.div_rn(tl.max(peak, axis=0), 448.0), 1e-12)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        p = tl.math.div_rn(tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32), s)
        p = tl.minimum(tl.maximum(p, -448.0), 448.0)
        tl.store(q_ptr + row * K + k, _round_e4m3(p).to(tl.float8e4nv), mask=k < K)
    tl.store(s_ptr + row, s)


def quantize_rows(x: torch.Tensor, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q float8_e4m3fn [M, K], s float32 [M, 1]): fp8.py's
    `quantize_rows` in one launch (by the `static` scale [1] float32 where given)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        _fp8_rows_kernel[(M,)](x, q, s, s if static is None else static, K, x.stride(0), STATIC=static is not None,
                               BLOCK_K=QUANT_BLOCK, enable_fp_fusion=False)
    return q, s
