"""Quantized copies of checkpoints in the published layouts, and their dequantized twins.

Written from the formats' own code, not from mmserve's: AWQ as AutoAWQ's
`WQLinear_GEMM.from_linear` packs (`awq/modules/linear/gemm.py`), GPTQ as AutoGPTQ's
`QuantLinear.pack` (`auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py`: rows packed into words,
zeros stored less one, `g_idx`), W4A16 and W8A16 as compressed-tensors'
`pack_to_int32` (`compressors/quantized_compressors/pack_quantized.py`), W8A8 as its int-quantized
format stores it (int8 `weight`, `weight_scale` [out, 1] or [1]), FP8 block-wise as
transformers' fine-grained FP8 stores it (`weight_scale_inv`, one per block; compressed-tensors'
FP8_BLOCK: `weight_scale`), FP8 per channel as
compressed-tensors' float-quantized format (`weight_scale` [out, 1]), and with static activation
scales (`input_scale` per layer) as llm-compressor's FP8 and W8A8 presets and NVIDIA ModelOpt's FP8
export store them (ModelOpt's in `hf_quant_config.json`). `quantize_copy` writes the
quantized checkpoint and a plain float32 one holding exactly the weights it stands for, which
transformers runs as the reference; `quantize_checkpoint` writes the quantized one alone, from a
sharded checkpoint too, quantizing on any device (the GPU benchmark's 7B copies, on the GPU).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DECODER_LINEAR = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
VISION = ("visual", "vision_tower", "multi_modal_projector")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map
FP8_MAX = 448.0
INDEX = "model.safetensors.index.json"
FORMATS = ("awq", "gptq", "gptq-asym", "gptq-act-order", "gptq-int8", "w4a16", "w4a16-asym", "w4a16-act-order",
           "w8a16", "w8a16-asym", "w8a8", "w8a8-tensor", "w8a8-static", "fp8-block", "fp8-block-ct", "fp8-channel",
           "fp8-static", "modelopt-fp8", "modelopt-fp8-pc")
W8A8 = ("w8a8", "w8a8-tensor", "w8a8-static")  # activations quantized too: see helpers/w8a8_reference.py
STATIC_INPUT = ("w8a8-static", "fp8-static", "modelopt-fp8")  # an `input_scale` per layer
# the largest activation each projection's static scale covers (the tiny models' inputs reach ~4
# before q/k/v and gate/up, ~5-9 before o_proj, ~15-46 before down_proj: the last clamp a little),
# and each sibling's share of it: fused, q/k/v and gate/up take the largest of theirs, 1.0
INPUT_PEAK = {"q_proj": 4.0, "k_proj": 4.0, "v_proj": 4.0, "o_proj": 6.0, "gate_proj": 4.0, "up_proj": 4.0,
              "down_proj": 32.0}
SIBLING_SHARE = {"q_proj": 0.8, "k_proj": 0.9, "gate_proj": 0.9}


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [rows, cols] (0..15) -> int32 [rows, cols / 8] as AutoAWQ packs columns: nibble i of
    word c holds column 8c + AWQ_ORDER[i] (its loop, `qweight[:, c] |= col << 4i`, as one sum of
    disjoint bit fields, on the codes' device)."""
    words = codes.reshape(codes.shape[0], -1, 8)[..., AWQ_ORDER].to(torch.int64)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    return _to_int32((words << shifts).sum(-1))


def gptq_pack(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int [rows, cols] (0..2^bits - 1) -> int32 [rows / (32 / bits), cols] as AutoGPTQ's `pack`
    fills `qweight`: word r of each column ORs row (32 / bits) r + j shifted by bits * j (its
    `qweight[row] |= intweight[j] << (self.bits * (j - i))`)."""
    per_word = 32 // bits
    words = torch.zeros(values.shape[0] // per_word, values.shape[1], dtype=torch.int64, device=values.device)
    for j in range(per_word):
        words |= values[j::per_word].to(torch.int64) << (bits * j)
    return _to_int32(words)


def gptq_pack_columns(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int [rows, cols] (0..2^bits - 1) -> int32 [rows, cols / (32 / bits)] as AutoGPTQ's `pack`
    fills `qzeros`: word c of each row ORs column (32 / bits) c + j shifted by bits * j."""
    return gptq_pack(values.t().contiguous(), bits).t().contiguous()


def ct_pack(signed: torch.Tensor, packed_dim: int = 1, bits: int = 4) -> torch.Tensor:
    """int values -2^(bits-1)..2^(bits-1)-1 -> int32 as compressed-tensors' `pack_to_int32` (offset
    2^(bits-1), 32 / bits values to a word, along `packed_dim`)."""
    value = (signed.to(torch.int64) + (1 << (bits - 1)))
    per_word = 32 // bits
    if packed_dim == 0:
        value = value.t()
    packed = torch.zeros(value.shape[0], -(-value.shape[1] // per_word), dtype=torch.int64, device=value.device)
    for i in range(per_word):
        part = value[:, i::per_word]
        packed[:, :part.shape[1]] |= part << (bits * i)
    packed = _to_int32(packed)
    return packed.t().contiguous() if packed_dim == 0 else packed


def _awq(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, inp = w.shape
    g = w.reshape(out, inp // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()  # [out, G]
    zeros = (-lo / scales.float()).round().clamp(0, 15)
    codes = (g / scales.float()[..., None] + zeros[..., None]).round().clamp(0, 15).reshape(out, inp)
    deq = ((codes.reshape(out, -1, group) - zeros[..., None]) * scales.float()[..., None]).reshape(out, inp)
    tensors = {"qweight": awq_pack(codes.t().contiguous()), "qzeros": awq_pack(zeros.t().contiguous()),
               "scales": scales.t().contiguous()}
    return tensors, deq


def _gptq(w: torch.Tensor, group: int, symmetric: bool, act_order: bool = False,
          bits: int = 4) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AutoGPTQ's quantizer grid (`quantization/quantizer.py`, maxq = 2^bits - 1: symmetric about
    zero code (maxq + 1) / 2, else zero = round(-min / scale)) with round-to-nearest codes, packed
    by `pack`. Asymmetric zeros are kept >= 1: AutoGPTQ's stored `zero - 1` of a zero code 0 wraps.
    `act_order` (desc_act: true): groups in `quantization_order`, scattered by `g_idx`."""
    out, inp = w.shape
    maxq = 2**bits - 1
    order = quantization_order(inp, act_order, w.device)
    g = w[:, order].reshape(out, inp // group, group)  # each group's columns together
    if symmetric:
        scale = (g.abs().amax(-1) * 2 / maxq).clamp(min=1e-5).half()
        zeros = torch.full(scale.shape, (maxq + 1) / 2, device=w.device)
    else:
        lo, hi = g.amin(-1).clamp(max=-1e-3), g.amax(-1)
        scale = ((hi - lo).clamp(min=1e-5) / maxq).half()
        zeros = (-lo / scale.float()).round().clamp(1, maxq)
    codes = (g / scale.float()[..., None] + zeros[..., None]).round().clamp(0, maxq)
    back = torch.argsort(order)  # column i of W is column back[i] of the grouped order
    deq = ((codes - zeros[..., None]) * scale.float()[..., None]).reshape(out, inp)[:, back]
    tensors = {"qweight": gptq_pack(codes.reshape(out, inp)[:, back].t(), bits),
               "qzeros": gptq_pack_columns(zeros.t() - 1, bits), "scales": scale.t().contiguous(),
               "g_idx": _g_idx(back, group)}
    return tensors, deq


def quantization_order(inp: int, act_order: bool, device: torch.device) -> torch.Tensor:
    """The order GPTQ quantizes W's input columns in, group after group of `group_size` columns:
    their own, or with act-order that of its Hessian's diagonal. Here a permutation drawn from
    the input width: one input, one Hessian, so a layer's Q/K/V (or gate/up) share it, as in a
    real checkpoint."""
    if not act_order:
        return torch.arange(inp, device=device)
    return torch.randperm(inp, generator=torch.Generator().manual_seed(inp)).to(device)


def _g_idx(back: torch.Tensor, group: int) -> torch.Tensor:
    """Each input column's group, for columns quantized in the order whose inverse is `back`."""
    return (torch.arange(back.shape[0], device=back.device) // group)[back].to(torch.int32)


def _packed(w: torch.Tensor, group: int, symmetric: bool, act_order: bool = False,
            bits: int = 4) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' W4A16 / W8A16 (`bits`) as llm-compressor's GPTQ writes it, on
    `calculate_qparams`' grid (symmetric: max|w| over half the range; else zero points in range);
    `act_order`: its actorder "group", groups in `quantization_order` with `weight_g_idx`."""
    out, inp = w.shape
    lo_code, hi_code = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    order = quantization_order(inp, act_order, w.device)
    back = torch.argsort(order)
    g = w[:, order].reshape(out, inp // group, group)
    if symmetric:
        scale = (g.abs().amax(-1) / ((hi_code - lo_code) / 2)).clamp(min=1e-5).bfloat16()
        zp = torch.zeros_like(scale, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo).clamp(min=1e-5) / (hi_code - lo_code)).bfloat16()
        zp = (lo_code - lo / scale.float()).round().clamp(lo_code, hi_code).to(torch.int64)
    q = (g / scale.float()[..., None] + zp[..., None]).round().clamp(lo_code, hi_code)
    deq = ((q - zp[..., None]) * scale.float()[..., None]).reshape(out, inp)[:, back]
    tensors = {"weight_packed": ct_pack(q.reshape(out, inp)[:, back], bits=bits), "weight_scale": scale,
               "weight_shape": torch.tensor([out, inp])}
    if not symmetric:
        tensors["weight_zero_point"] = ct_pack(zp, packed_dim=0, bits=bits)
    if act_order:
        tensors["weight_g_idx"] = _g_idx(back, group)
    return tensors, deq


def _w8a8(w: torch.Tensor, per_tensor: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' int-quantized W8A8 weights: symmetric int8 codes on `calculate_qparams`'
    grid (max|w| / 127.5) per output row, or one for the tensor; the scale stored bfloat16, as
    llm-compressor stores it in the model's dtype."""
    peak = w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)
    scale = (peak / 127.5).clamp(min=1e-5).bfloat16()
    q = (w / scale.float()).round().clamp(-128, 127)
    return {"weight": q.to(torch.int8), "weight_scale": scale.reshape(1) if per_tensor else scale}, q * scale.float()


def effective_input_scale(fmt: str, module: str) -> float:
    """The static activation scale a decoder projection (`module`: its name) runs with: its input's
    peak over int8's 127 or e4m3's 448 (the largest of its fused siblings')."""
    return INPUT_PEAK[module.rsplit(".", 1)[-1]] / (127.0 if fmt == "w8a8-static" else FP8_MAX)


def _static_scales(fmt: str, prefix: str) -> dict[str, torch.Tensor]:
    """The `input_scale` a static format stores for the projection `prefix`, as each publisher
    stores it: compressed-tensors [1] in the model's dtype (bfloat16), ModelOpt a float32 scalar;
    and a k_proj's KV-cache scales, which the engine reads past (FP8 KV caches: not here)."""
    part = prefix.rsplit(".", 1)[-1]
    value = effective_input_scale(fmt, prefix) * SIBLING_SHARE.get(part, 1.0)
    scales = {"input_scale": torch.tensor([value], dtype=torch.float32)}
    if fmt == "fp8-static":
        scales = {"input_scale": scales["input_scale"].bfloat16()}
    elif fmt == "modelopt-fp8":
        scales = {"input_scale": scales["input_scale"].reshape(())}
    if part == "k_proj" and fmt != "w8a8-static":
        kv = torch.tensor(0.01) if fmt == "modelopt-fp8" else torch.tensor([0.01])
        scales |= {"k_scale": kv, "v_scale": kv.clone()}
    return scales


def _fp8_tensor(w: torch.Tensor, scalar: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """FP8 with one scale for the tensor (largest magnitude at 448): [] float32 as ModelOpt stores
    it (`scalar`), or compressed-tensors' [1]."""
    scale = (w.abs().amax() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.reshape(() if scalar else (1,))}, q.float() * scale


def _fp8_block(w: torch.Tensor, block: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, inp = w.shape
    rows, cols = -(-out // block), -(-inp // block)
    padded = torch.zeros(rows * block, cols * block, device=w.device)
    padded[:out, :inp] = w
    tiles = padded.reshape(rows, block, cols, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-8)  # [rows, cols]
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out, :inp]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * full


def fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8: (codes, scale [out]) with each row's largest magnitude at 448."""
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _fp8_channel(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, scale = fp8_rows(w)
    return {"weight": q, "weight_scale": scale[:, None]}, q.float() * scale[:, None]


def quantization_config(fmt: str, group: int, block: int, tower: bool = False) -> dict[str, Any]:
    """`config.json`'s `quantization_config` as each publisher writes it (`tower`: its skip list
    leaves the vision tower and projector in, as a checkpoint quantized whole has it)."""
    vision = [] if tower else list(VISION)
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": vision}
    if fmt.startswith("gptq"):  # as Qwen's Qwen2-VL-*-Instruct-GPTQ-Int4 / -Int8 (no module list)
        return {"quant_method": "gptq", "bits": 8 if fmt == "gptq-int8" else 4, "group_size": group,
                "desc_act": fmt == "gptq-act-order",
                "sym": fmt != "gptq-asym",
                "damp_percent": 0.01, "true_sequential": True, "static_groups": False}
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [block, block],
                "modules_to_not_convert": ["lm_head", *vision, "model.visual"] if vision else ["lm_head"]}
    if fmt == "modelopt-fp8":  # hf_quant_config.json's "quantization" (quantize_checkpoint writes it there)
        return {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                "exclude_modules": ["lm_head", *(f"*{name}*" for name in vision)]}
    if fmt == "modelopt-fp8-pc":  # config.json's own form of ModelOpt's config
        return {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN",
                "ignore": ["lm_head", *(f"*{name}*" for name in vision)]}
    ignore = ["lm_head", *(f"re:.*{name}.*" for name in vision)]
    static = {"strategy": "tensor", "dynamic": False, "observer": "minmax"}
    kv_cache = None
    if fmt == "fp8-block-ct":  # llm-compressor's FP8_BLOCK preset
        weights = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [block, block],
                   "symmetric": True, "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": block, "symmetric": True,
                "dynamic": True}
        fmt_name = "float-quantized"
    elif fmt in ("fp8-channel", "fp8-static"):
        weights = {"num_bits": 8, "type": "float", "strategy": "channel" if fmt == "fp8-channel" else "tensor",
                   "symmetric": True, "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
        if fmt == "fp8-static":  # llm-compressor's FP8 preset, with an FP8 KV cache's scales
            acts |= static
            kv_cache = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
        fmt_name = "float-quantized"
    elif fmt in W8A8:  # llm-compressor's W8A8 preset (static: older neuralmagic exports)
        weights = {"num_bits": 8, "type": "int", "strategy": "tensor" if fmt == "w8a8-tensor" else "channel",
                   "symmetric": True, "dynamic": False, "group_size": None, "actorder": None}
        acts = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
        if fmt == "w8a8-static":
            acts |= static
        fmt_name = "int-quantized"
    else:
        by_channel = fmt == "w8a16-asym"  # llm-compressor's W8A16 preset is per channel
        weights = {"num_bits": 8 if fmt.startswith("w8a16") else 4, "type": "int",
                   "strategy": "channel" if by_channel else "group", "group_size": None if by_channel else group,
                   "symmetric": not fmt.endswith("-asym"), "dynamic": False,
                   "actorder": "group" if fmt == "w4a16-act-order" else None}
        acts, fmt_name = None, "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt_name, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": ignore, "kv_cache_scheme": kv_cache}


def w4a16_config(actorder: str | None) -> dict[str, Any]:
    """compressed-tensors' W4A16 `quantization_config` with its weights' `actorder` set."""
    config = quantization_config("w4a16", 128, 128)
    config["config_groups"]["group_0"]["weights"]["actorder"] = actorder
    return config


def quantize_tensor(fmt: str, w: torch.Tensor, group: int, block: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One weight [out, in] in `fmt`: (the checkpoint tensors by suffix, the float W they stand for)."""
    if fmt == "awq":
        return _awq(w, group)
    if fmt.startswith("gptq"):
        return _gptq(w, group, symmetric=fmt != "gptq-asym", act_order=fmt == "gptq-act-order",
                     bits=8 if fmt == "gptq-int8" else 4)
    if fmt in ("w4a16", "w4a16-asym", "w4a16-act-order"):
        return _packed(w, group, symmetric=fmt != "w4a16-asym", act_order=fmt == "w4a16-act-order")
    if fmt == "w8a16":
        return _packed(w, group, symmetric=True, bits=8)
    if fmt == "w8a16-asym":  # per channel: one group per row
        return _packed(w, w.shape[1], symmetric=False, bits=8)
    if fmt in W8A8:
        return _w8a8(w, per_tensor=fmt == "w8a8-tensor")
    if fmt == "fp8-block":
        return _fp8_block(w, block)
    if fmt == "fp8-block-ct":  # the same values, under compressed-tensors' name
        stored, deq = _fp8_block(w, block)
        return {"weight": stored["weight"], "weight_scale": stored["weight_scale_inv"]}, deq
    if fmt in ("fp8-static", "modelopt-fp8"):
        return _fp8_tensor(w, scalar=fmt == "modelopt-fp8")
    stored, deq = _fp8_channel(w)
    if fmt == "modelopt-fp8-pc":  # ModelOpt stores the row scales flat: [out]
        stored["weight_scale"] = stored["weight_scale"][:, 0].contiguous()
    return stored, deq


def _quantized(name: str, w: torch.Tensor, tower: bool) -> bool:
    """Whether `quantize_copy` quantizes the checkpoint tensor `name`: a decoder projection, and
    with `tower` every linear weight of the vision tower and projector too (convolutions aside)."""
    if any(v in name for v in VISION):
        return tower and name.endswith(".weight") and w.dim() == 2 and "embed" not in name
    return DECODER_LINEAR.search(name) is not None


@dataclass(frozen=True)
class Recipe:
    """How `quantize_checkpoint` writes a checkpoint: the format, its int4 group and FP8 block
    sizes, whether the vision tower and projector are quantized too (`tower`), and the dtype the
    float tensors it leaves unquantized are stored in (None: as the source stores them)."""

    fmt: str
    group: int = 32
    block: int = 32
    tower: bool = False
    unquantized: torch.dtype | None = None


def quantize_entry(name: str, w: torch.Tensor, recipe: Recipe) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One checkpoint tensor under `recipe`: (the tensors written in its place, by name; the tensor
    the float twin holds in its place: the float32 W a quantized weight stands for, else its value)."""
    if _quantized(name, w, recipe.tower):
        stored, deq = quantize_tensor(recipe.fmt, w.float(), recipe.group, recipe.block)
        prefix = name.removesuffix(".weight")
        if recipe.fmt in STATIC_INPUT:
            stored |= {key: t.to(w.device) for key, t in _static_scales(recipe.fmt, prefix).items()}
        tensors = {f"{prefix}.{suffix}": t for suffix, t in stored.items()}
        if recipe.fmt == "fp8-static":  # compressed-tensors keeps the KV-cache scales on the attention
            tensors = {key.replace("k_proj.k_scale", "k_scale").replace("k_proj.v_scale", "v_scale"): t
                       for key, t in tensors.items()}
        return tensors, deq.contiguous()
    if recipe.unquantized is not None and w.is_floating_point():
        kept = w.to(recipe.unquantized)
        return {name: kept}, kept.float()
    return {name: w}, w


def weight_files(model_dir: Path) -> list[str]:
    """The checkpoint's safetensors files: its index's, or the one `model.safetensors`."""
    index = model_dir / INDEX
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def quantize_checkpoint(src: str, dst: Path, recipe: Recipe, twin: Path | None = None,
                        device: torch.device | str = "cpu") -> None:
    """`dst`: the checkpoint `src` (one file, or shards with their index) with its tensors as
    `quantize_entry` writes them, file by file under the source's file names (and a new index),
    its other files copied and `config.json` given the `quantization_config`; `twin`: the same
    with the float tensors each stands for. Tensors are read one at a time onto `device` and
    quantized there (a 7B's on a GPU in seconds)."""
    folders = [dst] if twin is None else [dst, twin]
    for folder in folders:
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors", INDEX))
    maps: list[dict[str, str]] = [{} for _ in folders]
    totals = [0 for _ in folders]
    for file in weight_files(Path(src)):
        written: list[dict[str, torch.Tensor]] = [{} for _ in folders]
        with safe_open(str(Path(src) / file), framework="pt") as f:
            for name in f.keys():
                stored, plain = quantize_entry(name, f.get_tensor(name).to(device), recipe)
                written[0].update({key: t.cpu() for key, t in stored.items()})
                if twin is not None:
                    written[1][name] = plain.cpu()
        for folder, tensors, names in zip(folders, written, maps):
            save_file(tensors, str(folder / file), metadata={"format": "pt"})
            names.update(dict.fromkeys(tensors, file))
        totals = [total + sum(t.nbytes for t in tensors.values()) for total, tensors in zip(totals, written)]
    if (Path(src) / INDEX).exists():
        for folder, names, total in zip(folders, maps, totals):
            (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": names}))
    quant = quantization_config(recipe.fmt, recipe.group, recipe.block, recipe.tower)
    if recipe.fmt == "modelopt-fp8":  # ModelOpt's export: its own file, config.json untouched
        exported = {"producer": {"name": "modelopt", "version": "0.33.0"}, "quantization": quant}
        (dst / "hf_quant_config.json").write_text(json.dumps(exported))
        return
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config))


def quantize_copy(src: str, dst: Path, fmt: str, group: int = 32, block: int = 32, tower: bool = False,
                  unquantized: torch.dtype | None = None) -> tuple[str, str]:
    """(the quantized checkpoint, its dequantized float32 twin) of the checkpoint `src`:
    every decoder projection quantized in `fmt`; the vision tower and projector left as they are,
    or with `tower` quantized too (and not in the skip list). With `unquantized` (e.g. float16, as
    Qwen's AWQ releases store them) every float tensor not quantized is stored in that dtype, the
    twin holding the same values in float32."""
    quant, plain = dst / f"{fmt}-q", dst / f"{fmt}-deq"
    quantize_checkpoint(src, quant, Recipe(fmt, group, block, tower, unquantized), twin=plain)
    return str(quant), str(plain)


def online_fp8_twin(src: str, dst: Path) -> str:
    """The float32 checkpoint `--quantization fp8` stands for: the rows of every linear weight, the
    vision tower's and projector's too, quantized to FP8 at 448 / max|row| and dequantized."""
    tensors = load_file(str(Path(src) / "model.safetensors"))
    for name, w in tensors.items():
        if _quantized(name, w, tower=True):
            q, scale = fp8_rows(w.float())
            tensors[name] = (q.float() * scale[:, None]).contiguous()
    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def checkpoint_bytes(path: str) -> int:
    """Bytes of every tensor a one-file checkpoint stores."""
    return sum(t.nbytes for t in load_file(str(Path(path) / "model.safetensors")).values())
