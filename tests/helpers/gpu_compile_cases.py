"""The launches `gpu_compile` compiles: each kernel family through its real wrapper, on `meta`
tensors shaped as the shipped models run them (names say which; see gpu_compile's docstring).
Decode at a 2k context (the wrapper picks its split count from the table's width), prefill of a
1,024-token chunk, the towers' longest segments; half precision as served, float32 as the parity
tests run it, a 16-bit KV cache under a float32 model."""

from __future__ import annotations

from collections.abc import Callable

import torch

from helpers.gpu_compile import BF16, F16, F32, META

Case = tuple[str, Callable[[], object]]
I32, I64 = torch.int32, torch.int64
BLOCK = 16  # tokens per KV block (the engine's default)


def _empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=META)


def _decode(batch: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
            cache: torch.dtype | None = None, block: int = BLOCK) -> Callable[[], object]:
    from mmserve.models.attention.decode_kernel import decode_attention

    q = _empty(batch, heads, head_dim, dtype=dtype)
    k = _empty(4096, block, kv_heads, head_dim, dtype=cache or dtype)
    return lambda: decode_attention(q, k, k, _empty(batch, dtype=I32), _empty(batch, 2048 // block, dtype=I32), 0.1)


def _prefill(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
             cache: torch.dtype | None = None) -> Callable[[], object]:
    from mmserve.models.attention.paged_kernel import paged_attention

    q = _empty(tokens, heads, head_dim, dtype=dtype)
    k = _empty(4096, BLOCK, kv_heads, head_dim, dtype=cache or dtype)
    return lambda: paged_attention(q, k, k, _empty(2, dtype=I32), _empty(1, dtype=I32),
                                   _empty(1, tokens // BLOCK + 1, dtype=I32), tokens, 0.1)


def _tower(patches: int, heads: int, head_dim: int, longest: int, dtype: torch.dtype) -> Callable[[], object]:
    from mmserve.models.attention.varlen_kernel import varlen_attention

    q = _empty(patches, heads, head_dim, dtype=dtype)
    return lambda: varlen_attention(q, q, q, _empty(17, dtype=I32), longest, 0.1)


def attention_cases() -> list[Case]:
    """Decode, prefill and the towers' segment attention."""
    return [
        ("decode qwen2.5-7b batch 1 bf16", _decode(1, 28, 4, 128, BF16)),
        ("decode qwen2.5-7b batch 64 bf16", _decode(64, 28, 4, 128, BF16)),
        ("decode qwen3-8b batch 1 bf16", _decode(1, 32, 8, 128, BF16)),
        ("decode llava-7b batch 1 fp16 block 32", _decode(1, 32, 32, 128, F16, block=32)),
        ("decode heads of 64, group 8, bf16", _decode(1, 64, 8, 64, BF16)),
        ("decode heads of 80 bf16", _decode(1, 16, 2, 80, BF16)),
        ("decode qwen2.5-7b float32", _decode(1, 28, 4, 128, F32)),
        ("decode qwen2.5-7b float32, bf16 cache", _decode(1, 28, 4, 128, F32, BF16)),
        ("prefill qwen2.5-7b bf16", _prefill(1024, 28, 4, 128, BF16)),
        ("prefill llava-7b bf16", _prefill(1024, 32, 32, 128, BF16)),
        ("prefill heads of 64, group 8, bf16", _prefill(1024, 64, 8, 64, BF16)),
        ("prefill qwen2.5-7b float32", _prefill(1024, 28, 4, 128, F32)),
        ("prefill qwen2.5-7b float32, fp16 cache", _prefill(1024, 28, 4, 128, F32, F16)),
        ("tower qwen2.5-vl windows bf16", _tower(4096, 16, 80, 64, BF16)),
        ("tower qwen2.5-vl full bf16", _tower(4096, 16, 80, 4096, BF16)),
        ("tower qwen3-vl bf16", _tower(4096, 16, 72, 4096, BF16)),
        ("tower clip-l bf16", _tower(577, 16, 64, 577, BF16)),
        ("tower qwen2.5-vl float32", _tower(4096, 16, 80, 4096, F32)),
    ]


def _qkv(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v as views of one fused projection's output [T, (H + 2 Hkv) * Dh]."""
    fused = _empty(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)


def _writes(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> Callable[[], object]:
    from mmserve.models.attention.cache_write_kernel import rotary_write_kv_cache, write_kv_cache

    q, k, v = _qkv(tokens, heads, kv_heads, head_dim, dtype)
    cos, norm = _empty(tokens, 1, head_dim, dtype=dtype), _empty(head_dim, dtype=dtype)
    cache = _empty(4096, BLOCK, kv_heads, head_dim, dtype=dtype)
    slots = _empty(tokens, dtype=I64)
    return lambda: (rotary_write_kv_cache(q, k, v, cos, cos, cache, cache, slots),
                    rotary_write_kv_cache(q, k, v, cos, cos, cache, cache, slots, (norm, norm, 1e-6)),
                    write_kv_cache(k, v, cache, cache, slots))


def _layer_ops(tokens: int, hidden: int, inner: int, heads: int, head_dim: int,
               dtype: torch.dtype) -> Callable[[], object]:
    from mmserve.models.attention.layer_kernels import TRITON_OPS as ops

    x, weight = _empty(tokens, hidden, dtype=dtype), _empty(hidden, dtype=dtype)
    gate_up = _empty(tokens, 2 * inner, dtype=dtype)
    q, norm = _empty(tokens, heads, head_dim, dtype=dtype), _empty(head_dim, dtype=dtype)
    angles = q[:, :1].float()  # [T, 1, Dh]: the towers' cos and sin are float32
    return lambda: (ops.add_rms_norm(x, x, weight, 1e-6), ops.rms_norm(x, weight, 1e-6),
                    ops.add_layer_norm(x, x, weight, weight, 1e-6),
                    ops.silu_mul(gate_up[:, :inner], gate_up[:, inner:]), ops.qk_norm(q, q, norm, norm, 1e-6),
                    ops.rotary_float32(q, q, angles, angles), ops.activation("quick_gelu", gate_up))


def layer_cases() -> list[Case]:
    """The rotary + KV write (with Qwen3's head norms too), the plain KV write, the norms (RMS and
    layer, with the residual add), SiLU x up, the towers' float32 rotary, CLIP's quick GELU."""
    return [
        ("kv writes qwen2.5-7b bf16", _writes(64, 28, 4, 128, BF16)),
        ("kv writes llava-7b fp16", _writes(64, 32, 32, 128, F16)),
        ("layer ops qwen2.5-7b bf16", _layer_ops(64, 3584, 18944, 28, 128, BF16)),
        ("layer ops qwen3-8b float32", _layer_ops(64, 4096, 12288, 32, 128, F32)),
    ]


def _linear(rows: int, out: int, inner: int, fmt: str, bias: bool = False) -> Callable[[], object]:
    from mmserve.models.quantization import triton_kernels

    x, b = _empty(rows, inner, dtype=BF16), _empty(out, dtype=BF16) if bias else None
    if fmt == "int4":
        words, groups = _empty(out, inner // 8, dtype=I32), _empty(out, inner // 128, dtype=F32)
        zeros = _empty(out, inner // 128, dtype=torch.uint8)
        return lambda: triton_kernels.int4_linear(x, words, groups, zeros, 128, b)
    if fmt == "int8":
        codes, groups = _empty(out, inner, dtype=torch.uint8), _empty(out, inner // 128, dtype=F32)
        zero_codes = _empty(out, inner // 128, dtype=torch.int16)
        return lambda: triton_kernels.int8_linear(x, codes, groups, zero_codes, 128, b)
    weight = _empty(out, inner, dtype=torch.float8_e4m3fn)
    if fmt == "fp8 block":
        return lambda: triton_kernels.fp8_linear(x, weight, _empty(out // 128, inner // 128, dtype=F32), (128, 128), b)
    return lambda: triton_kernels.fp8_linear(x, weight, _empty(out, dtype=F32), None, b)


def _w8a8(rows: int, out: int, inner: int, static: bool = False) -> Callable[[], object]:
    """The rows quantized (bfloat16 in; by a static scale), then the int8 GEMM."""
    from mmserve.models.quantization.triton_int8_mm import int8_scaled_mm, quantize_rows

    x, q, s = _empty(rows, inner, dtype=BF16), _empty(rows, inner, dtype=torch.int8), _empty(rows, 1, dtype=F32)
    weight, scale, b = _empty(out, inner, dtype=torch.int8), _empty(out, dtype=F32), _empty(out, dtype=BF16)
    input_scale = _empty(1, dtype=F32) if static else None
    return lambda: (quantize_rows(x, input_scale), int8_scaled_mm(q, s, weight, scale, b, BF16))


def _fp8_rows(rows: int, inner: int, static: bool = False) -> Callable[[], object]:
    """FP8 activations for `torch._scaled_mm` (bfloat16 in), per token or by a static scale."""
    from mmserve.models.quantization.triton_fp8_quant import quantize_rows

    x, input_scale = _empty(rows, inner, dtype=BF16), _empty(1, dtype=F32) if static else None
    return lambda: quantize_rows(x, input_scale)


def quantized_cases() -> list[Case]:
    """The int4, int8 and FP8 GEMV (decode rows) and GEMM (prefill rows), Q/K/V of the 7B with its
    bias; W8A8's int8 GEMM at a decode step's rows (K split: o_proj's narrow output) and a prefill's,
    and its quantization by a static scale."""
    return [*[(f"{fmt} qkv of qwen2.5-7b, {rows} rows", _linear(rows, 4608, 3584, fmt, bias=True))
              for fmt in ("int4", "int8", "fp8 block", "fp8 row") for rows in (1, 1024)],
            ("w8a8 o_proj of qwen2.5-7b, 1 row", _w8a8(1, 3584, 3584)),
            ("w8a8 qkv of qwen2.5-7b, 1024 rows", _w8a8(1024, 4608, 3584)),
            ("w8a8 static-scale qkv of qwen2.5-7b, 1 row", _w8a8(1, 4608, 3584, static=True)),
            ("fp8 activations of qwen2.5-7b's down_proj, 1 row", _fp8_rows(1, 18944)),
            ("fp8 static-scale activations, 1024 rows", _fp8_rows(1024, 3584, static=True))]
