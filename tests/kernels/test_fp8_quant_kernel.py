"""FP8 activations for the GPU's `torch._scaled_mm` (models/quantization/triton_fp8_quant.py):
rows of x quantized in one launch, bit for bit fp8.py's torch `quantize_rows` (dynamic per-token
scales and a static one): magnitudes across e4m3's range and its subnormals, values on rounding
ties (to even), clamped ones, a row of zeros, float32 and bfloat16 in, a strided view; interpreted
on the CPU where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from helpers.triton_device import DEVICE
from mmserve.models.quantization.fp8 import FP8, FP8_MAX, quantize_rows

pytest.importorskip("triton")

from mmserve.models.quantization import triton_fp8_quant  # noqa: E402

GEN = torch.Generator().manual_seed(0)
# on e4m3's grid at scale 1: halfway between neighbours (ties: to even), just off them, subnormal ties
TIES = [1.0625, 1.1875, 2.125, 2.375, -1.0625, 0.0029296875, 0.0048828125, 1.0625 + 2**-20, 1.0625 - 2**-20,
        300.0, 440.0, -0.0, 0.0, 2**-10, 3 * 2**-11, -2**-11, -1e-30]


def _rows(dtype: torch.dtype, K: int) -> torch.Tensor:
    x = torch.randn(6, 2 * K, generator=GEN) * torch.logspace(-5, 3, 6)[:, None]
    x[1] = 0
    x[2, : len(TIES)] = torch.tensor(TIES)
    x[2, len(TIES):] = 0
    x[2, 0] = FP8_MAX  # row 2's scale is 1: its values land on the ties as written
    return x.to(dtype)[:, :K]  # rows 2K apart


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [20, 2500])
def test_the_one_launch_quantization_is_the_torch_one_bit_for_bit(dtype, K):
    x = _rows(dtype, K)
    q, s = triton_fp8_quant.quantize_rows(x.to(DEVICE))
    want_q, want_s = quantize_rows(x)
    assert q.dtype == FP8 and s.shape == (6, 1)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s.cpu(), want_s)
    assert float(want_s[2]) == 1.0 and float(want_s[1]) == pytest.approx(1e-12)  # a row of zeros: the floor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_static_scale_quantizes_every_row_by_it(dtype):
    x = _rows(dtype, 300)
    static = torch.tensor([0.5])
    q, s = triton_fp8_quant.quantize_rows(x.to(DEVICE), static.to(DEVICE))
    want_q, want_s = quantize_rows(x, static)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s.cpu(), want_s)
    assert want_s.tolist() == [[0.5]] * 6


def test_ties_round_to_even_and_values_clamp_at_448():
    """The definition itself (torch's cast): what the kernel is held to."""
    x = torch.tensor([[FP8_MAX, 1.0625, 1.1875, 2.125, 0.0029296875, 440.0, 1000.0, -1000.0]])
    q, s = quantize_rows(x, torch.tensor([1.0]))
    assert q.float().tolist() == [[448.0, 1.0, 1.25, 2.0, 0.00390625, 448.0, 448.0, -448.0]]


def test_no_rows_launch_nothing():
    q, s = triton_fp8_quant.quantize_rows(torch.empty(0, 64, device=DEVICE))
    assert q.shape == (0, 64) and s.shape == (0, 1)
