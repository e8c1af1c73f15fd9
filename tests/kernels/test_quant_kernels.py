"""Our Triton kernels for quantized weights (models/quantization/triton_kernels.py) against
dequantize-then-matmul: int4 and int8 (groups, zero points) and FP8 (per row, per block with partial
blocks, subnormal and negative codes), through the decode GEMV (split over K) and the prefill
GEMM, with and without a bias; interpreted on the CPU where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from helpers.resident_weights import random_fp8, random_int4, random_int8
from helpers.triton_device import DEVICE
from mmserve.models.quantization import int8
from mmserve.models.quantization.int4 import dequantize_rows

pytest.importorskip("triton")

from mmserve.models.quantization import triton_kernels  # noqa: E402

GEN = torch.Generator().manual_seed(0)


def _check(got: torch.Tensor, x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None) -> None:
    want = x.double() @ W.double().t() + (0 if bias is None else bias.double())
    bound = (x.abs().double() @ W.abs().double().t()) * x.shape[1] * 2**-22 + 1e-6
    assert ((got.cpu().double() - want).abs() <= bound).all()


@pytest.mark.parametrize("M", [1, 3, 20])
@pytest.mark.parametrize("N, K, group", [(24, 96, 32), (40, 256, 128)])
def test_int4_linear_equals_dequantize_then_matmul(M, N, K, group):
    qweight, scales, zeros = random_int4(N, K, group, GEN)
    x, bias = torch.randn(M, K, generator=GEN), (torch.randn(N, generator=GEN) if M != 3 else None)
    got = triton_kernels.int4_linear(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), group,
                                     None if bias is None else bias.to(DEVICE))
    _check(got, x, dequantize_rows(qweight, scales, zeros, group), bias)


@pytest.mark.parametrize("M", [1, 3, 20])
@pytest.mark.parametrize("N, K, group", [(24, 96, 32), (40, 256, 128), (8, 1024, 1024)])  # the last: one group a row
def test_int8_linear_equals_dequantize_then_matmul(M, N, K, group):
    codes, scales, zeros = random_int8(N, K, group, GEN)
    x, bias = torch.randn(M, K, generator=GEN), (torch.randn(N, generator=GEN) if M != 3 else None)
    got = triton_kernels.int8_linear(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), group,
                                     None if bias is None else bias.to(DEVICE))
    _check(got, x, int8.dequantize_rows(codes, scales, zeros, group), bias)


@pytest.mark.parametrize("M", [1, 20])
@pytest.mark.parametrize("N, K, block", [(24, 64, None), (40, 96, (16, 32)), (33, 72, (16, 16)),
                                         (40, 200, (128, 128))])  # whole 64-key tiles in a block: one scale a row
def test_fp8_linear_equals_dequantize_then_matmul(M, N, K, block):
    weight, scale, W = random_fp8(N, K, block, GEN)
    x = torch.randn(M, K, generator=GEN)
    got = triton_kernels.fp8_linear(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), block, None)
    _check(got, x, W, None)


def test_a_decode_gemv_splits_k_when_the_output_is_narrow():
    """8 outputs over K = 1024: too few columns for the SMs, so K is split and summed."""
    N, K = 8, 1024
    qweight = torch.randint(-2**31, 2**31 - 1, (N, K // 8), dtype=torch.int32, generator=GEN)
    scales, zeros = torch.rand(N, K // 128, generator=GEN), torch.full((N, K // 128), 8, dtype=torch.uint8)
    x = torch.randn(1, K, generator=GEN)
    got = triton_kernels.int4_linear(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), 128, None)
    _check(got, x, dequantize_rows(qweight, scales, zeros, 128), None)
