"""Small Qwen vision towers for tests: the three families' configs from one shape (two layers, the
second of Qwen2.5-VL's a full-attention one, the first of Qwen3-VL's a deepstack one; Qwen2-VL's
with its QuickGELU)."""

from __future__ import annotations

from typing import Any

from mmserve.models.qwen2_5_vision import Qwen2_5VisionTower
from mmserve.models.qwen2_vision import Qwen2VisionTower
from mmserve.models.qwen3_vision import Qwen3VisionTower
from mmserve.models.qwen_config import QwenVisionConfig

TOWERS = {"qwen2": Qwen2VisionTower, "qwen2_5": Qwen2_5VisionTower, "qwen3": Qwen3VisionTower}


def tower_shape(hidden_size: int, intermediate_size: int, out_hidden_size: int) -> dict[str, Any]:
    """The fields both families share: two heads, two layers, a 2x2 merge, two frames per patch."""
    return dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_heads=2,
                out_hidden_size=out_hidden_size, spatial_merge_size=2, temporal_patch_size=2, depth=2,
                in_channels=3, hidden_act="silu")


def tower_configs(shape: dict[str, Any], window_size: int) -> dict[str, QwenVisionConfig]:
    """family -> its config of `shape` (Qwen2.5-VL with windows of `window_size` pixels)."""
    return {"qwen2": QwenVisionConfig(**{**shape, "hidden_act": "quick_gelu"}, patch_size=14),
            "qwen2_5": QwenVisionConfig(**shape, patch_size=14, window_size=window_size, fullatt_block_indexes=(1,)),
            "qwen3": QwenVisionConfig(**shape, patch_size=16, num_position_embeddings=64,
                                      deepstack_visual_indexes=(0,))}
