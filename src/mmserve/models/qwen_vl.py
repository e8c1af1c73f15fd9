"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL as transformers' `*ForConditionalGeneration` define them: a
dynamic-resolution vision tower (`model.visual`), a Qwen2 / Qwen3 decoder with M-RoPE
(`model.language_model`) and the LM head.

The runner's interface is LLaVA's (models/llava.py) plus what the family needs:
`mrope_positions` (3-D positions of a whole prompt, computed once per request) and, for
Qwen3-VL, deepstack features that travel with each item's encoder output (rows
[F, D * (1 + num_deepstack)]: the embedding, then each deepstack layer's features) and are
added after the first decoder layers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mmserve.models.attention.backend import StepAttention
from mmserve.models.parallel import SINGLE, TensorParallel, check_decoder_shardable
from mmserve.models.qwen2_5_vision import Qwen2_5VisionTower
from mmserve.models.qwen2_vision import Qwen2VisionTower
from mmserve.models.qwen3_vision import Qwen3VisionTower
from mmserve.models.qwen_config import QWEN2_5_VL, QWEN2_VL, QWEN3_VL, QwenVLModelConfig
from mmserve.models.qwen_text import QwenTextModel
from mmserve.models.mrope import mrope_positions
from mmserve.models.qwen_vision import check_vision_shardable
from mmserve.models.vlm import VisionLanguageModel
from mmserve.ipc.items import MultiModalItem
from mmserve.ipc.pixel_codes import pixel_values


class QwenVLInner(nn.Module):
    """The `model.` prefix of the checkpoint: vision tower and decoder."""

    def __init__(self, cfg: QwenVLModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        towers = {QWEN2_VL: Qwen2VisionTower, QWEN2_5_VL: Qwen2_5VisionTower, QWEN3_VL: Qwen3VisionTower}
        self.visual = towers[cfg.family](cfg.vision, tp)
        self.language_model = QwenTextModel(cfg.text, tp)


class QwenVLForConditionalGeneration(VisionLanguageModel):
    OLD_PREFIXES = (  # Qwen2-VL's and Qwen2.5-VL's published layout (transformers 4.4x) -> the module tree
        ("visual.", "model.visual."),
        ("model.layers.", "model.language_model.layers."),
        ("model.embed_tokens.", "model.language_model.embed_tokens."),
        ("model.norm.", "model.language_model.norm."),
    )
    uses_mrope = True

    def __init__(self, cfg: QwenVLModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, tp, QwenVLInner(cfg, tp))

    # ---- loading --------------------------------------------------------------------------------

    @staticmethod
    def check_shardable(cfg: QwenVLModelConfig, tp: TensorParallel) -> None:
        """ValueError naming the first size that does not split over tp.size."""
        check_decoder_shardable(cfg.text, tp)
        check_vision_shardable(cfg.vision, tp)

    @staticmethod
    def is_unused(name: str, cfg: QwenVLModelConfig) -> bool:
        return False

    # ---- the runner's interface -------------------------------------------------------------

    @property
    def num_deepstack(self) -> int:  # type: ignore[override]
        return self.config.num_deepstack

    def mrope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> tuple[torch.Tensor, int]:
        """M-RoPE positions [3, len(token_ids)] of a prompt with its items (in prompt order), and
        the delta that continues them (token i >= len at position i + delta on every axis).

        Positions read nothing of an item but its `position_key` (which the prefix cache's block
        keys carry): (t, h, w), and for a Qwen2-VL or Qwen2.5-VL video group also (index in its
        video, seconds per group). A video arrives as one t = 1 item per temporal group. Qwen3-VL
        keys no group: each is placed as an image (timestamp text between groups carries time).
        Qwen2-VL and Qwen2.5-VL join a video's contiguous groups into one grid whose temporal index
        steps by 1 per group (Qwen2-VL) or by `tokens_per_second * seconds per group` (Qwen2.5-VL,
        float32, as transformers multiplies them)."""
        grids: list[list[int]] = []
        steps: list[float] = []
        for item in items:
            t, h, w, group = _place(item)
            if group is not None and group[0] > 0 and grids and _continues(grids[-1], item, h, w, self.merge_unit):
                grids[-1][1] += t
                continue
            grids.append([item.placeholder.offset, t, h, w])
            steps.append(1.0 if group is None or self.config.family == QWEN2_VL else
                         float(torch.tensor(group[1], dtype=torch.float32) * self.config.vision.tokens_per_second))
        four = [(offset, t, h, w) for offset, t, h, w in grids]
        return mrope_positions(token_ids, four, self.config.vision.spatial_merge_size, steps)

    @property
    def merge_unit(self) -> int:
        return self.config.vision.merge_unit

    def largest_item_data(self) -> dict[str, torch.Tensor]:
        """Zeros on the host shaped as the largest image the default processor settings make
        (a square grid of `max_item_tokens` merged patches at most): what the memory profile encodes."""
        vision, side = self.config.vision, math.isqrt(self.config.max_item_tokens)
        h = w = side * vision.spatial_merge_size
        return {"pixel_codes": torch.zeros(h * w, vision.patch_dim, dtype=torch.uint8),
                "pixel_lut": torch.zeros(vision.in_channels, 256), "image_grid_thw": torch.tensor([[1, h, w]])}

    @torch.inference_mode()
    def encode_items(self, datas: list[dict[str, torch.Tensor]], dtype: torch.dtype) -> list[torch.Tensor]:
        """Processed images -> each one's rows [F_i, D * (1 + num_deepstack)], in order.

        All images run in one tower call; attention never crosses an image."""
        pixels = torch.cat([pixel_values(data, dtype) for data in datas])  # [P, C * Tp * p * p]
        grids = [_grid_of(data) for data in datas]
        embeds, deepstack = self.model.visual(pixels, grids, self.attention)  # [F, D], each [F, D]
        rows = torch.cat([embeds, *deepstack], dim=-1) if deepstack else embeds
        merge = self.config.vision.merge_unit
        return list(rows.split([t * h * w // merge for t, h, w in grids]))

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, D]; the runner overwrites image placeholders with encoder outputs."""
        return self.model.language_model.embed_tokens(input_ids)

    @torch.inference_mode()
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: StepAttention,
                deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds: [T, D], positions: [3, T], deepstack: [layers, T, D] or None -> [T, D]."""
        return self.model.language_model(inputs_embeds, positions, kv_caches, meta, deepstack)


def _continues(grid: list[int], item: MultiModalItem, h: int, w: int, merge_unit: int) -> bool:
    """True when `item` is the next temporal group right after the video grid `grid`."""
    offset, t, gh, gw = grid
    return (gh, gw) == (h, w) and item.placeholder.offset == offset + t * h * w // merge_unit


def _grid_of(data: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    t, h, w = (int(v) for v in data["image_grid_thw"].reshape(3).tolist())
    return t, h, w


def _place(item: MultiModalItem) -> tuple[int, int, int, tuple[int, float] | None]:
    """(t, h, w, (group index, seconds per group) or None) from the item's position key."""
    key = item.position_key
    if len(key) not in (3, 5):
        raise ValueError(f"item {item.mm_hash} has position key {key!r}; a Qwen-VL item needs (t, h, w) "
                         "or (t, h, w, group, seconds per group)")
    t, h, w = (int(v) for v in key[:3])
    return t, h, w, None if len(key) == 3 else (int(key[3]), float(key[4]))
