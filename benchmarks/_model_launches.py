"""Qwen2.5-VL-7B's and Qwen3-VL-8B's own steps on the `meta` device with the triton backend, in
bfloat16, as a GPU would run them eagerly, under gpu_compile's compile-only driver: every Triton launch the model code
makes compiles for the target, at the model's real shapes, and nothing runs. Counted per decoder
layer (or tower block): Triton launches, GEMMs, and every other op that would launch a kernel
(an aten op with a device output that is neither a view nor an allocation). A step that reads a
device value back to the host cannot run on `meta` at all: it fails here, as a refusal does.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _qwen_sizes import QWEN3_VL_8B_TEXT, QWEN3_VL_8B_VISION, QWEN25_VL_7B_TEXT, QWEN25_VL_7B_VISION
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


MODELS = {  # name -> (family, architecture, text sizes, vision sizes, a 1024x768 image's grid (h, w) in patches)
    "Qwen2.5-VL-7B": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B_TEXT, QWEN25_VL_7B_VISION,
                      (56, 74)),
    "Qwen3-VL-8B": ("qwen3_vl", "Qwen3VLForConditionalGeneration", QWEN3_VL_8B_TEXT, QWEN3_VL_8B_VISION, (48, 64)),
}


def build(name: str) -> Any:
    """`MODELS[name]` on `meta` (no weights), triton attention, bfloat16, projections fused as loaded."""
    from mmserve.models.builtin_qwen_vl import write_qwen_vl_files
    from mmserve.models.loader import load_model
    from mmserve.models.parallel import fuse_projections

    family, architecture, text, vision, _ = MODELS[name]
    with tempfile.TemporaryDirectory() as folder:
        config = write_qwen_vl_files(folder, family=family, text_config=text, vision_config=vision,
                                     min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
        config.architectures = [architecture]
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
    ids = torch.zeros(sum(query_lens), dtype=torch.int64, device=META)
    positions = torch.zeros(3, sum(query_lens), dtype=torch.int64, device=META)
    return lambda: model(model.embed_tokens(ids), positions, caches, meta, None)


def _tower(model: Any, h: int, w: int) -> Callable[[], object]:
    vision = model.config.vision
    data = {"pixel_values": torch.empty(h * w, vision.patch_dim, device=META),
            "image_grid_thw": torch.tensor([[1, h, w]])}
    return lambda: model.encode_items([data], torch.bfloat16)


def step_launches(arch: int = 90) -> list[StepLaunches]:
    """Each model's eager decode at batch 1 and 64 (2,048-token contexts), a 1,000-token prefill,
    and its tower on one 1024x768 image, each counted as above."""
    out = []
    for name, (*_, (h, w)) in MODELS.items():
        model = build(name)
        layers, blocks = model.config.text.num_hidden_layers, model.config.vision.depth
        steps = [(f"{name} decode, batch 1 at 2k", layers, _decoder_step(model, [1], [2048])),
                 (f"{name} decode, batch 64 at 2k", layers, _decoder_step(model, [1] * 64, [2048] * 64)),
                 (f"{name} prefill, 1,000 tokens", layers, _decoder_step(model, [1000], [1000])),
                 (f"{name} tower, one 1024x768 image", blocks, _tower(model, h, w))]
        out.extend(_count(name, count, run, arch) for name, count, run in steps)
    return out


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
