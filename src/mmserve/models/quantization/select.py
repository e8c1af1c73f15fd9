"""Which method each linear layer of a model takes, from the checkpoint's quantization, and the
LM head a quantized checkpoint keeps at its 16-bit width on the CPU."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.quantization.base import HALF_FLOATS, LinearMethod
from mmserve.models.quantization.config import QuantSpec
from mmserve.models.quantization.fp8 import Fp8BlockMethod, Fp8RowMethod
from mmserve.models.quantization.int4 import Int4Method
from mmserve.models.quantization.int8 import Int8Method
from mmserve.models.quantization.w8a8 import W8A8Method


def make_method(spec: QuantSpec, activation_quant: str = "none") -> LinearMethod:
    """The one method instance every quantized layer of a checkpoint shares (`activation_quant`:
    `--cpu-activation-quant`, which int4 methods take)."""
    if spec.format == "gptq" and spec.bits == 8:
        return Int8Method(spec.group_size)
    if spec.format == "w8a16":
        return Int8Method(spec.group_size, "w8a16", spec.symmetric, spec.act_order)
    if spec.format == "w8a8":
        return W8A8Method(spec.per_tensor, spec.static_input)
    if spec.is_int4:
        return Int4Method(spec.format, spec.group_size, spec.symmetric, activation_quant, spec.act_order)
    if spec.format == "fp8_block":
        return Fp8BlockMethod(spec.block, spec.block_scale)
    if spec.format == "fp8_online":
        return Fp8RowMethod("online")
    return Fp8RowMethod("checkpoint", spec.per_tensor, spec.static_input)


def assign_methods(model: nn.Module, spec: QuantSpec | None, checkpoint_names: dict[str, str],
                   activation_quant: str = "none", stored: set[str] | None = None) -> int:
    """Give every linear layer `spec` covers its method (call on the meta device, before loading);
    `checkpoint_names` maps a module's name here to the checkpoint's (older layouts differ);
    `stored`: the checkpoint's quantized modules, where the spec is read from its tensors
    (`QuantSpec.by_tensors`). Returns the number of layers quantized."""
    from mmserve.models.parallel import ParallelLinear

    if spec is None:
        return 0
    method, count = make_method(spec, activation_quant), 0
    for name, module in model.named_modules():
        stored_name = checkpoint_names.get(name, name)
        if isinstance(module, ParallelLinear) and spec.quantizes(stored_name) and (
                stored is None or stored_name in stored):
            module.set_method(method)
            count += 1
    return count


def describe_quantization(model: nn.Module) -> str:
    """The methods of the model's linear layers and how many each holds, e.g. "awq x 21, dense x 30"."""
    from mmserve.models.parallel import ParallelLinear

    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, ParallelLinear):
            counts[module.method.name] = counts.get(module.method.name, 0) + 1
    return ", ".join(f"{name} x {n}" for name, n in sorted(counts.items())) or "no linear"


def keep_half_head(model: nn.Module, stored: torch.dtype | None) -> bool:
    """Hold the (meta) LM head in `stored`, the checkpoint's dtype, where that is float16 or
    bfloat16 (a quantized checkpoint on the CPU: its head is a large share of a decode step's
    bytes, and upcast to float32 it would double; `base.linear` multiplies it in float32, its
    values unchanged). True when it did."""
    head = getattr(model, "lm_head", None)
    if head is None or stored not in HALF_FLOATS or not head.weight.is_meta:
        return False
    weight = nn.Parameter(torch.empty(head.weight.shape, dtype=stored, device="meta"), requires_grad=False)
    weight.keep_dtype = True  # type: ignore[attr-defined]
    head.weight = weight
    return True
