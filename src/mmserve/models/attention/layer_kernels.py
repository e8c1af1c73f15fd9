"""Our Triton kernels for the small ops between a decoder layer's GEMMs: residual add + RMSNorm,
SiLU x up and CLIP's quick GELU, each one launch where PyTorch makes several (`models/layers.py: LayerOps` is the
reference they equal), and the rotary's parts that cache_write_kernel.py fuses with the KV write.

Imported only by the triton backend (it needs `triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.models.layers import LayerOps

# Shapes (T = tokens, D = hidden size, H / Hkv = query / KV heads, Dh = head dim, I = MLP width);
# every last dimension is contiguous, rows may be strided (views of a fused projection's output):
#   _norm_kernel: x [T, HEADS, D] (HEADS = 1 for hidden states, H for Qwen3's per-head q/k
#     norms), residual [T, D] (read and overwritten when HAS_RESIDUAL), weight [D] (and bias [D]
#     for a LayerNorm), out like x; one program per (token, head) row
#   _silu_mul_kernel: gate, up, out [T, I]; one program per (token, BLOCK lanes)
#   _quick_gelu_kernel: x, out [T, I]; one program per (token, BLOCK lanes)
#   rotate_heads: one token's heads [heads, Dh] rotated by its cos, sin [Dh] (rotate-half)
#   _rotary_kernel: q [T, H, Dh], k [T, Hkv, Dh] (rows may be strided) rotated by cos, sin [T, Dh]
#     into contiguous q_out, k_out; one program per token
# Masks: lanes past D, I or Dh / 2 and heads past H or Hkv (padding to powers of two) load 0 and
# store nothing. Values are rounded to the tensors' dtype wherever PyTorch's op-by-op path rounds
# (after the residual add, the normalisation, each product of the rotary, the SiLU, each step of
# the quick GELU; a LayerNorm once, at its end, as PyTorch's layer_norm kernel), so bfloat16
# results equal the torch path's up to the float32 sum's order.


@triton.jit
def _norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, eps, stride_xt, stride_xh, stride_rt, stride_ot, stride_oh,
                 HEADS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 LAYER: tl.constexpr):
    row = tl.program_id(0)
    t = (row // HEADS).to(tl.int64)
    h = row % HEADS
    c = tl.arange(0, BLOCK)
    ok = c < D
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + c, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + t * stride_rt + c, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + t * stride_rt + c, x, mask=ok)
    xf = x.to(tl.float32)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    if LAYER:  # LayerNorm: centred, scaled, shifted by the bias, rounded once
        centred = tl.where(ok, xf - tl.sum(xf, 0) / D, 0.0)
        b = tl.load(b_ptr + c, mask=ok, other=0.0).to(tl.float32)
        y = centred * tl.rsqrt(tl.sum(centred * centred, 0) / D + eps) * w + b
    else:  # RMSNorm: normalised and rounded, then times the weight
        y = w * (xf * tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + c, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, width, stride_gt, stride_ut, stride_ot, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < width
    gate = tl.load(gate_ptr + t * stride_gt + c, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    up = tl.load(up_ptr + t * stride_ut + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + c, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _quick_gelu_kernel(x_ptr, out_ptr, width, stride_xt, stride_ot, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < width
    x = tl.load(x_ptr + t * stride_xt + c, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    scaled = (xf * 1.702).to(x.dtype).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-scaled))).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + c, (xf * gate).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def rotate_heads(src_ptr, src_stride_h, dst_ptr, dst_stride_h, heads: tl.constexpr, c, ok, cos1, cos2, sin1, sin2,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, WIDE: tl.constexpr, w_ptr, eps, NORM: tl.constexpr):
    """One token's `heads` rows [heads, 2 * HALF] from src rotated (rotate-half layout) into dst
    (may be src), each value rounded to src's dtype (WIDE: computed in float32, rounded once at
    the end: `LayerOps.rotary_float32`), then to dst's (a cache's may differ); `ok` [BLOCK] masks
    the half-dimension lanes (and, all False, the whole token). NORM: each row first RMS-normalised
    and times the weight [2 * HALF] at w_ptr, rounded as `LayerOps.qk_norm` rounds (Qwen3)."""
    h = tl.arange(0, BLOCK_H)
    mask = (h < heads)[:, None] & ok[None, :]
    first = src_ptr + h[:, None] * src_stride_h + c[None, :]
    raw1 = tl.load(first, mask=mask, other=0.0)
    dtype = tl.float32 if WIDE else raw1.dtype
    x1 = raw1.to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]  # [BLOCK_H, 1]
        w1 = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + c, mask=ok, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * r).to(raw1.dtype).to(tl.float32)).to(raw1.dtype).to(tl.float32)
        x2 = (w2 * (x2 * r).to(raw1.dtype).to(tl.float32)).to(raw1.dtype).to(tl.float32)
    out = dst_ptr + h[:, None] * dst_stride_h + c[None, :]
    a = (x1 * cos1[None, :]).to(dtype).to(tl.float32)
    b = (x2 * sin1[None, :]).to(dtype).to(tl.float32)
    tl.store(out, (a - b).to(dtype).to(dst_ptr.dtype.element_ty), mask=mask)
    a = (x2 * cos2[None, :]).to(dtype).to(tl.float32)
    b = (x1 * sin2[None, :]).to(dtype).to(tl.float32)
    tl.store(out + HALF, (a + b).to(dtype).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, stride_ct, stride_ot, stride_oh, stride_pt, stride_ph, HQ: tl.constexpr,
                   HK: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   WIDE: tl.constexpr):
    t, c, ok, cos1, cos2, sin1, sin2 = load_rotation(cos_ptr, sin_ptr, stride_ct, HALF, BLOCK_HALF)
    rotate_heads(q_ptr + t * stride_qt, stride_qh, q_out_ptr + t * stride_ot, stride_oh, HQ, c, ok,
                 cos1, cos2, sin1, sin2, HALF, BLOCK_H, WIDE, cos_ptr, 0.0, False)
    rotate_heads(k_ptr + t * stride_kt, stride_kh, k_out_ptr + t * stride_pt, stride_ph, HK, c, ok,
                 cos1, cos2, sin1, sin2, HALF, BLOCK_H, WIDE, cos_ptr, 0.0, False)


@triton.jit
def load_rotation(cos_ptr, sin_ptr, stride_ct, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """This program's token t (`program_id(0)`), the half-dimension lanes c and their mask, and
    t's cos and sin, each as its two halves [BLOCK_HALF] float32: (t, c, ok, cos1, cos2, sin1, sin2)."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_HALF)
    ok = c < HALF
    cos1 = tl.load(cos_ptr + t * stride_ct + c, mask=ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + t * stride_ct + HALF + c, mask=ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + t * stride_ct + c, mask=ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + t * stride_ct + HALF + c, mask=ok, other=0.0).to(tl.float32)
    return t, c, ok, cos1, cos2, sin1, sin2


def _row_warps(width: int) -> int:
    """Warps for one program over a row of `width` values (4 up to 4,096 lanes, then 8, then 16)."""
    return 4 if width <= 4096 else 8 if width <= 8192 else 16


class TritonLayerOps(LayerOps):
    """`LayerOps` as one Triton kernel each (the decoder's rotary is fused with the KV write instead:
    `TritonMetadata.attend`). `add_rms_norm` overwrites x (with the normalised rows) and
    residual (with residual + x)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._norm(x, None, weight, None, eps, out)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        self._norm(x, residual, weight, None, eps, x)
        return x, residual

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        D = x.shape[-1]  # [..., D] as rows [T, D]: CLIP's [N, L, D] stream
        self._norm(x.reshape(-1, D), None, weight, bias, eps, out.view(-1, D))
        return out

    def add_layer_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        D = x.shape[-1]  # views: both are updated in place
        self._norm(x.view(-1, D), residual.view(-1, D), weight, bias, eps, x.view(-1, D))
        return x, residual

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rms_norm(q, q_weight, eps), self.rms_norm(k, k_weight, eps)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _rotate(q, k, cos, sin, wide=False)

    def rotary_float32(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _rotate(q, k, cos, sin, wide=True)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        T, width = gate.shape
        out = torch.empty(T, width, dtype=gate.dtype, device=gate.device)
        if T:
            assert gate.stride(1) == 1 and up.stride(1) == 1
            block = min(1024, triton.next_power_of_2(width))
            _silu_mul_kernel[(T, triton.cdiv(width, block))](gate, up, out, width, gate.stride(0), up.stride(0),
                                                             out.stride(0), BLOCK=block, num_warps=4)
        return out

    def activation(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name != "quick_gelu" or not x.numel():
            return super().activation(name, x)
        rows = x.reshape(-1, x.shape[-1])  # [T, I], rows contiguous
        T, width = rows.shape
        out = torch.empty_like(rows)
        block = min(1024, triton.next_power_of_2(width))
        _quick_gelu_kernel[(T, triton.cdiv(width, block))](rows, out, width, rows.stride(0), out.stride(0),
                                                           BLOCK=block, num_warps=4)
        return out.view(x.shape)

    @staticmethod
    def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
              eps: float, out: torch.Tensor) -> None:
        """x: [T, D] or [T, heads, D] (out alike); residual: [T, D] or None; a bias: a LayerNorm."""
        x3, out3 = (x[:, None], out[:, None]) if x.dim() == 2 else (x, out)
        T, heads, D = x3.shape
        if T == 0:
            return
        assert x3.stride(2) == 1 and out3.stride(2) == 1 and (residual is None or residual.stride(1) == 1)
        res = residual if residual is not None else x
        _norm_kernel[(T * heads,)](x3, res, weight, weight if bias is None else bias, out3, eps, x3.stride(0),
                                   x3.stride(1), res.stride(0), out3.stride(0), out3.stride(1), HEADS=heads, D=D,
                                   BLOCK=triton.next_power_of_2(D), HAS_RESIDUAL=residual is not None,
                                   LAYER=bias is not None, num_warps=_row_warps(D))


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            wide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, Dh], k [T, Hkv, Dh] (rows may be strided) rotated by cos, sin [T, 1, Dh] into new
    contiguous tensors, one launch (`_rotary_kernel`)."""
    T, H, Dh = q.shape
    Hkv = k.shape[1]
    q_out = torch.empty(T, H, Dh, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, Hkv, Dh, dtype=k.dtype, device=k.device)
    if T:
        cos, sin = cos.reshape(T, Dh), sin.reshape(T, Dh)
        assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
        _rotary_kernel[(T,)](q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                             cos.stride(0), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
                             HQ=H, HK=Hkv, HALF=Dh // 2, BLOCK_HALF=triton.next_power_of_2(Dh // 2),
                             BLOCK_H=triton.next_power_of_2(max(H, Hkv)), WIDE=wide, num_warps=4)
    return q_out, k_out


TRITON_OPS = TritonLayerOps()
