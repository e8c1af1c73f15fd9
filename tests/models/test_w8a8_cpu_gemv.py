"""W8A8's C GEMV on the CPU (models/quantization/w8a8_cpu.py, csrc/w8a8_gemv.c) against w8a8.py's
torch path bit for bit: x quantized per row (dynamic) or by a static scale, the int8 products,
their scaling and a bias, by every path the machine has (AVX-512 VNNI, AVX2, plain C), over
column counts that leave a remainder to each path's width."""

from __future__ import annotations

import pytest
import torch

from mmserve import native
from mmserve.models.quantization import w8a8_cpu
from mmserve.models.quantization.w8a8 import int8_product, quantize_rows

pytestmark = pytest.mark.skipif(w8a8_cpu.load() is None, reason="no C compiler for the CPU kernels")

GEN = torch.Generator().manual_seed(0)
LEVELS = [0, 1, 2]  # plain C, AVX2, AVX-512 VNNI (each falls back to the widest below it that is built)


def _case(M: int, N: int, K: int, static: bool, with_bias: bool) -> tuple[torch.Tensor, ...]:
    x = torch.randn(M, K, generator=GEN) * torch.logspace(-2, 1, M)[:, None]
    x[0, : min(K, 6)] = torch.tensor([0.625, 0.375, -0.125, 40.0, -40.0, 0.0])[: min(K, 6)]  # ties, clamps
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=GEN)
    scale = torch.rand(N, generator=GEN) * 0.01
    fixed = torch.tensor([0.25]) if static else None
    bias = torch.randn(N, generator=GEN) if with_bias else None
    return x, w, scale, fixed, bias


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("N, K", [(16, 64), (40, 200), (24, 3584), (8, 70)])
@pytest.mark.parametrize("static", [False, True])
def test_the_gemv_is_the_torch_path_bit_for_bit(monkeypatch, level, M, N, K, static):
    monkeypatch.setattr(w8a8_cpu, "LEVEL", level)
    x, w, scale, fixed, bias = _case(M, N, K, static, with_bias=M == 3)
    tensors = w8a8_cpu.gemv_tensors(w, scale, fixed)
    got = w8a8_cpu.w8a8_gemv(x, w, tensors["gemv_scales"], tensors["wsum"], static, bias)
    q, s = quantize_rows(x, fixed)
    assert got is not None and torch.equal(got, int8_product(q, s, w, scale, bias, torch.float32))


def test_it_takes_a_decode_steps_rows_and_leaves_more_to_torch():
    x, w, scale, _, _ = _case(w8a8_cpu.MAX_ROWS + 1, 16, 64, False, False)
    tensors = w8a8_cpu.gemv_tensors(w, scale, None)
    assert w8a8_cpu.w8a8_gemv(x, w, tensors["gemv_scales"], tensors["wsum"], False, None) is None
    three = w8a8_cpu.w8a8_gemv(x[:6].reshape(2, 3, 64), w, tensors["gemv_scales"], tensors["wsum"], False, None)
    assert three is not None and three.shape == (2, 3, 16)
    assert tensors["wsum"].tolist() == w.int().sum(dim=1).tolist()
    assert w8a8_cpu.gemv_tensors(w.to("meta"), scale.to("meta"), None) == {}  # not a CPU layer's


def test_its_file_is_compiled_with_ieee_arithmetic():
    """-ffast-math would let the compiler turn x / s into x * (1 / s) and reassociate the scaling."""
    flags = native.compile_flags(w8a8_cpu.SOURCE.read_text())
    assert flags[-1] == "-fno-fast-math" and "-ffast-math" in native.COMPILE_FLAGS
    assert native.compile_flags("int main(void) { return 0; }") == native.COMPILE_FLAGS
