"""FP8 (e4m3) weights: per output row (compressed-tensors' FP8-dynamic, vLLM's per-tensor FP8,
`--quantization fp8` at load) and per 2-D block (`weight_block_size`, Qwen3-VL's FP8 releases).

Resident form: `weight` float8_e4m3fn [out, in] and float32 scales; W = weight * scale with
- per row: `scale` [out] (a per-tensor scale repeated on every row);
- per block: `scale` [ceil(out / bo), ceil(in / bi)], W[o, i] = weight[o, i] * scale[o // bo, i // bi].

As published:
- block-wise (transformers `integrations/finegrained_fp8.py`, vLLM `quantization/fp8.py` and
  `utils/fp8_utils.py`; DeepSeek-V3's `weight_dequant`): `weight` [out, in], `weight_scale_inv`
  float32 [ceil(out / bo), ceil(in / bi)], which despite its name multiplies: W = weight * s;
  compressed-tensors' FP8_BLOCK (`strategy: block`, `block_structure`) stores the same as
  `weight_scale`;
- compressed-tensors `float-quantized` (`quantization/lifecycle/forward.py`: `dequantize` is
  x_q * scale): `weight` [out, in], `weight_scale` [out, 1] (channel) or [1] (tensor); vLLM's
  serialized per-tensor FP8 stores `weight_scale` as a scalar.
- online (vLLM `--quantization fp8`, `Fp8LinearMethod` without a serialized checkpoint): here
  each output row is scaled so its largest magnitude is e4m3's largest finite value, 448.

- static activation scales (vLLM's serialized FP8 with `activation_scheme: "static"`,
  compressed-tensors FP8 with static `tensor` activations, ModelOpt's FP8): also `input_scale`
  [] or [1], the one scale of the layer's activations; fused siblings take the largest of theirs.

Activations stay in the model's dtype on the CPU (weight-only: the product is
dequantize-then-matmul's, by the C kernels of cpu_gemv.py). On a GPU with FP8 (compute
capability 8.9+), per-row layers multiply through `torch._scaled_mm` with activations quantized
per token at run time (vLLM's dynamic scheme), or by their `input_scale` (static); block-wise
layers, and per-row ones on older GPUs, through our Triton kernels (triton_kernels.py:
weight-only, dequantized in registers).
"""

from __future__ import annotations

import functools

import torch

from mmserve.models.quantization import cpu_gemv
from mmserve.models.quantization.base import (Layer, LinearMethod, LinearShape, Shard, input_scale, register,
                                              register_input_scale, register_row_scaled, replace, row_scale,
                                              tiled_linear)
from mmserve.models.quantization.groups import stack_row_scaled

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite magnitude


class Fp8RowMethod(LinearMethod):
    """FP8 weights with one scale per output row; `source`: "checkpoint" (`weight_scale` of
    `scale_shape`) or "online" (a float `weight` quantized at load); `static_input`: the
    checkpoint also stores the activations' scale (`input_scale`)."""

    def __init__(self, source: str, per_tensor: bool = False, static_input: bool = False) -> None:
        self.source, self.per_tensor, self.static_input = source, per_tensor, static_input
        self.name = "fp8_online" if source == "online" else "fp8_static" if static_input else "fp8_channel"

    def create_weights(self, layer: Layer, shape: LinearShape) -> None:
        out, inp, s = shape.out_features, shape.in_features, shape.shard
        if self.source == "online":
            register(layer, "weight", (out, inp), torch.float32, s)
            layer.weight.load_lazily = True  # allocated when read, quantized at once (models/loader.py)
            return
        register_row_scaled(layer, shape, FP8, self.per_tensor)
        if self.static_input:
            register_input_scale(layer)

    def process_weights(self, layer: Layer) -> None:
        weight = layer.weight
        if self.source == "online":
            w = weight.float()
            scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # [out]
            replace(layer, weight=(w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale=scale)
        elif self.static_input:
            replace(layer, weight=weight, scale=row_scale(layer), input_scale=input_scale([layer]))
        else:
            replace(layer, weight=weight, scale=row_scale(layer))

    def dequantize(self, layer: Layer) -> torch.Tensor:
        return layer.weight.float() * layer.scale[:, None]

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if _has_fp8_matmul(x, layer.weight):
            return _scaled_mm(x, layer.weight, layer.scale, bias, getattr(layer, "input_scale", None))
        if x.is_cuda:
            from mmserve.models.quantization.triton_kernels import fp8_linear

            return fp8_linear(x, layer.weight, layer.scale, None, bias)
        out = cpu_gemv.fp8_gemv(x, layer.weight, layer.scale, None, bias)
        if out is not None:
            return out
        return tiled_linear(x, bias, layer.weight.shape[0], lambda a, b: _rows(layer, None, a, b))

    def cpu_gemv(self, layer: Layer) -> cpu_gemv.CpuGemv | None:
        return cpu_gemv.fp8_call(layer.weight, layer.scale, None)

    def concat(self, layers: list[Layer]) -> dict[str, torch.Tensor] | None:
        return stack_row_scaled(layers, self.static_input)


class Fp8BlockMethod(LinearMethod):
    """FP8 weights with one scale per `block` = (rows, columns) tile, from `scale_name`
    (`weight_scale_inv`; compressed-tensors' FP8_BLOCK: `weight_scale`)."""

    name = "fp8_block"
    attrs = ("fp8_block",)

    def __init__(self, block: tuple[int, int], scale_name: str = "weight_scale_inv") -> None:
        self.block, self.scale_name = block, scale_name

    def create_weights(self, layer: Layer, shape: LinearShape) -> None:
        out, inp, s = shape.out_features, shape.in_features, shape.shard
        bo, bi = self.block
        scale_shard = None
        if s is not None:
            unit = self.block[s.dim]
            if s.start % unit:
                raise ValueError(f"a tensor-parallel shard starting at {s.start} of a block-quantized weight "
                                 f"does not start on a block ({unit})")
            scale_shard = Shard(s.dim, s.start // unit, -(-s.length // unit))
        layer.fp8_block = self.block
        register(layer, "weight", (out, inp), FP8, s)
        register(layer, self.scale_name, (-(-out // bo), -(-inp // bi)), torch.float32, scale_shard, keep_dtype=True)

    def process_weights(self, layer: Layer) -> None:
        replace(layer, weight=layer.weight, scale=getattr(layer, self.scale_name).float().contiguous())

    def dequantize(self, layer: Layer) -> torch.Tensor:
        return _block_rows(layer, 0, layer.weight.shape[0])

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            from mmserve.models.quantization.triton_kernels import fp8_linear

            return fp8_linear(x, layer.weight, layer.scale, layer.fp8_block, bias)
        out = cpu_gemv.fp8_gemv(x, layer.weight, layer.scale, layer.fp8_block, bias)
        if out is not None:
            return out
        return tiled_linear(x, bias, layer.weight.shape[0], lambda a, b: _rows(layer, layer.fp8_block, a, b))

    def cpu_gemv(self, layer: Layer) -> cpu_gemv.CpuGemv | None:
        return cpu_gemv.fp8_call(layer.weight, layer.scale, layer.fp8_block)

    def concat(self, layers: list[Layer]) -> dict[str, torch.Tensor] | None:
        if any(layer.weight.shape[0] % self.block[0] for layer in layers[:-1]):
            return None  # a partial block inside the stack would shift the scales of the rows after it
        return {name: torch.cat([getattr(layer, name) for layer in layers]) for name in ("weight", "scale")}


def _rows(layer: Layer, block: tuple[int, int] | None, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the layer's W, float32: by the C kernel where it runs."""
    rows = cpu_gemv.fp8_rows(layer.weight, layer.scale, block, start, stop)
    if rows is not None:
        return rows
    if block is None:
        return layer.weight[start:stop].float() * layer.scale[start:stop, None]
    return _block_rows(layer, start, stop)


def _block_rows(layer: Layer, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a block-scaled layer's W, float32."""
    bo, bi = layer.fp8_block
    inp = layer.weight.shape[1]
    rows = torch.arange(start, stop, device=layer.weight.device) // bo
    scale = layer.scale[rows].repeat_interleave(bi, dim=1)[:, :inp]  # [rows, in]
    return layer.weight[start:stop].float() * scale


def _has_fp8_matmul(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """FP8 tensor cores (Ada, Hopper and later) and the multiples of 16 `_scaled_mm` needs."""
    return (x.is_cuda and _fp8_capable(x.device.index or 0) and x.dtype == torch.bfloat16
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0)


@functools.cache
def _fp8_capable(device: int) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows(x: torch.Tensor, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q e4m3 [M, K], s float32 [M, 1]) with x ~ q * s per row:
    s = max(max|x| / 448, 1e-12) (vLLM's dynamic per-token scheme), or the `static` scale [1] for
    every row; q = x / s clamped to +-448, rounded to nearest even. Divisions by tensors: IEEE's.
    The definition triton_fp8_quant.py's one-launch kernel is held to bit for bit."""
    values = x.float()
    if static is None:
        peak = values.abs().amax(dim=-1, keepdim=True)
        s = torch.maximum(peak / torch.full_like(peak, FP8_MAX), torch.full_like(peak, 1e-12))
    else:
        s = static.reshape(1, 1).float().expand(x.shape[0], 1).contiguous()  # [M, 1], as row-wise scaling wants
    return (values / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               static: torch.Tensor | None = None) -> torch.Tensor:
    """x [.., in] @ (weight * scale)^T on FP8 tensor cores: x quantized per row (token) at run
    time, or by the `static` scale [1] for the tensor (`quantize_rows`: one Triton launch on a
    GPU); no host sync. `torch._scaled_mm` wants the second operand column-major (weight.t())."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.is_cuda:
        from mmserve.models.quantization import triton_fp8_quant

        x_q, x_scale = triton_fp8_quant.quantize_rows(rows, static)
    else:
        x_q, x_scale = quantize_rows(rows, static)
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=x.dtype)
    out = out.reshape(*x.shape[:-1], weight.shape[0])  # row-wise scales want bfloat16 out
    return out if bias is None else out + bias
