"""8-bit integer weights with a scale and zero point per group of input columns: GPTQ's 8-bit form
(AutoGPTQ's packing; Qwen's `Qwen2-VL-*-Instruct-GPTQ-Int8`) and compressed-tensors' W8A16
(llm-compressor's "W8A16" preset; RedHatAI's `*-quantized.w8a16`).

Resident form (what the kernels read), for this rank's W [out, in] in groups of `group` columns:
- `qweight` uint8 [out, in]: the codes 0..255, rows contiguous;
- `scales` float32 [out, in / group], `zeros` int16 [out, in / group] (GPTQ's zeros, 1..256);
- W[o, i] = (q[o, i] - zeros[o, i // group]) * scales[o, i // group];
- act-order: the columns sorted by group, and `perm` (groups.py).

GPTQ 8-bit as published (AutoGPTQ `QuantLinear.pack` with `bits` 8, GPTQModel's `checkpoint_format:
"gptq"`; vLLM `quantization/gptq.py`): `qweight` int32 [in / 4, out], four input rows to a word
(byte k of word r in column o holds q[4r + k, o]), `qzeros` int32 [in / group, out / 4] (byte k of
word c holds zero[g, 4c + k] - 1: zeros stored less one, as at 4 bits), `scales` fp16 [in / group,
out], `g_idx` int32 [in]; W^T[i, o] = (q[i, o] - (qzero[g_idx[i], o] + 1)) * scale[g_idx[i], o].

W8A16 as published (compressed-tensors `pack_quantized.py`: `pack_to_int32` with 8 bits): as
int4.py's W4A16 with four codes to a word: `weight_packed` int32 [out, in / 4], byte k of word j =
q[o, 4j + k] + 128 (signed codes offset to unsigned: the resident code as it is); `weight_scale`
[out, in / group] (one column for `channel`); asymmetric: `weight_zero_point` int32 [out / 4, in /
group], packed along rows the same way; symmetric: zero point 0, i.e. code 128; `weight_g_idx` with
`actorder: "group"`. W = (q - zp) * scale.

Kernels: Triton's GEMV and GEMM on a GPU (triton_kernels.py: `int8_linear`, W dequantized in
registers as int4's is). On the CPU, the C GEMV for up to `cpu_gemv.INT8_GEMV_MAX_ROWS` rows of x
(csrc/quant_gemv.c: `mmserve_int8_gemv_f32`, dequantized in registers, AVX2 or plain C), past
that W dequantized `PREFILL_TILE_ROWS` rows at a time by C and multiplied in float32.
"""

from __future__ import annotations

import torch

from mmserve.models.quantization import cpu_gemv
from mmserve.models.quantization.base import Layer, LinearMethod, LinearShape, replace, tiled_linear
from mmserve.models.quantization.groups import gathered, group_order, register_gptq, register_packed, stack, unsorted

_BYTE_SHIFTS = torch.arange(0, 32, 8, dtype=torch.int32)


def unpack_bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., 4n]: byte k of word j becomes element 4j + k."""
    codes = (words[..., None] >> _BYTE_SHIFTS.to(words.device)) & 0xFF
    return codes.reshape(*words.shape[:-1], -1).to(torch.uint8)


def dequantize_rows(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                    start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows [start, stop) of the resident form's W (in its column order), float32 [rows, in]."""
    codes = qweight[start:stop].to(torch.int16)
    z = zeros[start:stop].repeat_interleave(group, dim=1)
    s = scales[start:stop].repeat_interleave(group, dim=1)
    return (codes - z).float() * s


class Int8Method(LinearMethod):
    """8-bit weights in one resident form, from `format` "gptq" (AutoGPTQ's packing) or "w8a16"
    (compressed-tensors' pack-quantized); `group` 0 means one group per row."""

    attrs = ("int8_group",)

    def __init__(self, group: int, format: str = "gptq", symmetric: bool = True, act_order: bool = False) -> None:
        self.group, self.format, self.symmetric, self.act_order = group, format, symmetric, act_order
        self.name = "gptq-int8" if format == "gptq" else format

    def create_weights(self, layer: Layer, shape: LinearShape) -> None:
        out, inp = shape.out_features, shape.in_features
        group = self.group or inp
        if inp % group or group % 4 or out % 4:
            raise ValueError(f"int8 weights of {out}x{inp} on this rank do not fit groups of {group} "
                             "(the rank's input columns must be a multiple of the group, and rows of 4)")
        layer.int8_group = group
        if self.format == "gptq":
            register_gptq(layer, shape, group, 4, whole_rows=self.group == 0)
        else:
            register_packed(layer, shape, group, 4, self.group == 0, self.symmetric, self.act_order)

    def process_weights(self, layer: Layer) -> None:
        if self.format == "gptq":
            codes = unpack_bytes(layer.qweight.t().contiguous())  # [out, in]
            zeros = (unpack_bytes(layer.qzeros).to(torch.int16) + 1).t().contiguous()  # AutoGPTQ stores zero - 1
            scales, g_idx = layer.scales.t().contiguous(), layer.g_idx
        else:
            codes, scales = unpack_bytes(layer.weight_packed.contiguous()), layer.weight_scale.contiguous()
            if self.symmetric:
                zeros = torch.full(scales.shape, 128, dtype=torch.int16, device=scales.device)
            else:  # packed along rows: unpack the transpose
                packed = layer.weight_zero_point.t().contiguous()
                zeros = unpack_bytes(packed).t()[:scales.shape[0]].to(torch.int16).contiguous()
            g_idx = getattr(layer, "weight_g_idx", None)
        perm = None if g_idx is None else group_order(g_idx, layer.int8_group, scales.shape[1])
        if perm is None:
            replace(layer, qweight=codes, scales=scales, zeros=zeros)
        else:
            replace(layer, qweight=codes[:, perm].contiguous(), scales=scales, zeros=zeros, perm=perm)

    def dequantize(self, layer: Layer) -> torch.Tensor:
        w = dequantize_rows(layer.qweight, layer.scales, layer.zeros, layer.int8_group)
        return unsorted(w, getattr(layer, "perm", None))

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = gathered(x, layer)
        if x.is_cuda:
            from mmserve.models.quantization.triton_kernels import int8_linear

            return int8_linear(x, layer.qweight, layer.scales, layer.zeros, layer.int8_group, bias)
        args = (layer.qweight, layer.scales, layer.zeros, layer.int8_group)
        out = cpu_gemv.int8_gemv(x, *args, bias)
        if out is not None:
            return out
        return tiled_linear(x, bias, layer.qweight.shape[0], lambda start, stop: _rows(*args, start, stop))

    def cpu_gemv(self, layer: Layer) -> cpu_gemv.CpuGemv | None:
        if getattr(layer, "perm", None) is not None:  # the C call would skip the gather of x's columns
            return None
        return cpu_gemv.int8_call(layer.qweight, layer.scales, layer.zeros, layer.int8_group)

    def concat(self, layers: list[Layer]) -> dict[str, torch.Tensor] | None:
        return stack(layers, ("qweight", "scales", "zeros"))


def _rows(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, start: int,
          stop: int) -> torch.Tensor:
    """Rows [start, stop) of the resident form's W, float32: by the C kernel where it runs."""
    rows = cpu_gemv.int8_rows(codes, scales, zeros, group, start, stop)
    return dequantize_rows(codes, scales, zeros, group, start, stop) if rows is None else rows
