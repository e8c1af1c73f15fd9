"""A decode step's decoder layers in one C call on the CPU (`csrc/decode_layers.c`), as a CUDA
graph replays a step's kernels on a GPU: the plan (every layer's weights, kernels, norms and cache
as addresses) is built once, and each plain decode step of at most `MAX_ROWS` tokens passes only
its own inputs (hidden states, cos / sin, slots, block tables, lengths). The calls are the ones
the Python forward makes through the torch backend's C paths, in its order and with its
arguments, so the result equals that forward's bit for bit; what goes is the interpreter and
PyTorch's dispatch between ~15 calls a layer, a quarter to a third of a quantized model's step.

A model gets a plan (`CpuDecoder.build`, by the runner once its KV cache is allocated; not with
`--enforce-eager`) where every decoder linear has a C GEMV (`LinearMethod.cpu_gemv`: int4 exact
or with int8 activations, int8 weights, FP8, 16-bit weights kept as stored; float32 weights go through oneDNN,
which C cannot call), Q/K/V and gate/up are fused, the model is float32 on one rank, and the layer
ops, their SiLU and the decode attention kernel are loaded. A step the plan does not cover
(prefill, a mixed step, Qwen3-VL's deepstack rows, more than `MAX_ROWS` tokens, or a kernel
refusing its shapes) runs in Python as before.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch
from mmserve.models import cpu_ops
from mmserve import native
from mmserve.models.attention import cpu_kernels
from mmserve.models.attention.torch_sdpa import AttentionMetadata
from mmserve.models.layers import Rope
from mmserve.models.quantization.cpu_gemv import CpuGemv, address

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_layers.c"
MAX_ROWS = cpu_ops.MAX_ROWS  # tokens up to which the layer ops are C in the Python forward too
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_CACHE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _I64), ("fn", _P), ("fallback", _P), ("weight", _P), ("scales", _P), ("zeros", _P),
                ("bias", _P), ("N", _I64), ("K", _I64), ("group", _I64), ("block_out", _I64), ("block_in", _I64),
                ("flag", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("qkv", _Linear),
                ("o", _Linear), ("gate_up", _Linear), ("down", _Linear), ("k_cache", _P), ("v_cache", _P)]


class _Decoder(ctypes.Structure):
    _fields_ = [*((name, _I64) for name in ("layers", "D", "H", "Hkv", "Dh", "I", "S", "cache_dtype", "lanes",
                                            "silu_lanes")),
                ("eps", _F), ("scale", _F), ("rms_norm", _P), ("qk_norm", _P), ("rotary", _P), ("silu_mul", _P),
                ("attend", _P), ("final_norm", _P), ("layer", ctypes.POINTER(_Layer))]


class _Step(ctypes.Structure):
    _fields_ = [("cos", _P), ("sin", _P), ("rope_stride", _I64), ("slots", _P), ("tables", _P), ("W", _I64),
                ("lens", _P), ("rows", _P), ("splits", _I64)]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot be had."""
    library = native.build(SOURCE)
    if library is None:
        return None
    library.mmserve_decode_layers.argtypes = [ctypes.POINTER(_Decoder), _P, _P, _I64, ctypes.POINTER(_Step),
                                              ctypes.c_int]
    library.mmserve_decode_layers.restype = ctypes.c_int
    library.mmserve_decode_struct_size.argtypes, library.mmserve_decode_struct_size.restype = [ctypes.c_int], _I64
    mirrors = (_Linear, _Layer, _Decoder, _Step)
    if any(library.mmserve_decode_struct_size(i) != ctypes.sizeof(s) for i, s in enumerate(mirrors)):
        logger.warning("the compiled CPU decode step's structs differ from their ctypes mirrors; decode steps run "
                       "layer by layer")
        return None
    return library


def _linear(layer: Any) -> tuple[_Linear, tuple[torch.Tensor, ...], int] | None:
    """A layer's GEMV as the C struct (the tensors it points into, the rows it takes), or None where
    it has none."""
    if layer is None or getattr(getattr(layer, "tp", None), "size", 1) != 1:
        return None
    call: CpuGemv | None = layer.method.cpu_gemv(layer)
    bias = layer.bias
    if call is None or (bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous())):
        return None
    fields = call._asdict()
    tensors: tuple[torch.Tensor, ...] = fields.pop("tensors")
    max_rows: int = fields.pop("max_rows")
    if bias is not None:
        tensors += (bias,)
    return _Linear(**fields, bias=None if bias is None else bias.data_ptr()), tensors, max_rows


def _f32(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


class CpuDecoder:
    """One text model's decode plan over its KV caches (see the module docstring)."""

    def __init__(self, plan: _Decoder, keep: list[object], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_rows: int = MAX_ROWS) -> None:
        self.plan, self.keep, self.kv_caches = plan, keep, kv_caches  # keep: what the plan's addresses point into
        self.max_rows = max_rows  # tokens up to which every linear's C call is the one the Python step makes
        self.steps = 0  # steps run by the plan (tests read it)

    @classmethod
    def build(cls, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> CpuDecoder | None:
        """The plan of a Llama or Qwen text model (`layers`, `norm`) over `kv_caches`, or None where
        the model is not one the plan covers (module docstring)."""
        kernels, attention = cpu_ops.load(), cpu_kernels.load()
        layers = list(getattr(model, "layers", ()))
        if (load() is None or kernels is None or kernels.silu_lanes is None or attention is None or not layers
                or len(kv_caches) != len(layers)):
            return None
        cache_dtype = _CACHE_DTYPES.get(kv_caches[0][0].dtype)
        entry = cpu_kernels.ENTRY_POINTS.get((torch.float32, kv_caches[0][0].dtype))
        if cache_dtype is None or entry is None or not _uniform(model, layers):
            return None
        keep: list[object] = [model.norm.weight]
        limits: list[int] = [MAX_ROWS]
        planned = [_layer_plan(layer, cache, keep, limits) for layer, cache in zip(layers, kv_caches)]
        rows = [row for row in planned if row is not None]
        if len(rows) != len(layers):
            return None
        array = (_Layer * len(rows))(*rows)
        keep.append(array)
        attn, library = layers[0].self_attn, kernels.library
        plan = _Decoder(layers=len(rows), D=model.norm.weight.shape[0], H=attn.num_heads, Hkv=attn.num_kv_heads,
                        Dh=attn.head_dim, I=layers[0].mlp.gate_proj.fused.sizes[0], S=kv_caches[0][0].shape[1],
                        cache_dtype=cache_dtype, lanes=kernels.lanes, silu_lanes=kernels.silu_lanes,
                        eps=model.norm.eps, scale=attn.scale, rms_norm=address(library, "mmserve_rms_norm_f32"),
                        qk_norm=address(library, "mmserve_qk_norm_f32"), rotary=address(library, "mmserve_rotary_f32"),
                        silu_mul=address(library, "mmserve_silu_mul_f32"), attend=address(attention, entry),
                        final_norm=model.norm.weight.data_ptr(), layer=array)
        logger.info("decode steps of up to %d tokens run the %d decoder layers in one C call (compiled CPU step)",
                    min(limits), len(rows))
        return cls(plan, keep, kv_caches, min(limits))

    def run(self, x: torch.Tensor, rope: Rope, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            meta: object) -> torch.Tensor | None:
        """The final-normed hidden states [T, D] of a plain decode step's inputs x [T, D] (float32)
        over the plan's `kv_caches`, or None where the plan does not cover the step (the caller
        runs it in Python)."""
        T = x.shape[0]
        if (kv_caches is not self.kv_caches or type(meta) is not AttentionMetadata or meta.prefills
                or meta.kernel_splits <= 0 or meta.decode_lens is None or not 0 < T <= self.max_rows
                or meta.decode_index.shape[0] != T or not _f32(x) or x.shape[1] != self.plan.D):
            return None
        cos, sin = rope
        Dh = self.plan.Dh
        if (cos.shape != (T, 1, Dh) or sin.shape != cos.shape or cos.dtype != torch.float32
                or sin.dtype != torch.float32 or cos.stride(-1) != 1 or sin.stride() != cos.stride()):
            return None
        tables = meta.decode_block_tables
        step = _Step(cos.data_ptr(), sin.data_ptr(), cos.stride(0), meta.slot_mapping.data_ptr(), tables.data_ptr(),
                     tables.shape[1], meta.decode_lens.data_ptr(), meta.decode_index.data_ptr(), meta.kernel_splits)
        out = torch.empty(T, self.plan.D, dtype=torch.float32, device="cpu")
        library = load()
        assert library is not None  # a plan exists only with it
        done = library.mmserve_decode_layers(ctypes.byref(self.plan), x.data_ptr(), out.data_ptr(), T,
                                             ctypes.byref(step), torch.get_num_threads())
        if done != 0:
            return None
        self.steps += 1
        return out


def _uniform(model: Any, layers: list[Any]) -> bool:
    """Whether the layers are what the plan's one set of sizes and eps describes: every norm float32
    with the final norm's eps, Q/K/V fused as H, Hkv, Hkv heads and gate/up as two equal halves
    (checked on the first layer: a model's layers are alike), widths the layer ops take."""
    norm, attn, mlp = model.norm, layers[0].self_attn, layers[0].mlp
    if not _f32(norm.weight) or any(n.eps != norm.eps for layer in layers for n in _norms(layer)):
        return False
    qkv, gate_up = attn.q_proj.fused, mlp.gate_proj.fused
    if qkv is None or gate_up is None:
        return False
    q_rows, kv_rows = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    return (qkv.sizes == [q_rows, kv_rows, kv_rows] and len(gate_up.sizes) == 2
            and gate_up.sizes[0] == gate_up.sizes[1] and norm.weight.shape[0] < cpu_ops.MAX_NORM_WIDTH
            and attn.head_dim % 2 == 0)


def _norms(layer: Any) -> list[Any]:
    attn = layer.self_attn
    return [n for n in (layer.input_layernorm, layer.post_attention_layernorm, getattr(attn, "q_norm", None),
                        getattr(attn, "k_norm", None)) if n is not None]


def _layer_plan(layer: Any, cache: tuple[torch.Tensor, torch.Tensor], keep: list[object],
                limits: list[int]) -> _Layer | None:
    """One decoder layer's struct (its tensors appended to `keep`, its linears' row limits to
    `limits`), or None where it is not covered."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = [_linear(attn.q_proj.fused), _linear(attn.o_proj), _linear(mlp.gate_proj.fused), _linear(mlp.down_proj)]
    norms = _norms(layer)
    for t in cache:
        if not (t.is_cpu and t.is_contiguous() and t.dtype == cache[0].dtype):
            return None
    if any(item is None for item in linears) or not all(_f32(n.weight) for n in norms):
        return None
    for item in linears:
        keep.append(item[1])  # type: ignore[index]
        limits.append(item[2])  # type: ignore[index]
    keep.extend(n.weight for n in norms)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    qkv, o, gate_up, down = (item[0] for item in linears)  # type: ignore[index]
    return _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                  None if q_norm is None else q_norm.weight.data_ptr(),
                  None if k_norm is None else k_norm.weight.data_ptr(), qkv, o, gate_up, down,
                  cache[0].data_ptr(), cache[1].data_ptr())
