"""Qwen2.5-VL-7B's, Qwen3-VL-8B's and LLaVA-1.5-7B's own steps on the `meta` device with the triton
backend, in bfloat16, as a GPU would run them eagerly, under gpu_compile's compile-only driver:
every Triton launch the model code makes compiles for the target, at the model's real shapes, and
nothing runs. Counted per decoder layer (or tower block): Triton launches, GEMMs, and every other
op that would launch a kernel (an aten op with a device output that is neither a view nor an
allocation). A step that reads a device value back to the host cannot run on `meta` at all: it
fails here, as a refusal does.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _model_sizes import (LLAVA_15_7B_TEXT, LLAVA_15_7B_VISION, QWEN3_VL_8B_TEXT, QWEN3_VL_8B_VISION,
                          QWEN25_VL_7B_TEXT, QWEN25_VL_7B_VISION)
from helpers.gpu_compile import META, compiling_for

GEMMS = {"linear", "mm", "addmm", "bmm", "matmul"}
ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided"}
BLOCK = 16


@dataclass
class StepLaunches:
    """What one step launches, and over how many layers (decoder layers or tower blocks)."""

    step: str
    layers: int
    triton: dict[str, int] = field(default_factory=dict)
    gemms: int = 0
    other: dict[str, int] = field(default_factory=dict)
    error: str = ""  # the compiler's refusal or the host read that stopped the step

    @property
    def per_layer(self) -> float:
        return (sum(self.triton.values()) + self.gemms + sum(self.other.values())) / self.layers


class _DeviceOps(TorchDispatchMode):
    """Counts the ops that would launch a device kernel: any output on `meta`, not a view or an allocation."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        outputs = out if isinstance(out, (tuple, list)) else [out]
        on_device = any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in outputs)
        if on_device and not func.is_view and name not in ALLOCATIONS:
            self.ops[name] += 1
        return out


@dataclass(frozen=True)
class ModelSpec:
    """How to build one model on `meta`: its architecture, the writer of its tokenizer and processor
    files returning its config, and one 1024x768 image's processed tensors as its processor makes them."""

    architecture: str
    write: Callable[[str], Any]  # folder -> the transformers config
    image: Callable[[Any], dict[str, torch.Tensor]]  # the model -> `encode_items`' data for one image


def _qwen(architecture: str, family: str, text: dict, vision: dict, grid: tuple[int, int]) -> ModelSpec:
    from mmserve.models.builtin_qwen_vl import write_qwen_vl_files

    h, w = grid  # the image in patches, as the processor resizes it
    return ModelSpec(architecture,
                     lambda folder: write_qwen_vl_files(folder, family=family, text_config=text, vision_config=vision,
                                                        min_pixels=56 * 56, max_pixels=28 * 28 * 1280),
                     lambda model: {"pixel_codes": torch.empty(h * w, model.config.vision.patch_dim,
                                                               dtype=torch.uint8, device=META),
                                    "pixel_lut": torch.empty(3, 256, device=META),
                                    "image_grid_thw": torch.tensor([[1, h, w]])})


def _llava() -> ModelSpec:
    from mmserve.models.builtin import write_llava_files

    side = LLAVA_15_7B_VISION["image_size"]  # every image is resized to CLIP's square
    return ModelSpec("LlavaForConditionalGeneration",
                     lambda folder: write_llava_files(folder, text_config=LLAVA_15_7B_TEXT,
                                                      vision_config=LLAVA_15_7B_VISION),
                     lambda model: {"pixel_codes": torch.empty(3, side, side, dtype=torch.uint8, device=META),
                                    "pixel_lut": torch.empty(3, 256, device=META)})


def models() -> dict[str, ModelSpec]:
    """The shipped families at their published 7B / 8B sizes."""
    return {"Qwen2.5-VL-7B": _qwen("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", QWEN25_VL_7B_TEXT,
                                   QWEN25_VL_7B_VISION, (56, 74)),
            "Qwen3-VL-8B": _qwen("Qwen3VLForConditionalGeneration", "qwen3_vl", QWEN3_VL_8B_TEXT, QWEN3_VL_8B_VISION,
                                 (48, 64)),
            "LLaVA-1.5-7B": _llava()}


def build(spec: ModelSpec) -> Any:
    """The model on `meta` (no weights), triton attention, bfloat16, projections fused as loaded."""
    from mmserve.models.loader import load_model
    from mmserve.models.parallel import fuse_projections

    with tempfile.TemporaryDirectory() as folder:
        config = spec.write(folder)
        config.architectures = [spec.architecture]
        config.save_pretrained(folder)
        model = load_model(folder, "bfloat16", device="meta", attention="triton")
    fuse_projections(model)
    return model


def _decoder_step(model: Any, query_lens: list[int], seq_lens: list[int]) -> Callable[[], object]:
    from mmserve.worker.device import to_device

    text = model.config.text
    shape = (4096, BLOCK, text.num_key_value_heads, text.head_dim)
    caches = [(torch.empty(shape, dtype=torch.bfloat16, device=META),) * 2 for _ in range(text.num_hidden_layers)]
    tables = [list(range(i * 256, i * 256 + -(-s // BLOCK))) for i, s in enumerate(seq_lens)]
    meta = to_device(model.attention.build_metadata(query_lens, seq_lens, tables, BLOCK), META)
    T = sum(query_lens)
    ids = torch.zeros(T, dtype=torch.int64, device=META)
    positions = torch.zeros((3, T) if model.uses_mrope else (T,), dtype=torch.int64, device=META)
    return lambda: model(model.embed_tokens(ids), positions, caches, meta, None)


def _tower(model: Any, data: dict[str, torch.Tensor]) -> Callable[[], object]:
    return lambda: model.encode_items([data], torch.bfloat16)


def step_launches(arch: int = 90) -> list[StepLaunches]:
    """Each model's eager decode at batch 1 and 64 (2,048-token contexts), a 1,000-token prefill,
    and its tower on one 1024x768 image, each counted as above."""
    out = []
    for name, spec in models().items():
        model = build(spec)
        layers, blocks = model.config.text.num_hidden_layers, len(_tower_blocks(model))
        steps = [(f"{name} decode, batch 1 at 2k", layers, _decoder_step(model, [1], [2048])),
                 (f"{name} decode, batch 64 at 2k", layers, _decoder_step(model, [1] * 64, [2048] * 64)),
                 (f"{name} prefill, 1,000 tokens", layers, _decoder_step(model, [1000], [1000])),
                 (f"{name} tower, one 1024x768 image", blocks, _tower(model, spec.image(model)))]
        out.extend(_count(name, count, run, arch) for name, count, run in steps)
    return out


def _tower_blocks(model: Any) -> Any:
    """The tower's blocks (Qwen's `visual.blocks`, CLIP's encoder layers as LLaVA builds them)."""
    inner = model.model
    return inner.visual.blocks if hasattr(inner, "visual") else inner.vision_tower.encoder.layers


def _count(name: str, layers: int, run: Callable[[], object], arch: int) -> StepLaunches:
    result = StepLaunches(name, layers)
    with compiling_for(arch) as seen, torch.inference_mode(), _DeviceOps() as ops:
        try:
            run()
        except Exception as exc:  # a refusal, or a read back to the host
            result.error = f"{type(exc).__name__}: {str(exc).strip()[-600:]}"
    result.triton = dict(Counter(kernel for kernel, _ in seen))
    result.gemms = sum(n for op, n in ops.ops.items() if op in GEMMS)
    result.other = {op: n for op, n in ops.ops.items() if op not in GEMMS}
    return result
