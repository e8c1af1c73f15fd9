"""The interface between a linear layer and the form its weight takes: dense, or quantized.

A `LinearMethod` owns a layer's weight tensors:

- `create_weights`: the tensors the checkpoint stores for the layer, in the checkpoint's layout,
  registered on the layer (meta device) with the slice of each this rank reads (`tp_shards`);
- `process_weights`: once they are loaded, the resident form (repacked, or quantized at load);
- `apply`: y = x W^T + b from the resident form;
- `dequantize`: the float matrix W [out, in] the resident form stands for, which every kernel of
  the method is proven equal to (its product is dequantize-then-matmul's);
- `concat`: sibling layers' resident tensors stacked by output rows (one GEMM for Q/K/V or
  gate/up, `FusedLinear`), or None where the method cannot stack them.
- `cpu_gemv`: the layer's decode GEMV on the CPU as one C call (`cpu_gemv.CpuGemv`: the kernel
  `apply` would call for a decode step's rows, and its arguments), or None where `apply` calls no
  C kernel: what models/cpu_decoder.py's compiled step calls.

Layers (models/parallel.py) start dense; the loader gives each the method the checkpoint's
`quantization_config` names for it (models/quantization/config.py). Model code names none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from mmserve.models.quantization.cpu_gemv import CpuGemv

_STANDARD_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
HALF_FLOATS = (torch.float16, torch.bfloat16)
Layer = Any  # a module holding a method's tensors as attributes: a ParallelLinear or a FusedLinear
PREFILL_TILE_ROWS = 256  # output rows dequantized at a time for a prefill's matmul


@dataclass(frozen=True)
class Shard:
    """A parameter holds checkpoint indices [start, start + length) along `dim` (zero-padded
    past `length` when the parameter is longer, e.g. the last rank's vocab rows)."""

    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class LinearShape:
    """This rank's part of a layer's weight, as the float matrix W [out, in] it stands for;
    `shard` is its slice of the checkpoint's whole W: dim 0 (output rows: column-parallel) or
    dim 1 (input columns: row-parallel), None for all of it."""

    out_features: int
    in_features: int
    shard: Shard | None = None


def register(layer: Layer, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             shard: Shard | None = None, keep_dtype: bool = False) -> None:
    """An uninitialised (meta) parameter `name` on `layer`, read through `shard` by the loader.
    `keep_dtype`: a float tensor the loader must not cast to the model's dtype (scales, FP8)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)  # meta when the model is built there
    param.keep_dtype = keep_dtype or dtype not in _STANDARD_FLOATS  # type: ignore[attr-defined]
    setattr(layer, name, param)
    layer.weight_names = [*getattr(layer, "weight_names", []), name]
    if shard is not None:
        layer.tp_shards[name] = shard


def register_row_scaled(layer: Layer, shape: LinearShape, dtype: torch.dtype, per_tensor: bool) -> None:
    """`weight` [out, in] in `dtype` and its `weight_scale`: [1] (stored [1] or []) for the whole
    tensor, else [out, 1] (or stored [out]), one per row, with this rank's rows (compressed-tensors'
    `tensor` and `channel` strategies, vLLM's serialized per-tensor FP8, ModelOpt's FP8 per tensor
    or per channel); `row_scale` gives it per row."""
    s = shape.shard
    register(layer, "weight", (shape.out_features, shape.in_features), dtype, s)
    if per_tensor:
        register(layer, "weight_scale", (1,), torch.float32, keep_dtype=True)
        layer.weight_scale.any_shape_of_one = True
    else:
        register(layer, "weight_scale", (shape.out_features, 1), torch.float32,
                 None if s is None or s.dim == 1 else s, keep_dtype=True)
        layer.weight_scale.column_or_flat = True  # ModelOpt's per-channel FP8 stores it [out]


def register_input_scale(layer: Layer) -> None:
    """`input_scale`: the static scale of the layer's activations, one for the tensor (stored [] or
    [1]), whole on every rank (a row-parallel rank quantizes its slice of x by it, as vLLM's)."""
    register(layer, "input_scale", (1,), torch.float32, keep_dtype=True)
    layer.input_scale.any_shape_of_one = True


def input_scale(layers: list[Layer]) -> torch.Tensor:
    """The static activation scale of sibling layers fused into one GEMM (one input, one scale):
    the largest of theirs, as vLLM takes it (calibrated on one input, theirs are equal)."""
    return torch.stack([layer.input_scale.reshape(()).float() for layer in layers]).amax().reshape(1)


def row_scale(layer: Layer) -> torch.Tensor:
    """A `register_row_scaled` layer's scale as float32 [out], a tensor's one repeated on every row."""
    return layer.weight_scale.reshape(-1).float().expand(layer.weight.shape[0]).contiguous()


def replace(layer: Layer, **tensors: torch.Tensor) -> None:
    """Set the layer's parameters to `tensors` (the resident form), dropping the names it had."""
    for name in getattr(layer, "weight_names", []):
        if name not in tensors:
            delattr(layer, name)
    for name, tensor in tensors.items():
        param = nn.Parameter(tensor, requires_grad=False)
        param.keep_dtype = True  # type: ignore[attr-defined]
        setattr(layer, name, param)
    layer.weight_names = list(tensors)


def keeps_dtype(param: torch.Tensor) -> bool:
    """Whether the loader keeps this parameter's dtype (see `register`)."""
    return bool(getattr(param, "keep_dtype", False)) or param.dtype not in _STANDARD_FLOATS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, or oneDNN's matmul when the weight is packed (an mkldnn tensor, `DenseMethod.pack`),
    or float32 arithmetic over a 16-bit weight kept as the checkpoint stores it (`half_linear`)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if weight.dtype in HALF_FLOATS and x.dtype == torch.float32 and x.device.type == "cpu":
        return half_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def half_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ b) in float32 for a float16 / bfloat16 W: the C GEMV for a decode step's rows,
    else W upcast `PREFILL_TILE_ROWS` rows at a time (the values are W's: upcasting is exact)."""
    from mmserve.models.quantization import cpu_gemv

    out = cpu_gemv.half_gemv(x, weight, bias)
    if out is not None:
        return out
    return tiled_linear(x, bias, weight.shape[0], lambda start, stop: weight[start:stop].float())


def tiled_linear(x: torch.Tensor, bias: torch.Tensor | None, rows: int,
                 weight_rows: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """x @ W^T (+ b) with W [rows, in] dequantized `PREFILL_TILE_ROWS` output rows at a time
    (`weight_rows(start, stop)`, float32): a prefill's matmul without a whole float copy of W."""
    out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
    for start in range(0, rows, PREFILL_TILE_ROWS):
        stop = min(rows, start + PREFILL_TILE_ROWS)
        out[..., start:stop] = _tile_linear(x, weight_rows(start, stop).to(x.dtype))
    return out if bias is None else out + bias


def _tile_linear(x: torch.Tensor, tile: torch.Tensor) -> torch.Tensor:
    """x @ tile^T: on the CPU in float32 by oneDNN over the tile packed for it (the packing costs a
    copy; oneDNN's matmul measured 2x MKL's there), else `F.linear`."""
    if tile.device.type == "cpu" and tile.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(tile, None)
        rows = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, None, "none", [], "")
        return rows.reshape(*x.shape[:-1], tile.shape[0])
    return F.linear(x, tile)


class LinearMethod:
    """How a linear layer holds its weight and multiplies by it (see the module docstring)."""

    name = "base"
    attrs: tuple[str, ...] = ()  # plain attributes of a layer its method reads (carried into a fused layer)

    def create_weights(self, layer: Layer, shape: LinearShape) -> None:
        raise NotImplementedError

    def process_weights(self, layer: Layer) -> None:
        """Turn the loaded checkpoint tensors into the resident form (default: kept as loaded)."""

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, layer: Layer) -> torch.Tensor:
        raise NotImplementedError

    def concat(self, layers: list[Layer]) -> dict[str, torch.Tensor] | None:
        return None

    def pack(self, layer: Layer) -> bool:
        """Repack the resident weight for this device's fastest matmul; True when it did."""
        return False

    def cpu_gemv(self, layer: Layer) -> CpuGemv | None:
        return None


class DenseMethod(LinearMethod):
    """The weight as the checkpoint stores it: `weight` [out, in] in the model's dtype."""

    name = "dense"

    def create_weights(self, layer: Layer, shape: LinearShape) -> None:
        register(layer, "weight", (shape.out_features, shape.in_features), torch.float32, shape.shard)

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias)

    def dequantize(self, layer: Layer) -> torch.Tensor:
        weight = layer.weight
        return weight.to_dense() if weight.is_mkldnn else weight

    def concat(self, layers: list[Layer]) -> dict[str, torch.Tensor] | None:
        if any(layer.weight.is_mkldnn for layer in layers):
            return None
        return {"weight": torch.cat([layer.weight.detach() for layer in layers])}

    def cpu_gemv(self, layer: Layer) -> CpuGemv | None:
        """A 16-bit weight kept as stored: `half_gemv`'s call (a float32 one goes through oneDNN)."""
        from mmserve.models.quantization import cpu_gemv

        weight = layer.weight
        return None if weight.is_mkldnn or weight.dtype not in HALF_FLOATS else cpu_gemv.half_call(weight)

    def pack(self, layer: Layer) -> bool:
        """The layer's weight packed for oneDNN (`onednn_packed`)."""
        packed = onednn_packed(layer.weight)
        if packed is None:
            return False
        layer.weight = packed
        return True


def onednn_packed(weight: torch.Tensor) -> nn.Parameter | None:
    """oneDNN's packed copy of a float32 CPU weight [out, in], which `linear` multiplies by, or
    None where it does not apply: `F.linear` (MKL's sgemm) is several times slower on a decode
    step's skinny matmuls, and slower on prefill's too, where it was measured
    (`benchmarks/decode_step.py`)."""
    if (not torch.backends.mkldnn.is_available() or weight.device.type != "cpu"
            or weight.dtype != torch.float32 or weight.is_mkldnn or weight.numel() == 0):
        return None
    return nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None), requires_grad=False)


DENSE = DenseMethod()
