"""W8A8 (models/quantization/w8a8.py): activations quantized per token as vLLM's dynamic
`scaled_int8_quant` does (torch's and our one-launch Triton kernel's, bit for bit), and our
Triton int8 GEMM (triton_int8_mm.py) against exact integer
products scaled in float64: the decode tile of 16 rows with K split over programs, the 64-row
prefill tile, rows and columns past a tile's edge, a bias, float32 and bfloat16 outputs;
interpreted on the CPU where there is no GPU (the interpreter's int8 dot sums in int32, as the
tensor cores do)."""

from __future__ import annotations

import pytest
import torch

from helpers.triton_device import DEVICE
from mmserve.models.quantization.w8a8 import int8_product, quantize_rows

pytest.importorskip("triton")

from mmserve.models.quantization import triton_int8_mm  # noqa: E402

GEN = torch.Generator().manual_seed(0)


def _exact(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """The integer products exactly (int64), scaled in float64."""
    y = (q.long() @ w.long().t()).double() * s.double() * scale.double()
    return y if bias is None else y + bias.double()


def _random(M: int, N: int, K: int) -> tuple[torch.Tensor, ...]:
    q = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=GEN)
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=GEN)
    s, scale = torch.rand(M, 1, generator=GEN) * 0.05, torch.rand(N, generator=GEN) * 0.01
    return q, w, s, scale


@pytest.mark.parametrize("M", [1, 5, 16, 17, 70])
@pytest.mark.parametrize("N, K", [(24, 96), (40, 256), (8, 1024), (72, 200)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemm_equals_the_exact_integer_products_scaled(M, N, K, with_bias):
    q, w, s, scale = _random(M, N, K)
    bias = torch.randn(N, generator=GEN) if with_bias else None
    got = triton_int8_mm.int8_scaled_mm(q.to(DEVICE), s.to(DEVICE), w.to(DEVICE), scale.to(DEVICE),
                                        None if bias is None else bias.to(DEVICE), torch.float32)
    want = _exact(q, s, w, scale, bias)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-6, atol=1e-6)


def test_a_decode_step_splits_k_over_programs_when_the_output_is_narrow(monkeypatch):
    """8 outputs over K = 4096 at one row: K split, the int32 partial sums added exactly."""
    q, w, s, scale = _random(1, 8, 4096)
    launches = []
    kernel = triton_int8_mm._int8_mm_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_int8_mm, "_int8_mm_kernel", Spy())
    got = triton_int8_mm.int8_scaled_mm(q.to(DEVICE), s.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), None,
                                        torch.float32)
    assert launches and launches[0][2] > 1
    torch.testing.assert_close(got.cpu().double(), _exact(q, s, w, scale, None), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("M", [3, 20])
def test_bfloat16_output_is_the_float32_product_to_a_bfloat16_step(M):
    """Within one bfloat16 step (the interpreter truncates where a GPU rounds to nearest)."""
    q, w, s, scale = _random(M, 40, 128)
    args = (q.to(DEVICE), s.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), None)
    got = triton_int8_mm.int8_scaled_mm(*args, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    exact = triton_int8_mm.int8_scaled_mm(*args, torch.float32).cpu()
    assert ((got.cpu().float() - exact).abs() <= exact.abs() * 2**-7).all()


def test_no_rows_launch_nothing():
    x = torch.empty(0, 64, device=DEVICE)
    q, s = triton_int8_mm.quantize_rows(x)
    assert q.shape == (0, 64) and s.shape == (0, 1)
    w = torch.zeros(8, 64, dtype=torch.int8, device=DEVICE)
    assert triton_int8_mm.int8_scaled_mm(q, s, w, torch.ones(8, device=DEVICE), None, torch.float32).shape == (0, 8)


def test_the_cpu_product_is_the_same_arithmetic():
    """`int8_product` on the CPU (torch's int8 GEMM) equals the exact products as the kernel does."""
    q, w, s, scale = _random(7, 24, 96)
    bias = torch.randn(24, generator=GEN)
    torch.testing.assert_close(int8_product(q, s, w, scale, bias, torch.float32).double(), _exact(q, s, w, scale, bias),
                               rtol=1e-6, atol=1e-6)


def test_rows_are_quantized_at_127_over_their_largest_magnitude_half_to_even():
    x = torch.tensor([[127.0, 2.5, 3.5, -2.5, -0.5, 0.49], [0.0] * 6, [-4.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8 and s.shape == (3, 1)
    assert q[0].tolist() == [127, 2, 4, -2, 0, 0]  # half to even, as nearbyint in vLLM's kernel
    assert q[1].tolist() == [0] * 6 and float(s[1]) == 0.0  # a row of zeros: no NaN
    assert q[2].tolist() == [-127, 32, 0, 0, 0, 0] and float(s[2]) == pytest.approx(4 / 127)


def test_127_over_the_peak_is_one_ieee_division():
    """127 / 0.004974365234375 (= 163 / 32768) is 25530.8957..., which rounds to 25530.896484375;
    torch's `127.0 / tensor` (a reciprocal, then a product) gives 25530.89453125, and with it this
    value's code would be -63 (-63.499996) instead of -64 (-63.500004)."""
    q, _ = quantize_rows(torch.tensor([[0.004974365234375, -0.0024871826171875]]))
    assert q.tolist() == [[127, -64]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [6, 300, 2500])  # within one block of the kernel's columns, and over three
def test_the_one_launch_quantization_is_the_torch_one_bit_for_bit(dtype, K):
    """triton_int8_mm.quantize_rows (the GPU's) against w8a8.quantize_rows (the definition): rows
    of every magnitude, a row of zeros, ties at half a code, from a strided view."""
    x = torch.randn(7, 2 * K, generator=GEN) * torch.logspace(-4, 3, 7)[:, None]
    x[2] = 0
    x[3, :6] = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.49])
    x[3, 6:] = 0
    x = x.to(dtype)[:, :K]  # rows K apart in a 2K-wide tensor
    q, s = triton_int8_mm.quantize_rows(x.to(DEVICE))
    want_q, want_s = quantize_rows(x)
    assert torch.equal(q.cpu(), want_q) and torch.equal(s.cpu(), want_s)
    assert q[3, :6].tolist() == [127, 2, 4, -2, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_rows_stand_for_x_within_half_a_quantum(dtype):
    x = (torch.randn(9, 300, generator=GEN) * torch.logspace(-3, 2, 9)[:, None]).to(dtype)
    q, s = quantize_rows(x)
    assert q.abs().amax(dim=1).tolist() == [127] * 9  # each row's largest magnitude at 127
    assert ((q.float() * s - x.float()).abs() <= s * (0.5 + 1e-5)).all()  # bfloat16 values can sit on a tie


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [6, 2500])
def test_static_quantization_is_x_over_the_scale_half_to_even_in_one_launch(dtype, K):
    """A static `input_scale` (vLLM's `static_scaled_int8_quant`): q = x / s (IEEE) rounded half
    to even and clamped, every row's scale s; the Triton kernel's bit for bit the torch one's."""
    scale = torch.tensor([0.25])
    x = (torch.randn(5, 2 * K, generator=GEN) * torch.logspace(-2, 2, 5)[:, None])
    x[0, :6] = torch.tensor([0.625, 0.375, -0.125, 40.0, -40.0, 0.0])  # ties at 2.5, 1.5, -0.5; clamped
    x = x.to(dtype)[:, :K]
    q, s = quantize_rows(x, scale)
    assert q[0, :6].tolist() == [2, 2, 0, 127, -128, 0][:K] and s.tolist() == [[0.25]] * 5
    assert torch.equal(q, torch.round(x.float() / 0.25).clamp(-128, 127).to(torch.int8))
    got_q, got_s = triton_int8_mm.quantize_rows(x.to(DEVICE), scale.to(DEVICE))
    assert torch.equal(got_q.cpu(), q) and torch.equal(got_s.cpu(), s.contiguous())
