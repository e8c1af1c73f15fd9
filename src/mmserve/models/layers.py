"""Building blocks shared by the decoder and the vision tower: norms, rotary, activations.

Attention itself lives in models/attention/ (one backend per way of computing it).
Shapes: T = tokens of the whole step (all requests flattened), H = heads, Dh = head dim.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, Dh]
QKNorm = tuple[torch.Tensor, torch.Tensor, float]  # Qwen3's per-head norms: q weight [Dh], k weight [Dh], eps


class RMSNorm(nn.Module):
    """Llama's RMSNorm, computed in float32 like transformers."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] normalised over D in float32, back in x's dtype, times weight [D]."""
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32:
        return _rms_norm_f32(x, weight, eps)
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` of float32 x and weight: the same operations on the same values (no casts; the
    sum, scale and product updated in place; x * r * weight is weight * (x * r) bit for bit, a
    product of two floats being commutative), in fewer calls: this runs several times a layer."""
    scale = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # [..., 1]
    return (x * scale).mul_(weight)


class LayerOps:
    """The small ops between a decoder layer's GEMMs, in PyTorch: the reference the torch
    backend's C kernels for decode (models/cpu_ops.py: `CpuLayerOps`, PyTorch's ops elsewhere)
    and the triton backend's fused kernels (models/attention/layer_kernels.py) equal.

    Each backend's step metadata names its set (`StepAttention.ops`), chosen once with the
    backend. A caller hands over the tensors it passes: a fused version may overwrite them."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [..., D] -> RMSNorm(x) * weight, x's shape and dtype."""
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, D] -> (RMSNorm(residual + x) * weight, residual + x)."""
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, D] -> LayerNorm(x) * weight + bias (PyTorch's `layer_norm`), x's shape and dtype."""
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    def add_layer_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, D] -> (LayerNorm(residual + x) * weight + bias, residual + x)."""
        residual = residual + x
        return self.layer_norm(residual, weight, bias, eps), residual

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, Dh], k: [T, Hkv, Dh] -> each `rms_norm`ed over Dh times its weight [Dh]
        (Qwen3's per-head norms). In float32 the heads of both are normalised together, the
        same operations on each row as `rms_norm`'s in fewer calls."""
        if not q.dtype == k.dtype == q_weight.dtype == k_weight.dtype == torch.float32:
            return rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
        qk = torch.cat((q, k), dim=1)  # [T, H + Hkv, Dh]
        qk.mul_(qk.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_())
        H = q.shape[1]
        return qk[:, :H] * q_weight, qk[:, H:] * k_weight

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up: [T, I] (two tensors, or the halves of one [T, 2I]) -> SiLU(gate) * up [T, I]."""
        return F.silu(gate) * up

    def activation(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x: [..., I] through the activation `name` (`ACTIVATIONS`), as transformers computes it."""
        return activation(name)(x)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, Dh], k: [T, Hkv, Dh] rotated by cos, sin: [T, 1, Dh] (rotate-half layout)."""
        signed = signed_sin(sin)
        return _rotate(q, cos, signed), _rotate(k, cos, signed)

    def rotary_float32(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotary` computed in float32 (cos, sin: [T, 1, Dh] float32) and rounded back to q's and
        k's dtype: the vision towers' rotary, as transformers computes it."""
        signed = signed_sin(sin)
        return _rotate(q.float(), cos, signed).to(q.dtype), _rotate(k.float(), cos, signed).to(k.dtype)


TORCH_OPS = LayerOps()


def add_norm(ops: LayerOps, norm: nn.Module, x: torch.Tensor,
             residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(stream), stream) of the stream x + residual (x alone when residual is None), the norm
    (RMSNorm or LayerNorm) with the add through `ops`: x and residual may be overwritten."""
    if isinstance(norm, RMSNorm):
        return norm_residual(ops, norm, x, residual)
    assert isinstance(norm, nn.LayerNorm) and norm.bias is not None
    if residual is None:
        return ops.layer_norm(x, norm.weight, norm.bias, norm.eps), x
    return ops.add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps)


def norm_residual(ops: LayerOps, norm: RMSNorm, x: torch.Tensor,
                  residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(stream), stream) of the stream x + residual (x alone when residual is None)."""
    if residual is None:
        return ops.rms_norm(x, norm.weight, norm.eps), x
    return ops.add_rms_norm(x, residual, norm.weight, norm.eps)


class EmbeddingTable(nn.Module):
    """A learned table read whole (`weight` [rows, dim], the parameter name `nn.Embedding` has).
    Unlike `nn.Embedding` it is not randomly initialised: its values always come from the
    checkpoint, and `normal_` on the meta device (where models are built) imports
    torch._dynamo, seconds of every engine core's start (README, "Measurements behind the design")."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation, x * sigmoid(1.702 x), op by op as transformers' `QuickGELUActivation`."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported")
    return ACTIVATIONS[name]


class RotaryEmbedding(nn.Module):
    """Llama's default rotary embedding (rotate-half): cos/sin per position, computed once a step."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        # a plain float32 attribute, not a buffer: it stays float32 under --dtype, and is real
        # even when the model is built on the meta device
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self.inv_freq = 1.0 / (theta**exponents)  # [Dh/2]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, 1, Dh] (broadcast over heads)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, Dh]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, Dh] rotated by position: x * cos + rotate_half(x) * sin, rotate_half(x)
    being cat(-x2, x1) of x's halves (transformers' `apply_rotary_pos_emb`)."""
    return _rotate(x, cos, signed_sin(sin))


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., Dh] (Dh even) with its first half negated: rotate_half(x) * sin is
    cat(x2, x1) * this, bit for bit (negating a factor negates the product exactly), and
    cat(x2, x1) is one roll."""
    return sin * _half_signs(sin.shape[-1], sin.dtype, sin.device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, given `signed_sin(sin)`."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed


@functools.cache
def _half_signs(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[dim]: -1 on the first half, 1 on the second; made on `device` (no host tensor: a tower's
    run after its plan stays on the device)."""
    signs = torch.ones(dim, dtype=dtype, device=device)
    signs[:dim // 2] = -1
    return signs


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
