"""The torch path's small ops between a layer's GEMMs (`LayerOps`: RMSNorm, residual add +
RMSNorm, Qwen3's q / k norms, rotary of q and k) against transformers' own functions, bit for
bit: ours compute the same products and sums in fewer calls (no casts of float32, updates in
place, q's and k's heads normalised together, one roll and a signed sin for rotate-half), on the
shapes a decode step and a prefill chunk give them (hidden rows, per-head q / k, strided views
of a fused projection's output) in every dtype."""

from __future__ import annotations

import pytest
import torch

from mmserve.models.layers import TORCH_OPS, apply_rotary, rms_norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1024), (8, 1024), (5, 200), (1, 8, 128), (8, 4, 128), (7, 3, 96)]


def rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3-VL RMSNorm (the decoder's and q / k's) with `weight`."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm

    norm = Qwen3VLTextRMSNorm(x.shape[-1], eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_equals_transformers(shape, dtype):
    for seed, scale in enumerate([1.0, 1e-3, 300.0]):
        x = rand(*shape, seed=seed, scale=scale).to(dtype)
        weight = rand(shape[-1], seed=seed + 10).to(dtype)
        want = hf_norm(x, weight, 1e-6)
        assert torch.equal(rms_norm(x, weight, 1e-6), want)
        assert torch.equal(TORCH_OPS.rms_norm(x, weight, 1e-6), want)
        wide = torch.cat([x, x], dim=-1)[..., :shape[-1]]  # q / k: a strided view of the fused output
        assert torch.equal(rms_norm(wide, weight, 1e-6), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, H, Hkv, Dh", [(1, 8, 4, 128), (8, 8, 4, 128), (5, 4, 2, 64), (3, 2, 1, 80)])
def test_qk_norm_equals_transformers_norm_of_each(T, H, Hkv, Dh, dtype):
    """Qwen3's q / k norms: each head of q and of k as transformers normalises it with its own
    weight, whether the heads are normalised together (float32) or apart; rows that the decode
    kernel reads whole come out contiguous."""
    for seed, scale in enumerate([1.0, 1e-3, 300.0]):
        qkv = rand(T, (H + 2 * Hkv) * Dh, seed=seed, scale=scale).to(dtype)
        q, k = qkv[:, :H * Dh].view(T, H, Dh), qkv[:, H * Dh:(H + Hkv) * Dh].view(T, Hkv, Dh)  # strided views
        q_weight, k_weight = rand(Dh, seed=seed + 10).to(dtype), rand(Dh, seed=seed + 20).to(dtype)
        got_q, got_k = TORCH_OPS.qk_norm(q, k, q_weight, k_weight, 1e-6)
        assert torch.equal(got_q, hf_norm(q, q_weight, 1e-6)) and torch.equal(got_k, hf_norm(k, k_weight, 1e-6))
        assert got_q.is_contiguous() and got_k.shape == (T, Hkv, Dh)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_equals_transformers(dtype):
    x, residual, weight = rand(6, 256, seed=1).to(dtype), rand(6, 256, seed=2).to(dtype), rand(256, seed=3).to(dtype)
    out, stream = TORCH_OPS.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(stream, residual + x) and torch.equal(out, hf_norm(residual + x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, H, Hkv, Dh", [(1, 8, 4, 128), (8, 8, 4, 128), (5, 4, 2, 64), (3, 2, 1, 80)])
def test_rotary_equals_transformers(T, H, Hkv, Dh, dtype):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb

    qkv = rand(T, (H + 2 * Hkv) * Dh, seed=T, scale=20.0).to(dtype)
    q, k = qkv[:, :H * Dh].view(T, H, Dh), qkv[:, H * Dh:(H + Hkv) * Dh].view(T, Hkv, Dh)  # strided views
    freqs = rand(T, Dh // 2, seed=Dh, scale=500.0)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [T, 1, Dh]
    # transformers lays q out [B, H, T, Dh] and cos / sin [B, T, Dh]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[:, 0][None],
                                          sin[:, 0][None])
    got_q, got_k = TORCH_OPS.rotary(q, k, cos, sin)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))
    assert torch.equal(apply_rotary(q, cos, sin), got_q)
    odd = rand(T, 1, Dh, seed=1).to(dtype), rand(T, 1, Dh, seed=2).to(dtype)  # halves that differ
    want, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], odd[0][:, 0][None],
                                   odd[1][:, 0][None])
    assert torch.equal(apply_rotary(q, *odd), want[0].transpose(0, 1))
