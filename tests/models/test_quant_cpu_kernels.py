"""The C kernels of quantized weights (models/quantization/csrc/) against dequantize-then-matmul:
decode GEMVs equal up to the order of sums, by the AVX-512 library where the machine has it and
by the other (AVX2 or plain C) in every case, dequantized row tiles bit for bit, on int4 and int8
(groups, zero points) and FP8 (per row, per block, partial blocks, subnormals)."""

from __future__ import annotations

import pytest
import torch

from helpers.resident_weights import random_fp8, random_int4, random_int8
from mmserve.models.quantization import cpu_gemv, int8
from mmserve.models.quantization.base import tiled_linear
from mmserve.models.quantization.int4 import dequantize_rows

pytestmark = pytest.mark.skipif(cpu_gemv.load() is None, reason="no C compiler for the CPU kernels")

GEN = torch.Generator().manual_seed(0)
WIDE = [False, pytest.param(True, marks=pytest.mark.skipif(cpu_gemv.load_wide() is None, reason="no AVX-512"))]


@pytest.fixture(params=WIDE, ids=["avx2", "avx512"])
def wide(request, monkeypatch):
    """Each GEMV test by either library: the AVX-512 one (where built) or the other alone."""
    monkeypatch.setattr(cpu_gemv, "WIDE", request.param)
    return request.param


def _close(got: torch.Tensor, x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None,
           magnitude: torch.Tensor | None = None) -> None:
    """Equal to x W^T (+ b) within float32 summation's error: K ulps of the sum of |x| times
    `magnitude` (|W|; for int4, whose kernel sums x * code and subtracts zero * sum x per
    group, 16 scales: the largest term of either sum)."""
    want = x.double() @ W.double().t() + (0 if bias is None else bias.double())
    size = W.abs() if magnitude is None else magnitude
    bound = (x.abs().double() @ size.double().t()) * x.shape[1] * 2**-23 + 1e-6
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("M", [1, 3, 6, 8, 11, 19])
@pytest.mark.parametrize("N, K, group", [(24, 64, 32), (40, 256, 256), (8, 128, 8), (16, 384, 128), (8, 128, 64),
                                         (12, 512, 256), (20, 256, 128)])
def test_int4_gemv_equals_dequantize_then_matmul(M, N, K, group, wide):
    qweight, scales, zeros = random_int4(N, K, group, GEN)
    x, bias = torch.randn(M, K, generator=GEN), torch.randn(N, generator=GEN)
    W = dequantize_rows(qweight, scales, zeros, group)
    got = cpu_gemv.int4_gemv(x, qweight, scales, zeros, group, bias)
    assert got is not None
    _close(got, x, W, bias, 16 * scales.repeat_interleave(group, dim=1))
    assert torch.equal(cpu_gemv.int4_rows(qweight, scales, zeros, group, 5, N), W[5:])


@pytest.mark.parametrize("M", [1, 3, 8, 11, 64, 65])
@pytest.mark.parametrize("N, K, group", [(24, 64, 32), (40, 256, 256), (8, 128, 8), (16, 384, 128)])
def test_int8_gemv_equals_dequantize_then_matmul(M, N, K, group):
    """GPTQ 8-bit's and W8A16's resident form (no AVX-512 version: the AVX2 or plain C library);
    more rows than a GEMV takes are left to the tiles, which the C kernel dequantizes."""
    codes, scales, zeros = random_int8(N, K, group, GEN)
    x, bias = torch.randn(M, K, generator=GEN), torch.randn(N, generator=GEN)
    W = int8.dequantize_rows(codes, scales, zeros, group)
    got = cpu_gemv.int8_gemv(x, codes, scales, zeros, group, bias)
    if M > cpu_gemv.INT8_GEMV_MAX_ROWS:
        assert got is None
        return
    assert got is not None
    _close(got, x, W, bias, 256 * scales.repeat_interleave(group, dim=1))
    assert torch.equal(cpu_gemv.int8_rows(codes, scales, zeros, group, 5, N), W[5:])


@pytest.mark.parametrize("M", [1, 2, 4, 9, 17])
@pytest.mark.parametrize("N, K, block", [(24, 64, None), (40, 96, (16, 32)), (33, 72, (16, 16)), (36, 80, (3, 48)),
                                         (20, 48, (8, 16))])
def test_fp8_gemv_equals_dequantize_then_matmul(M, N, K, block, wide):
    weight, scale, W = random_fp8(N, K, block, GEN)  # W: torch's e4m3 decoding, the reference
    x = torch.randn(M, K, generator=GEN)
    got = cpu_gemv.fp8_gemv(x, weight, scale, block, None)
    assert got is not None
    _close(got, x, W, None)
    assert torch.equal(cpu_gemv.fp8_rows(weight, scale, block, 2, N), W[2:])


def test_a_gemv_takes_any_leading_dims_and_strided_rows():
    """x [.., K] of any leading dims, or rows that are a strided view, give x's rows' products
    bit for bit, shaped [.., N] (the wrappers reshape and copy only what needs it)."""
    qweight, scales, zeros = random_int4(16, 128, 64, GEN)
    x = torch.randn(6, 128, generator=GEN)
    flat = cpu_gemv.int4_gemv(x, qweight, scales, zeros, 64, None)
    batched = cpu_gemv.int4_gemv(x.view(2, 3, 128), qweight, scales, zeros, 64, None)
    strided = cpu_gemv.int4_gemv(torch.cat([x, x], dim=1)[:, :128], qweight, scales, zeros, 64, None)
    assert flat is not None and batched is not None and strided is not None
    assert batched.shape == (2, 3, 16) and torch.equal(batched.view(6, 16), flat) and torch.equal(strided, flat)


def test_more_rows_than_a_gemv_takes_are_left_to_the_tiles():
    qweight, scales, zeros = random_int4(8, 64, 32, GEN)
    x = torch.randn(cpu_gemv.GEMV_MAX_ROWS + 1, 64)
    assert cpu_gemv.int4_gemv(x, qweight, scales, zeros, 32, None) is None


@pytest.mark.skipif(cpu_gemv.load_wide() is None, reason="no AVX-512")
def test_the_avx512_library_takes_groups_of_128_and_rows_by_4_itself():
    """The shapes of real checkpoints are the AVX-512 library's own (it does not pass them on)."""
    library = cpu_gemv.load_wide()
    qweight, scales, zeros = random_int4(16, 256, 128, GEN)
    weight, scale, _ = random_fp8(16, 256, (128, 128), GEN)
    x, y = torch.randn(3, 256, generator=GEN), torch.empty(3, 16)
    assert library.mmserve_int4_gemv512(x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
                                        None, y.data_ptr(), 3, 16, 256, 128, 1) == 0
    assert library.mmserve_fp8_gemv512(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), None, y.data_ptr(),
                                       3, 16, 256, 128, 128, 1) == 0
    assert library.mmserve_int4_gemv512(x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
                                        None, y.data_ptr(), 3, 16, 256, 64, 1) != 0  # groups of 64: the other's


@pytest.mark.parametrize("M", [1, 3, 6])
@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16])
def test_half_gemv_equals_upcast_then_matmul(M, stored):
    """A 16-bit weight (subnormals, infinities' neighbours: every finite code) in float32 arithmetic."""
    codes = torch.randint(0, 2**16, (24, 80), dtype=torch.int32, generator=GEN).to(torch.int16)
    weight = codes.view(stored)
    weight[~weight.float().isfinite()] = 0
    x, bias = torch.randn(M, 80, generator=GEN) * 1e-3, torch.randn(24, generator=GEN)
    got = cpu_gemv.half_gemv(x, weight, bias)
    assert got is not None
    _close(got, x, weight.float(), bias)


def test_prefill_tiles_equal_dequantize_then_matmul():
    """Past `GEMV_MAX_ROWS` rows of x, W's dequantized row tiles through the matmul (oneDNN's, over
    each tile packed for it): tiles of 256 rows and a partial last one."""
    qweight, scales, zeros = random_int4(600, 128, 32, GEN)
    W = dequantize_rows(qweight, scales, zeros, 32)
    x, bias = torch.randn(cpu_gemv.GEMV_MAX_ROWS + 3, 128, generator=GEN), torch.randn(600, generator=GEN)
    got = tiled_linear(x, bias, 600, lambda start, stop: cpu_gemv.int4_rows(qweight, scales, zeros, 32, start, stop))
    _close(got, x, W, bias)
