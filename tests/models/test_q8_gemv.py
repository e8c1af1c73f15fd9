"""The int8-activation GEMV of int4 weights (`--cpu-activation-quant int8`, csrc/int4_q8_gemv.c):
its integers equal a PyTorch reference of the same quantization on every path (AVX-512 VNNI, AVX2,
plain C), its output lies within the bound the rounding of x allows of the exact float32 GEMV, and
the int4 method takes it only when asked, for decode rows."""

from __future__ import annotations

import pytest
import torch

from helpers.resident_weights import random_int4
from mmserve.models.quantization import cpu_gemv, q8_gemv
from mmserve.models.quantization.int4 import Int4Method, dequantize_rows, unpack_nibbles

pytestmark = pytest.mark.skipif(q8_gemv.load() is None, reason="no C compiler for the CPU kernels")

GEN = torch.Generator().manual_seed(0)
LEVELS = [0, 1, 2]
SHAPES = [(16, 128, 128), (48, 384, 128), (32, 512, 256), (16, 256, 256), (64, 1024, 128)]


@pytest.fixture(params=LEVELS, ids=["plain", "avx2", "avx512vnni"])
def level(request, monkeypatch):
    """Each test by one path of the kernel (those this machine's build lacks are skipped)."""
    if request.param > (q8_gemv.built_level() or 0):
        pytest.skip("this build lacks the path")
    monkeypatch.setattr(q8_gemv, "LEVEL", request.param)
    return request.param


def quantize_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes int64 [M, K], scales float32 [M, K / group]) as the kernel's docstring
    states: xs = max|x| * float32(1 / 127), code = round-half-even(x * float32(127 / max|x|))."""
    blocks = x.reshape(x.shape[0], -1, group)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    codes = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int64)
    xs = amax * (torch.tensor(1.0) / torch.tensor(127.0))
    return codes.reshape(x.shape), xs


def reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
              bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in float64, the bound of float32 rounding on it) from the integers: per group,
    dot = sum code_w * code_x in int64, y = sum scale * xs * (dot - zero * sum code_x)."""
    codes, xs = quantize_reference(x, group)
    M, K = x.shape
    w = unpack_nibbles(qweight).to(torch.int64).reshape(qweight.shape[0], K // group, group)
    xq = codes.reshape(M, K // group, group)
    dot = torch.einsum("ngk,mgk->mng", w, xq)  # [M, N, G], exact
    corr = zeros.to(torch.int64)[None] * xq.sum(-1)[:, None, :]
    f = scales.double()[None] * xs.double()[:, None, :]
    y = (f * (dot - corr).double()).sum(-1) + (0 if bias is None else bias.double())
    size = (f.abs() * (dot.abs() + corr.abs()).double()).sum(-1)
    return y, size * (K // group + 4) * 2**-23 + 1e-6


def _gemv(x, qweight, scales, zeros, group, bias=None) -> torch.Tensor:
    """The kernel's product for an int4 weight in the resident form (interleaved for it here)."""
    got = q8_gemv.int4_q8_gemv(x, *q8_gemv.interleave(qweight, scales, zeros), group, bias)
    assert got is not None
    return got


@pytest.mark.parametrize("M", [1, 2, 5, 8, 13])
@pytest.mark.parametrize("N, K, group", SHAPES)
def test_integers_equal_a_torch_reference_of_the_same_quantization(M, N, K, group, level):
    """Within float32 rounding of the reference's exact integers: one activation code off by one
    moves y by a weight's scale times xs times up to 15, hundreds of times the bound here."""
    qweight, scales, zeros = random_int4(N, K, group, GEN)
    x, bias = torch.randn(M, K, generator=GEN), torch.randn(N, generator=GEN)
    x[0, :group] = 0  # a block of zeros: scale 0, codes 0
    want, bound = reference(x, qweight, scales, zeros, group, bias)
    assert ((_gemv(x, qweight, scales, zeros, group, bias).double() - want).abs() <= bound).all()


@pytest.mark.parametrize("M", [1, 8])
def test_a_code_off_by_one_is_seen(M, level):
    """The comparison above can fail: the reference fed x with one block's largest entry nudged
    (its code changes, its scale not) differs from the kernel beyond the bound."""
    qweight, scales, zeros = random_int4(16, 256, 128, GEN)
    x = torch.randn(M, 256, generator=GEN)
    got = _gemv(x, qweight, scales, zeros, 128)
    col = int(x[0, :128].abs().argmin())
    inv = 127 / x[0, :128].abs().max()
    nudged = x.clone()
    nudged[0, col] += 1.0 / inv  # one code step
    want, bound = reference(nudged, qweight, scales, zeros, 128, None)
    assert ((got.double() - want).abs() > bound).any()


@pytest.mark.parametrize("M", [1, 3, 8, 11])
@pytest.mark.parametrize("N, K, group", SHAPES)
def test_close_to_the_exact_gemv_within_the_rounding_of_x(M, N, K, group, level):
    """|x - xs * code| <= xs / 2 = max|x of its block| / 254 for every entry, so
    |y_q8 - x W^T| <= sum over groups of max|x| / 254 * sum |W| (plus float32 rounding). On the
    whole the error is x's rounding noise, xs / sqrt(12) per entry: for Gaussian blocks of 128-256
    (max ~2.7-2.9 sigma) ~0.7% of x's spread, and so of |y| in the 2-norm (0.78-0.88% measured on
    512 x 8 outputs); under 3% here, where few outputs make the ratio noisy."""
    qweight, scales, zeros = random_int4(N, K, group, GEN)
    x = torch.randn(M, K, generator=GEN)
    W = dequantize_rows(qweight, scales, zeros, group).double()
    exact = x.double() @ W.t()
    amax = x.abs().reshape(M, -1, group).amax(-1).double()  # [M, G]
    w_abs = W.abs().reshape(N, -1, group).sum(-1)  # [N, G]
    bound = amax @ w_abs.t() / 254 + (x.abs().double() @ W.abs().t()) * K * 2**-22 + 1e-6
    got = _gemv(x, qweight, scales, zeros, group).double()
    assert ((got - exact).abs() <= bound).all()
    assert (got - exact).norm() <= 0.03 * exact.norm()


@pytest.mark.parametrize("M", [1, 4, 9])
def test_every_path_gives_the_same_result(M):
    """AVX2 and plain C against the widest path built: the same integers, sums in another order."""
    qweight, scales, zeros = random_int4(48, 768, 128, GEN)
    x = torch.randn(M, 768, generator=GEN)
    results = []
    for path in range((q8_gemv.built_level() or 0) + 1):
        q8_gemv.LEVEL = path
        try:
            results.append(_gemv(x, qweight, scales, zeros, 128))
        finally:
            q8_gemv.LEVEL = 2
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=1e-5, atol=1e-5)


def test_weights_it_does_not_take_and_prefill_rows_are_refused():
    """The layouts need groups of a multiple of 128 columns and rows of W by 16; past
    `GEMV_MAX_ROWS` rows of x the exact tiles run (None: the caller keeps its path)."""
    assert not q8_gemv.can_interleave(random_int4(16, 256, 64, GEN)[0], 64)
    assert not q8_gemv.can_interleave(random_int4(24, 256, 128, GEN)[0], 128)
    qweight, scales, zeros = q8_gemv.interleave(*random_int4(16, 256, 128, GEN))
    x = torch.randn(cpu_gemv.GEMV_MAX_ROWS + 1, 256)
    assert q8_gemv.int4_q8_gemv(x, qweight, scales, zeros, 128, None) is None


def test_deinterleave_gives_the_resident_rows_back():
    tensors = random_int4(48, 256, 128, GEN)
    interleaved = q8_gemv.interleave(*tensors)
    for got, want in zip(q8_gemv.deinterleave(*interleaved, 16, 48), tensors):
        assert torch.equal(got, want[16:48])


class _Layer:
    """A layer's resident int4 tensors, as Int4Method reads them."""

    def __init__(self, N: int, K: int, group: int) -> None:
        self.qweight, self.scales, self.zeros = random_int4(N, K, group, GEN)
        self.int4_group = group
        self.weight_names = ["qweight", "scales", "zeros"]


@pytest.mark.parametrize("rows", [1, 8])
def test_the_method_takes_the_int8_kernel_only_when_asked(rows):
    """Off (the default), decode rows are the exact GEMV's to the bit and packing leaves the weight
    as it is; on, packing interleaves it and decode rows are the int8 kernel's, while prefill rows
    are the exact tiles' to the bit either way, as is the dequantized W."""
    off, on = Int4Method("awq", 128, False), Int4Method("awq", 128, False, "int8")
    plain, packed, bias = _Layer(32, 256, 128), _Layer(32, 256, 128), torch.randn(32, generator=GEN)
    for name in packed.weight_names:
        setattr(packed, name, getattr(plain, name))
    x = torch.randn(2, rows, 256, generator=GEN)
    args = (x, plain.qweight, plain.scales, plain.zeros, 128, bias)
    assert not off.pack(plain) and on.pack(packed)
    assert torch.equal(off.apply(plain, x, bias), cpu_gemv.int4_gemv(*args))
    assert torch.equal(on.apply(packed, x, bias), _gemv(*args))
    assert not torch.equal(on.apply(packed, x, bias), off.apply(plain, x, bias))
    prefill = torch.randn(cpu_gemv.GEMV_MAX_ROWS + 2, 256, generator=GEN)
    assert torch.equal(on.apply(packed, prefill, bias), off.apply(plain, prefill, bias))
    assert torch.equal(on.dequantize(packed), dequantize_rows(plain.qweight, plain.scales, plain.zeros, 128))
