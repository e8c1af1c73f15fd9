"""Qwen2-VL's vision tower (`model.visual`), equal to transformers'
`Qwen2VisionTransformerPretrainedModel`.

The first of the three towers and the plainest: the patch embedding (no bias), blocks of
LayerNorm (eps 1e-6), attention within each frame and a QuickGELU MLP (`fc1`, `fc2`), then
Qwen2.5-VL's merger with a LayerNorm for its `ln_q`. No windows, no learned position
embeddings, no deepstack: the axial 2-D rotary alone places the patches.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.attention.backend import AttentionBackend
from mmserve.models.layers import TORCH_OPS, LayerOps, activation
from mmserve.models.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel
from mmserve.models.qwen2_5_vision import PatchMerger
from mmserve.models.qwen_config import QwenVisionConfig
from mmserve.models.qwen_vision import (Grid, VisionBlock, VisionPatchEmbed, VisionPlan, VisionRotary, VisionTower,
                                        frame_boundaries, vision_positions)
from mmserve.worker.device import to_device

INTERMEDIATE = "the vision tower's intermediate_size (embed_dim * mlp_ratio)"


def _layer_norm(dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=1e-6)


class VisionMlp(nn.Module):
    """fc2(act(fc1(x))) with bias (QuickGELU in every published checkpoint); fc1 column-parallel,
    fc2 row-parallel."""

    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, tp, what=INTERMEDIATE)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, tp, what=INTERMEDIATE)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, ops: LayerOps = TORCH_OPS) -> torch.Tensor:
        # x: [P, D] -> [P, D] (`ops`: the backend's small ops, of which this MLP uses none)
        return self.fc2(self.act(self.fc1(x)))


class Qwen2VisionTower(VisionTower):
    """Qwen2-VL's `model.visual`."""

    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = VisionPatchEmbed(cfg, bias=False)
        self.rotary_pos_emb = VisionRotary(cfg.head_dim)
        self.blocks = nn.ModuleList(VisionBlock(cfg, tp, _layer_norm, VisionMlp(cfg, tp)) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, tp, _layer_norm)

    def plan(self, grid_thw: list[Grid], attention: AttentionBackend, device: torch.device) -> VisionPlan:
        """The call's `VisionPlan`, from the grids alone (host work, one copy to `device`)."""
        angles = self.rotary_pos_emb.angles(vision_positions(grid_thw, self.cfg.spatial_merge_size))
        return VisionPlan(to_device(angles, device), attention.segments(frame_boundaries(grid_thw), device))

    def run(self, pixel_values: torch.Tensor, plan: VisionPlan) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward` on a plan made for these pixels: device work alone, nothing read back."""
        rope = self.rotary_pos_emb(plan.angles)
        x, residual = self.patch_embed(pixel_values), None  # [P, D]
        for block in self.blocks:
            x, residual = block(x, residual, rope, plan.frames)
        return self.merger(x, residual, plan.frames.ops), []
