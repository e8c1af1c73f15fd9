"""The C layer ops (models/cpu_ops.py) against PyTorch's ops (models/layers.py: `LayerOps`): each
bit for bit the float32 torch path's (products rounded, the norm's sum ordered as PyTorch's) at
usual and odd widths and 1 to 64 rows, the inputs left as they were; inputs that are not the
kernels' fall back to the torch path."""

from __future__ import annotations

import pytest
import torch

from mmserve.models import cpu_ops
from mmserve import native
from mmserve.models.layers import LayerOps, RotaryEmbedding

REFERENCE = LayerOps()  # PyTorch's ops alone
ROWS = [1, 3, 8, 64]


@pytest.fixture(autouse=True)
def library() -> None:
    if native.build(cpu_ops.SOURCE) is None:
        pytest.skip("no C compiler: the C layer ops are not built")


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_equal(got: tuple[torch.Tensor, ...] | torch.Tensor | None,
                 want: tuple[torch.Tensor, ...] | torch.Tensor) -> None:
    assert got is not None  # the C path ran
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape and torch.equal(g, w)


def qkv_views(rows: int, heads: int, kv_heads: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, Dh], k [T, Hkv, Dh]: strided views of one fused projection's output."""
    qkv = rand(rows, (heads + 2 * kv_heads) * head_dim, seed=seed)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)


def test_the_kernels_agree_with_pytorch_here_and_a_wrong_lane_count_does_not():
    """`load`'s check passes with PyTorch's lane count on this machine (8 on x86) and fails with
    any other: it tells sum orders apart."""
    kernels = cpu_ops.load()
    assert kernels is not None
    for lanes in (1, 2, 4, 8, 16):
        assert cpu_ops.agrees(cpu_ops.Kernels(kernels.library, lanes)) == (lanes == kernels.lanes)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 1024, 2048])
def test_add_rms_norm(rows, hidden):
    x, residual, weight = rand(rows, hidden, seed=1), rand(rows, hidden, seed=2), rand(hidden, seed=3)
    before = (x.clone(), residual.clone())
    assert_equal(cpu_ops.add_rms_norm(x, residual, weight, 1e-6), REFERENCE.add_rms_norm(x, residual, weight, 1e-6))
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 1024, 2048])
def test_rms_norm_of_rows(rows, hidden):
    x, weight = rand(rows, hidden, seed=4), rand(hidden, seed=5)
    assert_equal(cpu_ops.rms_norm(x, weight, 1e-5), REFERENCE.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,head_dim", [(8, 64), (4, 128)])
def test_rms_norm_of_each_head_of_a_strided_view(rows, heads, head_dim):
    q, _ = qkv_views(rows, heads, heads, head_dim, seed=6)
    weight = rand(head_dim, seed=7)
    assert_equal(cpu_ops.rms_norm(q, weight, 1e-6), REFERENCE.rms_norm(q, weight, 1e-6))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 128), (16, 2, 64), (4, 4, 80), (3, 1, 7)])
def test_qk_norm_of_q_and_k_views_of_one_projection(rows, heads, kv_heads, head_dim):
    """Qwen3's per-head norms: equal to the torch path's (q and k normalised together) and so to
    two separate RMSNorms; odd head sizes too (below a vector, with a tail)."""
    q, k = qkv_views(rows, heads, kv_heads, head_dim, seed=heads + head_dim)
    q_weight, k_weight = rand(head_dim, seed=8), rand(head_dim, seed=9)
    before = (q.clone(), k.clone())
    got = cpu_ops.qk_norm(q, k, q_weight, k_weight, 1e-6)
    assert_equal(got, REFERENCE.qk_norm(q, k, q_weight, k_weight, 1e-6))
    assert_equal(got, (REFERENCE.rms_norm(q, q_weight, 1e-6), REFERENCE.rms_norm(k, k_weight, 1e-6)))
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 64), (4, 4, 128), (8, 1, 128), (3, 1, 6)])
def test_rotary_of_q_and_k_views_of_one_projection(rows, heads, kv_heads, head_dim):
    """Rotate-half rotary, products and sums rounded as PyTorch rounds them: equal to the torch path."""
    q, k = qkv_views(rows, heads, kv_heads, head_dim, seed=heads)
    cos, sin = RotaryEmbedding(head_dim, 1e6)(torch.arange(rows) * 37 + 5, torch.float32)
    before = (q.clone(), k.clone())
    assert_equal(cpu_ops.rotary(q, k, cos, sin), REFERENCE.rotary(q, k, cos, sin))
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inner", [3, 48, 77, 3072, 18944])
def test_silu_mul_of_gate_and_up_views_of_one_projection(rows, inner):
    """Widths below one vector pair, with a tail after 8-float pairs only (48), after both (77),
    none (3072, and Qwen2.5-VL-7B's 18944); values past exp's limits (+-104)."""
    gate_up = rand(rows, 2 * inner, seed=rows + inner) * 40
    gate, up = gate_up[:, :inner], gate_up[:, inner:]
    assert_equal(cpu_ops.silu_mul(gate, up), REFERENCE.silu_mul(gate, up))


def test_silu_agrees_with_pytorch_here_with_its_vector_width_only():
    """`load`'s SiLU check passes with PyTorch's activation vector width here and fails with the
    others: it tells where the vector loop ends (Sleef's exp) from where the tail begins (expf)."""
    kernels = cpu_ops.load()
    assert kernels is not None and kernels.silu_lanes is not None
    for lanes in (4, 8, 16):
        assert cpu_ops.silu_agrees(cpu_ops.Kernels(kernels.library, 1, lanes)) == (lanes == kernels.silu_lanes)


def test_silu_of_special_values():
    """NaN, infinities, zeros of both signs, and around exp's limits, as PyTorch gives them."""
    values = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 88.7, -88.7, 103.9, -103.9, 104.1, -104.1,
              1e30, -1e30, 1e-40, -1e-40]
    gate = torch.tensor(values * 4)[None]  # 60 values: a vector loop and a tail
    up = torch.ones_like(gate)
    got, want = cpu_ops.silu_mul(gate, up), REFERENCE.silu_mul(gate, up)
    assert got is not None and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("width", [1, 5, 8, 20, 100, 333, 1030, 4099, 9000, 16383])
def test_norms_sum_in_pytorchs_order_at_odd_widths(width):
    """Widths below a vector, with a tail, with leftover items, one and two cascade levels, the widest."""
    x, residual, weight = rand(2, width, seed=width) * 3, rand(2, width, seed=width + 1), rand(width, seed=15)
    assert_equal(cpu_ops.rms_norm(x, weight, 1e-6), REFERENCE.rms_norm(x, weight, 1e-6))
    assert_equal(cpu_ops.add_rms_norm(x, residual, weight, 1e-6), REFERENCE.add_rms_norm(x, residual, weight, 1e-6))


def test_rotary_with_halves_that_differ():
    """cos / sin whose two halves differ (as no rope of ours makes, but `rotary` allows): each
    half of the output reads its own half of cos and sin."""
    q, k = rand(3, 4, 64, seed=8), rand(3, 2, 64, seed=9)
    cos, sin = rand(3, 1, 64, seed=10), rand(3, 1, 64, seed=11)
    assert_equal(cpu_ops.rotary(q, k, cos, sin), REFERENCE.rotary(q, k, cos, sin))


def test_inputs_that_are_not_the_kernels_are_refused():
    rows = cpu_ops.MAX_ROWS + 1
    x, residual, weight = rand(rows, 64, seed=12), rand(rows, 64, seed=13), rand(64, seed=14)
    assert cpu_ops.add_rms_norm(x, residual, weight, 1e-6) is None  # a prefill's rows
    assert cpu_ops.add_rms_norm(*(t.bfloat16() for t in (x[:2], residual[:2], weight)), 1e-6) is None
    assert cpu_ops.rms_norm(x[:2, ::2], weight[::2], 1e-6) is None  # last dimension strided
    wide = rand(1, cpu_ops.MAX_NORM_WIDTH, seed=16)
    assert cpu_ops.rms_norm(wide, wide[0], 1e-6) is None
    q, k = rand(2, 4, 64, seed=17), rand(2, 2, 64, seed=18)
    meta = [t.to("meta") for t in (q, k, weight, weight)]  # not CPU memory (as CUDA tensors are not)
    assert cpu_ops.qk_norm(*meta, 1e-6) is None
    assert cpu_ops.qk_norm(q, k, weight, weight[:32], 1e-6) is None  # a weight of another width
    assert cpu_ops.qk_norm(q.double(), k.double(), weight.double(), weight.double(), 1e-6) is None
    cos, sin = RotaryEmbedding(64, 1e4)(torch.arange(2), torch.float32)
    assert cpu_ops.rotary(q.to("meta"), k.to("meta"), cos.to("meta"), sin.to("meta")) is None
    assert cpu_ops.rotary(q[..., :63], k[..., :63], cos[..., :63], sin[..., :63]) is None  # odd head size
    gate_up = rand(rows, 64, seed=19)
    assert cpu_ops.silu_mul(gate_up[:, :32], gate_up[:, 32:]) is None  # a prefill's rows
    assert cpu_ops.silu_mul(gate_up[:2, :32:2], gate_up[:2, 32::2]) is None  # last dimension strided


def test_torch_ops_equal_pytorchs_with_the_kernels_and_without():
    """The torch backend's set (`CPU_OPS`) equals `LayerOps` on decode rows (the C path) and on
    what it refuses (a prefill's rows, bfloat16: PyTorch's path)."""
    for rows, dtype in ((2, torch.float32), (cpu_ops.MAX_ROWS + 1, torch.float32), (2, torch.bfloat16)):
        x, residual, weight = (rand(rows, 256, seed=s).to(dtype) for s in (20, 21, 22))
        q, k = (t.to(dtype) for t in qkv_views(rows, 4, 2, 64, seed=23))
        q_weight, k_weight = rand(64, seed=24).to(dtype), rand(64, seed=25).to(dtype)
        cos, sin = RotaryEmbedding(64, 1e4)(torch.arange(rows), dtype)
        for op, args in (("rms_norm", (x, weight, 1e-6)), ("add_rms_norm", (x, residual, weight, 1e-6)),
                         ("qk_norm", (q, k, q_weight, k_weight, 1e-6)), ("rotary", (q, k, cos, sin)),
                         ("silu_mul", (x[:, :128], x[:, 128:]))):
            got, want = getattr(cpu_ops.CPU_OPS, op)(*args), getattr(REFERENCE, op)(*args)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                assert g.dtype == w.dtype and torch.equal(g, w), (op, rows, dtype)
