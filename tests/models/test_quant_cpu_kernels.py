"""The C kernels of quantized weights (models/quantization/csrc/quant_gemv.c) against
dequantize-then-matmul: decode GEMVs equal up to the order of sums, dequantized row tiles bit
for bit, on int4 (groups, zero points) and FP8 (per row, per block, partial blocks, subnormals)."""

from __future__ import annotations

import pytest
import torch

from helpers.quant_checkpoints import random_fp8, random_int4
from mmserve.models.quantization import cpu_gemv
from mmserve.models.quantization.int4 import dequantize_rows

pytestmark = pytest.mark.skipif(cpu_gemv.load() is None, reason="no C compiler for the CPU kernels")

GEN = torch.Generator().manual_seed(0)


def _close(got: torch.Tensor, x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None,
           magnitude: torch.Tensor | None = None) -> None:
    """Equal to x W^T (+ b) within float32 summation's error: K ulps of the sum of |x| times
    `magnitude` (|W|; for int4, whose kernel sums x * code and subtracts zero * sum x per
    group, 16 scales: the largest term of either sum)."""
    want = x.double() @ W.double().t() + (0 if bias is None else bias.double())
    size = W.abs() if magnitude is None else magnitude
    bound = (x.abs().double() @ size.double().t()) * x.shape[1] * 2**-23 + 1e-6
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("M", [1, 3, 8, 11])
@pytest.mark.parametrize("N, K, group", [(24, 64, 32), (40, 256, 256), (8, 128, 8), (16, 384, 128), (8, 128, 64)])
def test_int4_gemv_equals_dequantize_then_matmul(M, N, K, group):
    qweight, scales, zeros = random_int4(N, K, group, GEN)
    x, bias = torch.randn(M, K, generator=GEN), torch.randn(N, generator=GEN)
    W = dequantize_rows(qweight, scales, zeros, group)
    got = cpu_gemv.int4_gemv(x, qweight, scales, zeros, group, bias)
    assert got is not None
    _close(got, x, W, bias, 16 * scales.repeat_interleave(group, dim=1))
    assert torch.equal(cpu_gemv.int4_rows(qweight, scales, zeros, group, 5, N), W[5:])


@pytest.mark.parametrize("M", [1, 9])
@pytest.mark.parametrize("N, K, block", [(24, 64, None), (40, 96, (16, 32)), (33, 72, (16, 16))])
def test_fp8_gemv_equals_dequantize_then_matmul(M, N, K, block):
    weight, scale, W = random_fp8(N, K, block, GEN)  # W: torch's e4m3 decoding, the reference
    x = torch.randn(M, K, generator=GEN)
    got = cpu_gemv.fp8_gemv(x, weight, scale, block, None)
    assert got is not None
    _close(got, x, W, None)
    assert torch.equal(cpu_gemv.fp8_rows(weight, scale, block, 2, N), W[2:])


def test_more_rows_than_a_gemv_takes_are_left_to_the_tiles():
    qweight, scales, zeros = random_int4(8, 64, 32, GEN)
    x = torch.randn(cpu_gemv.GEMV_MAX_ROWS + 1, 64)
    assert cpu_gemv.int4_gemv(x, qweight, scales, zeros, 32, None) is None
