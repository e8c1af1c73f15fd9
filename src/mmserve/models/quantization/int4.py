"""4-bit integer weights with a scale and zero point per group of input columns: AWQ (AutoAWQ's
GEMM packing), GPTQ (AutoGPTQ's packing) and compressed-tensors' pack-quantized W4A16, all held
in one resident form.

Resident form (what the kernels read), for this rank's W [out, in] in groups of `group` columns:
- `qweight` int32 [out, in / 8]: nibble k (bits 4k..4k+3) of word j in row o is q[o, 8j + k],
  an unsigned code 0..15 (rows are contiguous: a decode GEMV reads each row once);
- `scales` float32 [out, in / group], `zeros` uint8 [out, in / group] (codes 0..15; GPTQ's 1..16);
- W[o, i] = (q[o, i] - zeros[o, i // group]) * scales[o, i // group].

AWQ as published (AutoAWQ `awq/modules/linear/gemm.py`, `WQLinear_GEMM.from_linear`; vLLM
`quantization/awq.py` and `awq_triton.py`): `qweight` int32 [in, out / 8], `qzeros` int32
[in / group, out / 8], `scales` fp16 [in / group, out]; W^T[i, o] = (q - z) * s. Eight output
columns share a word: nibble k of word c holds column 8c + ORDER[k], ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
(AutoAWQ's `order_map`), so column 8c + j is in nibble REVERSE[j] (vLLM's `AWQ_REVERSE_ORDER`).

GPTQ as published (AutoGPTQ `nn_modules/qlinear/__init__.py` `QuantLinear.pack`, GPTQModel's
`checkpoint_format: "gptq"`; vLLM `quantization/gptq.py`): `qweight` int32 [in / 8, out], eight
input rows to a word (nibble k of word r in column o holds q[8r + k, o]: the transpose of the
resident form's words), `qzeros` int32 [in / group, out / 8] (nibble k of word c holds
zero[g, 8c + k] - 1: AutoGPTQ stores zeros less one), `scales` fp16 [in / group, out], `g_idx`
int32 [in], each input row's group: i // group, or with act-order (`desc_act: true`) groups of
`group` rows scattered (groups.py); W^T[i, o] = (q[i, o] - (qzero[g_idx[i], o] + 1)) *
scale[g_idx[i], o]. An act-order layer's resident form holds its input columns sorted by group,
and `perm` int64 [in], which `apply` gathers x's columns by first.

W4A16 as published (compressed-tensors `compressors/quantized_compressors/pack_quantized.py`:
`pack_to_int32`, `unpack_from_int32`; `quantization/lifecycle/forward.py`: `dequantize`):
`weight_packed` int32 [out, ceil(in / 8)] with nibble k of word j = q[o, 8j + k] + 8 (signed
codes -8..7 offset to unsigned); `weight_scale` [out, in / group] (one column for the `channel`
strategy); asymmetric: `weight_zero_point` int32 [ceil(out / 8), in / group], packed along rows
the same way (nibble k of word r = zp[8r + k, g] + 8); symmetric: zero point 0, i.e. code 8;
`weight_shape` int [2] = (out, in). W = (q - zp) * scale. With `actorder: "group"`
(llm-compressor's GPTQ), `weight_g_idx` int32 [in]: each input column's group, as GPTQ's `g_idx`
with act-order, and sorted the same way.

Kernels: the C GEMV and row tiles on the CPU (cpu_gemv.py), Triton's GEMV and GEMM on a GPU
(triton_kernels.py), each proven equal to `dequantize_rows` then a matmul. With `--cpu-activation-quant
int8` the GEMV's rows (a decode step, a short prefill chunk) take q8_gemv.py's kernel instead: x
rounded to int8 per group, integer dot products over the same resident form; not exact (longer
steps' tiles stay exact).
"""

from __future__ import annotations

import torch

from mmserve.models.quantization import cpu_gemv, q8_gemv
from mmserve.models.quantization.base import Layer, LinearMethod, LinearShape, register, replace, tiled_linear
from mmserve.models.quantization.groups import (along, check_aligned, gathered, group_order, register_gptq,
                                                register_packed, stack, unsorted)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds column 8c + AWQ_ORDER[k]
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j lies in nibble AWQ_REVERSE[j]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., 8n]: nibble k of word j becomes element 8j + k."""
    nibbles = (words[..., None] >> _SHIFTS.to(words.device)) & 0xF
    return nibbles.reshape(*words.shape[:-1], -1).to(torch.uint8)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., 8n] -> int32 [..., n]: element 8j + k into nibble k of word j."""
    grouped = codes.reshape(*codes.shape[:-1], -1, 8).to(torch.int64) << _SHIFTS.to(codes.device, torch.int64)
    words = grouped.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize_rows(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                    start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows [start, stop) of the resident form's W, float32 [rows, in]."""
    codes = unpack_nibbles(qweight[start:stop]).to(torch.int16)  # [rows, in]
    z = zeros[start:stop].to(torch.int16).repeat_interleave(group, dim=1)
    s = scales[start:stop].repeat_interleave(group, dim=1)
    return (codes - z).float() * s


class Int4Method(LinearMethod):
    """One resident form and its kernels for the published int4 layouts (`format`: "awq", "gptq"
    or "w4a16"); `group` 0 means one group per row (compressed-tensors' channel strategy);
    `activations` "int8": the GEMV's rows on the CPU by the int8-activation one (`--cpu-activation-quant`)."""

    attrs = ("int4_group",)

    def __init__(self, format: str, group: int, symmetric: bool, activations: str = "none",
                 act_order: bool = False) -> None:
        self.format, self.group, self.symmetric, self.activations = format, group, symmetric, activations
        self.act_order = act_order  # w4a16: the checkpoint holds `weight_g_idx` (GPTQ's g_idx always)
        self.name = format

    def _group(self, shape: LinearShape) -> int:
        return self.group or shape.in_features

    def create_weights(self, layer: Layer, shape: LinearShape) -> None:
        out, inp, group = shape.out_features, shape.in_features, self._group(shape)
        if inp % group or group % 8 or out % 8:
            raise ValueError(f"int4 weights of {out}x{inp} on this rank do not fit groups of {group} "
                             "(the rank's input columns must be a multiple of the group, and rows of 8)")
        layer.int4_group = group
        {"awq": self._awq_weights, "gptq": self._gptq_weights, "w4a16": self._w4a16_weights}[self.format](
            layer, shape, group)

    def _awq_weights(self, layer: Layer, shape: LinearShape, group: int) -> None:
        out, inp, s = shape.out_features, shape.in_features, shape.shard
        by_out = s is not None and s.dim == 0  # AWQ's tensors are W^T: output columns on dim 1
        check_aligned(s, 8 if by_out else group)
        register(layer, "qweight", (inp, out // 8), torch.int32, along(s, 1, 8) if by_out else along(s, 0))
        per_group = None if self.group == 0 else along(s, 0, group)  # one group per row: whole on every rank
        register(layer, "qzeros", (inp // group, out // 8), torch.int32, along(s, 1, 8) if by_out else per_group)
        register(layer, "scales", (inp // group, out), torch.float32, along(s, 1) if by_out else per_group,
                 keep_dtype=True)

    def _gptq_weights(self, layer: Layer, shape: LinearShape, group: int) -> None:
        register_gptq(layer, shape, group, 8, whole_rows=self.group == 0)

    def _w4a16_weights(self, layer: Layer, shape: LinearShape, group: int) -> None:
        register_packed(layer, shape, group, 8, self.group == 0, self.symmetric, self.act_order)

    def process_weights(self, layer: Layer) -> None:
        if self.format == "awq":
            reverse = torch.tensor(AWQ_REVERSE, device=layer.qweight.device)
            codes = unpack_nibbles(layer.qweight)  # [in, out] in AWQ's nibble order
            codes = codes.view(codes.shape[0], -1, 8)[..., reverse].reshape(codes.shape[0], -1)
            zeros = unpack_nibbles(layer.qzeros)
            zeros = zeros.view(zeros.shape[0], -1, 8)[..., reverse].reshape(zeros.shape[0], -1)
            replace(layer, qweight=pack_nibbles(codes.t().contiguous()), scales=layer.scales.t().contiguous(),
                    zeros=zeros.t().contiguous())
            return
        if self.format == "gptq":
            zeros = unpack_nibbles(layer.qzeros) + 1  # [in / group, out]: AutoGPTQ stores zero - 1
            replace(layer, **_sorted_by_group({"qweight": layer.qweight.t().contiguous(),
                                               "scales": layer.scales.t().contiguous(),
                                               "zeros": zeros.t().contiguous()}, layer.g_idx, layer.int4_group))
            return
        scales = layer.weight_scale.contiguous()
        if self.symmetric:
            zeros = torch.full(scales.shape, 8, dtype=torch.uint8, device=scales.device)
        else:  # packed along rows: unpack the transpose
            zeros = unpack_nibbles(layer.weight_zero_point.t().contiguous()).t()[:scales.shape[0]].contiguous()
        resident = {"qweight": layer.weight_packed.contiguous(), "scales": scales, "zeros": zeros}
        if self.act_order:
            resident = _sorted_by_group(resident, layer.weight_g_idx, layer.int4_group)
        replace(layer, **resident)

    def dequantize(self, layer: Layer) -> torch.Tensor:
        return unsorted(dequantize_rows(*_resident(layer), layer.int4_group), getattr(layer, "perm", None))

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = gathered(x, layer)
        if x.is_cuda:
            from mmserve.models.quantization.triton_kernels import int4_linear

            return int4_linear(x, layer.qweight, layer.scales, layer.zeros, layer.int4_group, bias)
        args = (x, layer.qweight, layer.scales, layer.zeros, layer.int4_group, bias)
        interleaved = getattr(layer, "int4_interleaved", False)
        out = q8_gemv.int4_q8_gemv(*args) if interleaved else cpu_gemv.int4_gemv(*args)
        if out is not None:
            return out
        rows = layer.qweight.shape[0] * (q8_gemv.LANES if interleaved else 1)
        return tiled_linear(x, bias, rows, lambda a, b: _rows(layer, a, b))

    def cpu_gemv(self, layer: Layer) -> cpu_gemv.CpuGemv | None:
        if getattr(layer, "perm", None) is not None:  # the C call would skip the gather of x's columns
            return None
        args = (layer.qweight, layer.scales, layer.zeros, layer.int4_group)
        return q8_gemv.int4_q8_call(*args) if getattr(layer, "int4_interleaved", False) else cpu_gemv.int4_call(*args)

    def concat(self, layers: list[Layer]) -> dict[str, torch.Tensor] | None:
        if any(getattr(layer, "int4_interleaved", False) for layer in layers):
            return None
        return stack(layers, ("qweight", "scales", "zeros"))

    def pack(self, layer: Layer) -> bool:
        """With int8 activations, W's rows interleaved by 16 for the int8 kernel (q8_gemv.py), where
        it takes the weight; the same bytes."""
        if (self.activations != "int8" or getattr(layer, "int4_interleaved", False)
                or not q8_gemv.can_interleave(layer.qweight, layer.int4_group)):
            return False
        qweight, scales, zeros = q8_gemv.interleave(layer.qweight.data, layer.scales.data, layer.zeros.data)
        replace(layer, qweight=qweight, scales=scales, zeros=zeros)
        layer.int4_interleaved = True
        return True


def _resident(layer: Layer, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [start, stop) of the layer's resident tensors (qweight, scales, zeros), in the resident form."""
    if getattr(layer, "int4_interleaved", False):
        return q8_gemv.deinterleave(layer.qweight, layer.scales, layer.zeros, start, stop)
    return layer.qweight[start:stop], layer.scales[start:stop], layer.zeros[start:stop]


def _rows(layer: Layer, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the layer's W, float32: by the C kernel where it runs."""
    qweight, scales, zeros = (t.contiguous() for t in _resident(layer, start, stop))
    args = (qweight, scales, zeros, layer.int4_group, 0, stop - start)
    rows = cpu_gemv.int4_rows(*args)
    return dequantize_rows(*args) if rows is None else rows


def _sorted_by_group(resident: dict[str, torch.Tensor], g_idx: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """The resident tensors as they are where `g_idx` is in order; else (act-order) with qweight's
    input columns sorted by group, and `perm`, the order (groups.py)."""
    perm = group_order(g_idx, group, resident["scales"].shape[1])
    if perm is None:
        return resident
    return {**resident, "qweight": pack_nibbles(unpack_nibbles(resident["qweight"])[:, perm]), "perm": perm}
