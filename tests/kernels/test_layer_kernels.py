"""Our fused small-op kernels (residual add + RMSNorm or LayerNorm, SiLU x up, quick GELU, rotary of q and k
with the KV write, Qwen3's head norms fused in, and into new tensors, in float32 for the towers)
against the torch path they replace, `LayerOps` (interpreted on CPU): float32 to rounding of a
sum's order, half precision to the dtype's rounding, strided views of a fused projection's output,
widths that are not powers of two, and M-RoPE's cos / sin."""

from __future__ import annotations

import pytest
import torch

from helpers.triton_device import DEVICE
from mmserve.models.layers import TORCH_OPS, RotaryEmbedding
from mmserve.models.mrope import MRotaryEmbedding

pytest.importorskip("triton")

from mmserve.models.attention.cache_write_kernel import rotary_write_kv_cache  # noqa: E402
from mmserve.models.attention.layer_kernels import TRITON_OPS  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}


def rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [96, 200])
def test_add_rms_norm_updates_the_residual_in_place(dtype, width):
    x, residual, weight = rand(5, width, dtype=dtype, seed=1), rand(5, width, dtype=dtype, seed=2), \
        rand(width, dtype=dtype, seed=3)
    want_out, want_res = TORCH_OPS.add_rms_norm(x, residual, weight, 1e-6)
    got_x, got_res = x.to(DEVICE), residual.to(DEVICE)
    out, res = TRITON_OPS.add_rms_norm(got_x, got_res, weight.to(DEVICE), 1e-6)
    assert res.data_ptr() == got_res.data_ptr() and out.data_ptr() == got_x.data_ptr()
    torch.testing.assert_close(res.cpu(), want_res, atol=0, rtol=0)  # one rounded add: exact
    torch.testing.assert_close(out.cpu(), want_out, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [96, 200])
def test_layer_norm_alone_and_with_the_residual_add(dtype, width):
    """Qwen3-VL's tower norm (`layer_norm`, `add_layer_norm`: the add fused, in place) against
    PyTorch's `layer_norm`; rows offset from 0, so the centring matters."""
    x, residual = rand(5, width, dtype=dtype, seed=1) + 3, rand(5, width, dtype=dtype, seed=2)
    weight, bias = rand(width, dtype=dtype, seed=3), rand(width, dtype=dtype, seed=4)
    want_alone = TORCH_OPS.layer_norm(x, weight, bias, 1e-6)
    want_out, want_res = TORCH_OPS.add_layer_norm(x, residual, weight, bias, 1e-6)
    got_x, got_res, w, b = (t.to(DEVICE) for t in (x, residual, weight, bias))
    alone = TRITON_OPS.layer_norm(got_x, w, b, 1e-6)
    out, res = TRITON_OPS.add_layer_norm(got_x, got_res, w, b, 1e-6)
    assert res.data_ptr() == got_res.data_ptr() and out.data_ptr() == got_x.data_ptr()
    torch.testing.assert_close(res.cpu(), want_res, atol=0, rtol=0)  # one rounded add: exact
    torch.testing.assert_close(alone.cpu(), want_alone, **tol(dtype))
    torch.testing.assert_close(out.cpu(), want_out, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_each_head_of_a_strided_view(dtype):
    """Qwen3's q / k norms: [T, H, Dh] rows of a fused QKV output, normalised per head; the input
    is left as it was (the first layer's input is also the residual stream)."""
    qkv = rand(4, 3 * 2 * 64, dtype=dtype, seed=4)
    q = qkv[:, :128].view(4, 2, 64)
    weight = rand(64, dtype=dtype, seed=5)
    want = TORCH_OPS.rms_norm(q, weight, 1e-6)
    before = qkv.clone()
    got = TRITON_OPS.rms_norm(q.to(DEVICE), weight.to(DEVICE), 1e-6)
    torch.testing.assert_close(got.cpu(), want, **tol(dtype))
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_of_one_fused_tensor_and_of_two(dtype):
    """gate / up as the halves of one [T, 2I] output (strided, no copy) and as two tensors."""
    gate_up = rand(6, 2 * 300, dtype=dtype, seed=6)
    gate, up = gate_up.split(300, dim=-1)
    want = TORCH_OPS.silu_mul(gate, up)
    halves = gate_up.to(DEVICE).split(300, dim=-1)
    torch.testing.assert_close(TRITON_OPS.silu_mul(*halves).cpu(), want, **tol(dtype))
    two = TRITON_OPS.silu_mul(gate.contiguous().to(DEVICE), up.contiguous().to(DEVICE))
    torch.testing.assert_close(two.cpu(), want, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_quick_gelu_of_an_images_rows(dtype):
    """CLIP's MLP activation on fc1's output [N, L, I] (I not a power of two): one launch, each of
    PyTorch's three steps rounded where it rounds; other activations are PyTorch's own."""
    x = rand(2, 5, 1500, dtype=dtype, seed=8) * 4
    want = TORCH_OPS.activation("quick_gelu", x)
    got = TRITON_OPS.activation("quick_gelu", x.to(DEVICE))
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want, **tol(dtype))
    torch.testing.assert_close(TRITON_OPS.activation("gelu", x.to(DEVICE)).cpu(), TORCH_OPS.activation("gelu", x))


def rope_of(kind: str, head_dim: int, positions: torch.Tensor, dtype: torch.dtype):
    if kind == "mrope":  # Qwen2.5-VL's sections, scaled to the head
        section = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]
        return MRotaryEmbedding(head_dim, 10000.0, section, interleaved=False)(positions, dtype)
    return RotaryEmbedding(head_dim, 10000.0)(positions[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,heads,kv_heads,head_dim", [
    ("rope", 4, 4, 64), ("mrope", 7, 1, 128), ("mrope", 6, 2, 80)])
def test_rotary_of_q_and_k_with_the_cache_write(dtype, kind, heads, kv_heads, head_dim):
    """q, k, v as views of one fused QKV output: one launch rotates q (into a new tensor) and k
    (into the cache at its slot) and stores v; a padded token (slot -1) writes nothing; the
    inputs are left as they were."""
    T, block = 5, 4
    positions = torch.stack([torch.arange(T) * 3, torch.arange(T) % 2, torch.arange(T) + 7])  # [3, T]
    cos, sin = rope_of(kind, head_dim, positions, dtype)
    qkv = rand(T, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=heads)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(T, heads, head_dim), k.view(T, kv_heads, head_dim), v.view(T, kv_heads, head_dim)
    slots = torch.tensor([9, 2, -1, 15, 4])
    k_cache, v_cache = rand(4, block, kv_heads, head_dim, dtype=dtype, seed=7), rand(4, block, kv_heads, head_dim,
                                                                                      dtype=dtype, seed=8)
    want_q, want_k = TORCH_OPS.rotary(q, k, cos, sin)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    want_k_cache.view(-1, kv_heads, head_dim)[slots[real]] = want_k[real]
    want_v_cache.view(-1, kv_heads, head_dim)[slots[real]] = v[real]
    fused = qkv.to(DEVICE)
    got = [t.view(T, -1, head_dim) for t in fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim],
                                                         dim=-1)]
    got_k_cache, got_v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    got_q = rotary_write_kv_cache(*got, cos.to(DEVICE), sin.to(DEVICE), got_k_cache, got_v_cache, slots.to(DEVICE))
    # each product rounded as torch's: exact for float16, and float32 interpreted; within rounding for
    # float32 on a GPU (a compiler may fuse a product into the add) and for bfloat16 (GPU only)
    exact = {"atol": 0, "rtol": 0} if dtype == torch.float16 or DEVICE.type == "cpu" else tol(dtype)
    torch.testing.assert_close(got_q.cpu(), want_q, **exact)
    torch.testing.assert_close(got_k_cache.cpu(), want_k_cache, **exact)
    assert torch.equal(got_v_cache.cpu(), want_v_cache) and torch.equal(fused.cpu(), qkv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("heads,head_dim", [(4, 64), (3, 80), (2, 72)])
def test_rotary_of_q_and_k_into_new_tensors(dtype, wide, heads, head_dim):
    """`rotary` (each product rounded to the dtype, as the torch path) and `rotary_float32` (the
    vision towers': float32 throughout, one rounding at the end) of q and k as views of one fused
    QKV output [P, 3, H, Dh] (the towers' layout), into new contiguous tensors; inputs unchanged."""
    P = 6
    qkv = rand(P, 3 * heads * head_dim, dtype=dtype, seed=head_dim)
    q, k, _ = qkv.view(P, 3, heads, head_dim).unbind(1)
    angles = rand(P, head_dim // 2, dtype=torch.float32, seed=1) * 3
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]  # [P, 1, Dh] as VisionRotary makes them
    cos, sin = (emb.cos(), emb.sin()) if wide else (emb.cos().to(dtype), emb.sin().to(dtype))
    want = (TORCH_OPS.rotary_float32 if wide else TORCH_OPS.rotary)(q, k, cos, sin)
    fused = qkv.to(DEVICE)
    got_q, got_k, _ = fused.view(P, 3, heads, head_dim).unbind(1)
    ops = TRITON_OPS.rotary_float32 if wide else TRITON_OPS.rotary
    got = ops(got_q, got_k, cos.to(DEVICE), sin.to(DEVICE))
    exact = {"atol": 0, "rtol": 0} if DEVICE.type == "cpu" else tol(dtype)  # a GPU may fuse a product into the add
    for g, w in zip(got, want):
        assert g.is_contiguous() and g.dtype == dtype
        torch.testing.assert_close(g.cpu(), w, **exact)
    assert torch.equal(fused.cpu(), qkv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen3s_head_norms_fused_into_the_rotary_and_cache_write(dtype):
    """`qk_norm` given: each q and k head RMS-normalised by its weight, then rotated and written, in
    the one launch; equal to `LayerOps.qk_norm` then `rotary` up to the norm's sum order."""
    T, heads, kv_heads, head_dim, block = 4, 4, 2, 64, 4
    positions = torch.stack([torch.arange(T) + 5] * 3)
    cos, sin = rope_of("mrope", head_dim, positions, dtype)
    qkv = rand(T, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=3) * 3
    q, k, v = (t.view(T, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                             kv_heads * head_dim], dim=-1))
    q_w, k_w = rand(head_dim, dtype=dtype, seed=4), rand(head_dim, dtype=dtype, seed=5)
    want_q, want_k = TORCH_OPS.rotary(*TORCH_OPS.qk_norm(q, k, q_w, k_w, 1e-6), cos, sin)
    slots = torch.tensor([3, 0, 9, 14])
    k_cache, v_cache = (torch.zeros(4, block, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    got_k, got_v = k_cache.to(DEVICE), v_cache.to(DEVICE)
    views = [t.to(DEVICE) for t in (q, k, v)]
    got_q = rotary_write_kv_cache(*views, cos.to(DEVICE), sin.to(DEVICE), got_k, got_v, slots.to(DEVICE),
                                  (q_w.to(DEVICE), k_w.to(DEVICE), 1e-6))
    close = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else tol(dtype)
    torch.testing.assert_close(got_q.cpu(), want_q, **close)
    torch.testing.assert_close(got_k.cpu().view(-1, kv_heads, head_dim)[slots], want_k, **close)
    assert torch.equal(got_v.cpu().view(-1, kv_heads, head_dim)[slots], v)
