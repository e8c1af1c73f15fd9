"""Int8 weights multiplied by int8 activations (W8A8): compressed-tensors' int-quantized format,
llm-compressor's "W8A8" preset (RedHatAI's `Qwen2.5-VL-*-Instruct-quantized.w8a8`).

Resident form: `weight` int8 [out, in] and `scale` float32 [out] (a per-tensor scale repeated on
every row); W = weight * scale[:, None].

As published (compressed-tensors `compressors/quantized_compressors/naive_quantized.py`:
`IntQuantizationCompressor`; vLLM `compressed_tensors/schemes/compressed_tensors_w8a8_int8.py`):
`weight` int8 [out, in], `weight_scale` [out, 1] (`channel`) or [1] (`tensor`), symmetric; the
input activations int8, `dynamic` per `token`, symmetric: nothing stored for them; or static,
symmetric, by `tensor` (older neuralmagic exports): `input_scale` [1], resident as float32 [1],
fused siblings taking the largest of theirs (vLLM's `requantize`-free choice for one input).

A step's activations are quantized per row (token) as vLLM's `scaled_int8_quant` quantizes them
(`csrc/quantization/compressed_tensors/int8_quant_kernels.cu`, dynamic): s = max|x| / 127 and
q = x * (127 / max|x|) rounded half to even, clamped to [-128, 127] (a row of zeros: q = 0, s = 0);
both divisions IEEE-rounded, as CUDA's `/` is. A static scale s quantizes as vLLM's
`static_scaled_int8_quant`: q = x / s rounded half to even, clamped.
compressed-tensors' own fake quantization divides by 127.5 (`calculate_qparams`: the range over
two); vLLM, which these checkpoints are published for, by 127, and so does mmserve. Under tensor
parallelism a row-parallel layer's rank quantizes its own slice of x, as in vLLM.

y = (q_x q_w^T) * s_x * s_w (+ b): the integer products summed in int32 (exact), then scaled in
float32. `apply` is proven equal to the float product of the dequantized activations and weights
(`quantize_rows` then `dequantize`). Kernels: on the CPU our C GEMV for a decode step's rows
(w8a8_cpu.py: the same numbers, bit for bit, and the compiled decode step's), else `torch._int_mm`
(oneDNN's int8 GEMM); on
a GPU our Triton kernels (triton_int8_mm.py: the rows quantized in one launch, int8 dot products
into int32 with the scales applied in the GEMM's epilogue).
"""

from __future__ import annotations

import torch

from mmserve.models.quantization.base import (Layer, LinearMethod, LinearShape, input_scale, register_input_scale,
                                              register_row_scaled, replace, row_scale)
from mmserve.models.quantization import cpu_gemv, w8a8_cpu
from mmserve.models.quantization.groups import stack_row_scaled

INT8_MAX = 127.0


def quantize_rows(x: torch.Tensor, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q int8 [M, K], s float32 [M, 1]) with x ~ q * s per row (see
    the module docstring), or by the `static` scale [1] for every row: the CPU's, and the
    definition triton_int8_mm.py's one-launch kernel of the same name is held to bit for bit."""
    values = x.float()
    if static is not None:
        q = torch.round(values / static).clamp_(-128, 127).to(torch.int8)  # tensor / tensor: IEEE
        return q, static.reshape(1, 1).expand(x.shape[0], 1)
    peak = values.abs().amax(dim=-1, keepdim=True)
    top = torch.full_like(peak, INT8_MAX)  # tensor / tensor: IEEE division (a scalar numerator is
    inverse = torch.where(peak > 0, top / peak, torch.zeros_like(peak))  # a reciprocal times it)
    q = torch.round(values * inverse).clamp_(-128, 127).to(torch.int8)
    return q, peak / top


def int8_product(q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """(q [M, K] int8 @ weight [N, K]^T int8) * s [M, 1] * scale [N] (+ bias), in `dtype`."""
    if q.is_cuda:
        from mmserve.models.quantization.triton_int8_mm import int8_scaled_mm

        return int8_scaled_mm(q, s, weight, scale, bias, dtype)
    y = torch._int_mm(q, weight.t()).float() * s * scale
    return (y if bias is None else y + bias.float()).to(dtype)


class W8A8Method(LinearMethod):
    """Int8 weights with one scale per output row (`per_tensor`: one for the tensor, stored [1] or
    []), multiplied by activations quantized to int8 per token at run time (`static_input`: by
    the layer's stored `input_scale`)."""

    def __init__(self, per_tensor: bool = False, static_input: bool = False) -> None:
        self.per_tensor, self.static_input = per_tensor, static_input
        self.name = "w8a8_static" if static_input else "w8a8"

    def create_weights(self, layer: Layer, shape: LinearShape) -> None:
        register_row_scaled(layer, shape, torch.int8, self.per_tensor)
        if self.static_input:
            register_input_scale(layer)

    def process_weights(self, layer: Layer) -> None:
        static = {"input_scale": input_scale([layer])} if self.static_input else {}
        weight, scale = layer.weight.contiguous(), row_scale(layer)
        replace(layer, weight=weight, scale=scale, **static,
                **w8a8_cpu.gemv_tensors(weight, scale, static.get("input_scale")))

    def dequantize(self, layer: Layer) -> torch.Tensor:
        return layer.weight.float() * layer.scale[:, None]

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows, static = x.reshape(-1, x.shape[-1]), getattr(layer, "input_scale", None)
        if hasattr(layer, "wsum"):  # a decode step's rows on the CPU: the C GEMV, the same numbers
            out = w8a8_cpu.w8a8_gemv(x, layer.weight, layer.gemv_scales, layer.wsum, static is not None, bias)
            if out is not None:
                return out
        if x.is_cuda:  # two launches: the rows quantized, then the GEMM
            from mmserve.models.quantization import triton_int8_mm

            q, s = triton_int8_mm.quantize_rows(rows, static)
        else:
            q, s = quantize_rows(rows, static)
        y = int8_product(q, s, layer.weight, layer.scale, bias, x.dtype)
        return y.reshape(*x.shape[:-1], layer.weight.shape[0])

    def cpu_gemv(self, layer: Layer) -> cpu_gemv.CpuGemv | None:
        if not hasattr(layer, "wsum"):
            return None
        return w8a8_cpu.w8a8_call(layer.weight, layer.gemv_scales, layer.wsum, self.static_input)

    def concat(self, layers: list[Layer]) -> dict[str, torch.Tensor] | None:
        stacked = stack_row_scaled(layers, self.static_input)
        if stacked is None:
            return None
        return {**stacked, **w8a8_cpu.gemv_tensors(stacked["weight"], stacked["scale"], stacked.get("input_scale"))}
