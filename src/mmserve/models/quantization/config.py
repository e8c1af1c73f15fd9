"""A checkpoint's quantization, read from `config.json`'s `quantization_config` as published (or
`--quantization fp8`), and which of its linear layers it covers. No torch: P1 refuses an
unsupported checkpoint with this before any process loads weights.

Formats read (each key and its meaning as the named source writes or reads it):

- `quant_method: "awq"` (AutoAWQ `WQLinear_GEMM`; transformers' `AwqConfig`; vLLM `awq.py`):
  `bits: 4`, `group_size`, `zero_point: true`, `version: "gemm"`; `modules_to_not_convert`
  names modules by substring (vLLM `is_layer_skipped_awq`: `any(m in prefix ...)`); Qwen's
  `Qwen2.5-VL-*-Instruct-AWQ` list `["visual"]`.
- `quant_method: "gptq"` (AutoGPTQ / GPTQModel `QuantLinear.pack`, `checkpoint_format: "gptq"`;
  transformers' `GPTQConfig`; vLLM `gptq.py`): `bits` 4 or 8 (int8.py), `group_size` (-1: one group per row),
  `sym`, `desc_act` (act-order: `g_idx` then scatters each group over the input columns, read
  by int4.py). GPTQ names no modules to leave dense: a layer is quantized where the
  checkpoint holds its `qweight` (Qwen's `Qwen2-VL-*-Instruct-GPTQ-Int4` keep the vision tower
  dense; vLLM's Qwen-VL models drop the quant config from the tower for GPTQ alike).
- `quant_method: "fp8"` (transformers `FineGrainedFP8Config`; vLLM `fp8.py`; Qwen's
  `Qwen3-VL-*-Instruct-FP8`): `fmt: "e4m3"`, `activation_scheme: "dynamic"`,
  `weight_block_size: [128, 128]` (block-wise, `weight_scale_inv`), or no block size (one
  `weight_scale` per tensor, vLLM's serialized FP8, whose `activation_scheme: "static"` also
  stores each layer's `input_scale`); `modules_to_not_convert` / `ignored_layers`
  name modules exactly, by a prefix ending at a dot or by a last part (transformers'
  `should_convert_module`: "lm_head", "model.visual", "gate").
- `quant_method: "modelopt"` (NVIDIA Model Optimizer's unified export; vLLM `modelopt.py`), in
  config.json's `quantization_config` (`quant_algo`, `ignore`) or, where config.json has none, in
  `hf_quant_config.json` (`{"producer": {"name": "modelopt"}, "quantization": {"quant_algo",
  "exclude_modules"}}`): `quant_algo: "FP8"`, FP8 weights with one `weight_scale` per tensor and a
  static `input_scale`, or `"FP8_PER_CHANNEL_PER_TOKEN"`, a `weight_scale` [out] per row and
  activations per token at run time (FP8-dynamic's). Excluded modules are wildcards (`fnmatch`)
  or substrings of a name, and the vision tower stays dense whatever the list says, as vLLM reads
  them.
- `quant_method: "compressed-tensors"` (llm-compressor; compressed-tensors' `QuantizationConfig`;
  vLLM `compressed_tensors.py`): one config group targeting `Linear`, `format`
  `"float-quantized"` with 8-bit `float` weights by `channel` or `tensor` (FP8-dynamic; or FP8 with
  static activation scales by `tensor`, each layer's `input_scale`) or by `block` (FP8_BLOCK:
  `block_structure`, a `weight_scale` per block), or
  `"pack-quantized"` with 4- or 8-bit `int` weights by `group` or `channel` and no activation
  quantization (W4A16, W8A16; `actorder` "group" stores `weight_g_idx`, as GPTQ's `g_idx`;
  "weight", alias "static", stores none), or `"int-quantized"` with 8-bit symmetric `int` weights by
  `channel` or `tensor` and 8-bit symmetric `int` input activations, `dynamic` by `token` (W8A8,
  llm-compressor's "W8A8" preset; RedHatAI's `*-quantized.w8a8`) or static by `tensor` (an
  `input_scale` per layer: older neuralmagic exports); `ignore` entries match a module's name
  exactly, or as a regular expression after `re:` (`re.match`). A `kv_cache_scheme` (FP8 KV-cache
  scales, `k_scale` / `v_scale`) is read past: the KV cache stays in `--kv-cache-dtype`.
- `--quantization fp8` (vLLM's online `Fp8Config`): every linear layer, the vision tower's and the
  projector's too, as vLLM's Qwen-VL and LLaVA models hand it their quant config (only GPTQ is
  kept off the tower, `_maybe_ignore_quant_config`); the LM head and convolutions stay.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass
from typing import Any

ONLINE_CHOICES = ("fp8",)  # --quantization


@dataclass(frozen=True)
class QuantSpec:
    """Which kernel family a checkpoint's quantized layers take, and which layers are left dense.

    `format`: "awq" (int4, AutoAWQ's GEMM packing), "gptq" (int4 or int8, AutoGPTQ's packing), "w4a16"
    and "w8a16" (int4, int8: compressed-tensors' pack-quantized), "w8a8" (int8 weights by row and
    int8 activations by token: compressed-tensors' int-quantized), "fp8_block" (FP8 with block scales),
    "fp8_channel" (FP8 with one scale per output row or per tensor, from the checkpoint),
    "fp8_online" (a float checkpoint quantized to FP8 per output row at load). Names are matched
    as the checkpoint spells its modules."""

    format: str
    group_size: int = 128  # int4, int8: input columns per scale (and zero point)
    bits: int = 4  # gptq: 4 or 8
    symmetric: bool = True  # w4a16, w8a16 without weight_zero_point
    block: tuple[int, int] = (128, 128)  # fp8_block: [output rows, input columns] per scale
    block_scale: str = "weight_scale_inv"  # fp8_block: the scales' tensor (compressed-tensors': weight_scale)
    per_tensor: bool = False  # fp8_channel, w8a8: one scale for the whole tensor (repeated per row at load)
    static_input: bool = False  # fp8_channel, w8a8: activations quantized by each layer's stored `input_scale`
    act_order: bool = False  # gptq, w4a16, w8a16: groups scattered over the input columns (`g_idx`, sorted)
    skip_substrings: tuple[str, ...] = ()
    skip_names: tuple[str, ...] = ()  # exact names, prefixes or suffixes at a dot, or "re:" patterns

    def quantizes(self, module: str) -> bool:
        """Whether the linear layer `module` (the checkpoint's name for it) is quantized."""
        if any(part in module for part in self.skip_substrings):
            return False
        return not any(_matches(module, entry) for entry in self.skip_names)

    @property
    def by_tensors(self) -> bool:
        """GPTQ names no layers to skip, and some AWQ releases name too few (InternVL's, vLLM patches
        them): a layer of either is quantized where its checkpoint holds a qweight."""
        return self.format in ("gptq", "awq")

    @property
    def is_int4(self) -> bool:
        return self.format in ("awq", "gptq", "w4a16") and self.bits == 4


def _matches(module: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return module == entry or module.startswith(entry + ".") or module.endswith("." + entry)


def read_quant_spec(model_dir: str, online: str | None = None) -> QuantSpec | None:
    """The checkpoint's quantization (None: dense); ValueError in one line for what is not read."""
    path = os.path.join(model_dir, "config.json")
    config: dict[str, Any] = {}
    if os.path.isfile(path):
        with open(path) as f:
            config = json.load(f)
    q = _quantization_config(model_dir, config)
    if online is not None:
        if online not in ONLINE_CHOICES:
            raise ValueError(f"--quantization {online!r} is not supported (choices: {', '.join(ONLINE_CHOICES)})")
        if q:
            raise ValueError(f"--quantization {online} was given for a checkpoint already quantized "
                             f"({q.get('quant_method')!r})")
        return QuantSpec("fp8_online")
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    readers = {"awq": _awq, "gptq": _gptq, "fp8": _fp8, "compressed-tensors": _compressed, "modelopt": _modelopt}
    if method not in readers:
        raise ValueError(f"quantization method {q.get('quant_method')!r} of {model_dir!r} is not supported "
                         "(supported: awq, gptq, fp8, compressed-tensors, modelopt)")
    return readers[method](q)


def _quantization_config(model_dir: str, config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's `quantization_config` (the decoder's, in a nested layout), else ModelOpt's
    `hf_quant_config.json` beside it, marked `quant_method: "modelopt"`."""
    decoder = config.get("text_config") or config.get("llm_config") or {}  # InternVL's own layout: llm_config
    q = config.get("quantization_config") or decoder.get("quantization_config")
    path = os.path.join(model_dir, "hf_quant_config.json")
    if q or not os.path.isfile(path):
        return q
    with open(path) as f:
        exported = json.load(f)
    return {**exported, "quant_method": "modelopt"}


def _awq(q: dict[str, Any]) -> QuantSpec:
    if q.get("bits", q.get("w_bit")) != 4:
        raise ValueError(f"AWQ with {q.get('bits', q.get('w_bit'))} bits is not supported (4 only)")
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm" or not q.get("zero_point", True):
        raise ValueError(f"AWQ version {version!r} (zero_point {q.get('zero_point')}) is not supported "
                         "(the GEMM packing with zero points only)")
    group = max(0, int(q.get("group_size", q.get("q_group_size", 128))))  # -1: one group per row (0 here)
    return QuantSpec("awq", group_size=group, symmetric=False,
                     skip_substrings=tuple(q.get("modules_to_not_convert") or ()))


def _gptq(q: dict[str, Any]) -> QuantSpec:
    bits = q.get("bits")
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with {bits} bits is not supported (4 or 8)")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt != "gptq" or q.get("is_marlin_format"):
        raise ValueError(f"GPTQ checkpoint_format {'marlin' if q.get('is_marlin_format') else fmt!r} is not "
                         "supported (AutoGPTQ's \"gptq\" packing only)")
    if q.get("dynamic"):
        raise ValueError("GPTQ with per-module `dynamic` settings (GPTQModel) is not supported")
    group = int(q.get("group_size", 128))
    act_order = bool(q.get("desc_act")) and not q.get("static_groups") and group > 0  # else g_idx is in order
    return QuantSpec("gptq", group_size=max(0, group), bits=bits, symmetric=bool(q.get("sym", True)),
                     act_order=act_order)


def check_tensor_parallel(spec: QuantSpec | None, tp_size: int) -> None:
    """ValueError in one line where the checkpoint cannot be split over `tp_size` ranks: an
    act-order int4 layer split by input columns gives a rank groups it holds only part of."""
    if spec is not None and spec.act_order and tp_size > 1:
        what = ("GPTQ with act-order (desc_act: true)" if spec.format == "gptq"
                else f"{spec.format.upper()} with actorder group")
        raise ValueError(f"{what} runs on one rank only: use --tensor-parallel-size 1 (or a checkpoint "
                         "quantized without act-order)")


def _fp8(q: dict[str, Any]) -> QuantSpec:
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"FP8 with activation_scheme {scheme!r} is not supported (dynamic or static)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 format {q.get('fmt')!r} is not supported (e4m3 only)")
    skip = tuple(q.get("modules_to_not_convert") or ()) + tuple(q.get("ignored_layers") or ())
    block = q.get("weight_block_size")
    if block is None:
        return QuantSpec("fp8_channel", per_tensor=True, static_input=scheme == "static", skip_names=skip)
    if scheme == "static":  # as vLLM: block scales quantize activations per token-group, at run time
        raise ValueError("FP8 with weight_block_size and activation_scheme 'static' is not supported")
    if len(block) != 2:
        raise ValueError(f"FP8 weight_block_size {block!r} is not supported ([rows, columns])")
    return QuantSpec("fp8_block", block=(int(block[0]), int(block[1])), skip_names=skip)


def _compressed(q: dict[str, Any]) -> QuantSpec:
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1 or "Linear" not in groups[0].get("targets", ()):
        raise ValueError("compressed-tensors with other than one config group targeting Linear is not supported")
    weights, acts, fmt = groups[0].get("weights") or {}, groups[0].get("input_activations"), q.get("format")
    skip = tuple(q.get("ignore") or ())
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    if fmt == "float-quantized" and (bits, kind) == (8, "float") and strategy in ("channel", "tensor"):
        static = acts is not None and not acts.get("dynamic", False)
        if static:
            _check_static_activations(acts, (8, "float"), "FP8")
        return QuantSpec("fp8_channel", per_tensor=strategy == "tensor", static_input=static, skip_names=skip)
    if fmt == "float-quantized" and (bits, kind) == (8, "float") and strategy == "block":
        return _compressed_fp8_block(weights, acts, skip)
    packed = fmt == "pack-quantized" and bits in (4, 8) and kind == "int"
    if packed and strategy in ("group", "channel") and acts is None:
        width = 4 if bits == 4 else 8
        name = f"w{width}a16"
        actorder = weights.get("actorder")
        if actorder not in (None, "weight", "static", "group"):
            raise ValueError(f"compressed-tensors {name.upper()} with actorder {actorder!r} is not supported")
        group = int(weights.get("group_size") or 0) if strategy == "group" else 0  # 0: one group per row
        return QuantSpec(name, group_size=group, bits=width, symmetric=bool(weights.get("symmetric", True)),
                         skip_names=skip, act_order=actorder == "group" and group > 0)
    if fmt == "int-quantized" and (bits, kind) == (8, "int") and strategy in ("channel", "tensor") and acts:
        _check_int8_activations(acts, weights)
        return QuantSpec("w8a8", bits=8, per_tensor=strategy == "tensor", static_input=not acts.get("dynamic"),
                         skip_names=skip)
    raise ValueError(f"compressed-tensors format {fmt!r} with {bits}-bit {kind} weights by {strategy!r}"
                     f"{' and activations' if acts else ''} is not supported (FP8 by channel, tensor or block; W4A16, "
                     "W8A16 by group or channel; W8A8 int8 by channel or tensor)")


def _compressed_fp8_block(weights: dict[str, Any], acts: dict[str, Any] | None, skip: tuple[str, ...]) -> QuantSpec:
    """llm-compressor's FP8_BLOCK: `block_structure` [rows, columns] per `weight_scale` entry (the
    layout of `weight_scale_inv`), activations dynamic (by token group) or none: weight-only here,
    as the fine-grained FP8 format is."""
    block = weights.get("block_structure")
    if not isinstance(block, list) or len(block) != 2:
        raise ValueError(f"compressed-tensors FP8 block_structure {block!r} is not supported ([rows, columns])")
    if acts is not None and not acts.get("dynamic", False):
        raise ValueError("compressed-tensors FP8 by block with static activation scales is not supported")
    return QuantSpec("fp8_block", block=(int(block[0]), int(block[1])), block_scale="weight_scale", skip_names=skip)


def _check_int8_activations(acts: dict[str, Any], weights: dict[str, Any]) -> None:
    """W8A8's input activations as vLLM's int8 kernels take them (`CompressedTensorsW8A8Int8`):
    8-bit int, symmetric as are the weights, quantized per token at run time or by a stored scale."""
    if (acts.get("num_bits"), acts.get("type")) != (8, "int"):
        raise ValueError(f"compressed-tensors int8 weights with {acts.get('num_bits')}-bit {acts.get('type')} "
                         "activations are not supported (W8A8: int8 activations)")
    if not weights.get("symmetric", True):
        raise ValueError("compressed-tensors W8A8 with asymmetric weights is not supported (symmetric only)")
    if not acts.get("dynamic", False):
        _check_static_activations(acts, (8, "int"), "W8A8")
    elif acts.get("strategy") != "token" or not acts.get("symmetric", True):
        raise ValueError(f"compressed-tensors W8A8 with dynamic activations by {acts.get('strategy')!r}"
                         f"{'' if acts.get('symmetric', True) else ', asymmetric,'} is not supported "
                         "(symmetric, by token)")


def _check_static_activations(acts: dict[str, Any], width: tuple[int, str], name: str) -> None:
    """Static input activations as vLLM's kernels take them: one symmetric `input_scale` per layer."""
    if (acts.get("num_bits"), acts.get("type")) != width or acts.get("strategy") != "tensor" or not acts.get(
            "symmetric", True):
        raise ValueError(f"compressed-tensors {name} with static activation scales by {acts.get('strategy')!r}"
                         f"{'' if acts.get('symmetric', True) else ', asymmetric,'} is not supported (one symmetric "
                         "scale per tensor)")


_VISION_PARTS = ("visual", "vision_tower", "vision_model")  # vLLM's ModelOpt reader keeps these dense


def _modelopt(q: dict[str, Any]) -> QuantSpec:
    nested = q.get("quantization")  # hf_quant_config.json's layout; config.json's is flat
    inner: dict[str, Any] = nested if isinstance(nested, dict) else q
    algo = str(inner.get("quant_algo") or "").upper()
    if algo not in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
        raise ValueError(f"ModelOpt quant_algo {inner.get('quant_algo')!r} is not supported (FP8: per-tensor weight "
                         "and activation scales; FP8_PER_CHANNEL_PER_TOKEN)")
    excluded = list(inner.get("exclude_modules") or inner.get("ignore") or [])
    plain = tuple(entry for entry in excluded if not any(c in entry for c in "*?["))
    patterns = tuple("re:" + fnmatch.translate(entry) for entry in excluded if entry not in plain)
    static = algo == "FP8"  # else a weight scale per row, activations per token at run time
    return QuantSpec("fp8_channel", per_tensor=static, static_input=static,
                     skip_substrings=plain + _VISION_PARTS, skip_names=patterns)


def check_cpu_activation_quant(mode: str, spec: QuantSpec | None, device: str, dtype: str) -> None:
    """ValueError in one line where `--cpu-activation-quant` `mode` cannot apply: anything but
    "none" needs the CPU (`device`), float32 activations (`dtype`) and int4 layers (AWQ or W4A16)."""
    if mode == "none":
        return
    flag = f"--cpu-activation-quant {mode}"
    if device != "cpu":
        raise ValueError(f"{flag} is for the CPU's int4 kernels; this engine runs on {device} (use --device cpu, "
                         "or leave it none)")
    if dtype != "float32":
        raise ValueError(f"{flag} quantizes float32 activations; --dtype is {dtype} (use float32 or auto)")
    if spec is None or not spec.is_int4:
        held = "not quantized" if spec is None else f"quantized as {spec.format}"
        raise ValueError(f"{flag} needs a checkpoint with 4-bit weights (AWQ, GPTQ or compressed-tensors W4A16); "
                         f"this one is {held}")
