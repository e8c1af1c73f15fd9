"""Qwen3-VL's vision tower (`model.visual`), equal to transformers' `Qwen3VLVisionModel`.

A learned square grid of position embeddings (`pos_embed`, side sqrt(num_position_embeddings))
is resampled bilinearly, corners aligned, to each image's patch grid and added to the patch
embeddings. Blocks (LayerNorm eps 1e-6, tanh-GELU MLP) attend within each frame. After each block
in `deepstack_visual_indexes` a deepstack merger (its norm after the merge-block shuffle) maps the
hidden states to decoder-sized features; the final merger gives the embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mmserve.models.attention.backend import AttentionBackend
from mmserve.models.layers import TORCH_OPS, EmbeddingTable, LayerOps, activation
from mmserve.models.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel
from mmserve.models.qwen_config import QwenVisionConfig
from mmserve.models.qwen_vision import (Grid, VisionBlock, VisionPatchEmbed, VisionPlan, VisionRotary, VisionTower,
                                        frame_boundaries, vision_positions)
from mmserve.worker.device import to_device

INTERMEDIATE = "the vision tower's intermediate_size"
MERGER = "the vision merger's hidden size (hidden_size * spatial_merge_size²)"


def _layer_norm(dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=1e-6)


class VisionMLP(nn.Module):
    """linear_fc2(act(linear_fc1(x))) with bias; fc1 column-parallel, fc2 row-parallel."""

    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, tp, what=INTERMEDIATE)
        self.linear_fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, tp, what=INTERMEDIATE)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, ops: LayerOps = TORCH_OPS) -> torch.Tensor:
        # x: [P, D] -> [P, D] (`ops`: the backend's small ops, of which this MLP uses none)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """LayerNorm on each patch (the final merger) or on the concatenated merge block (deepstack
    mergers, `postshuffle_norm`), then linear_fc1 (column-parallel), exact GELU, linear_fc2
    (row-parallel) to out_hidden_size."""

    def __init__(self, cfg: QwenVisionConfig, postshuffle_norm: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.hidden = cfg.hidden_size * cfg.merge_unit
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.hidden if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = ColumnParallelLinear(self.hidden, self.hidden, True, tp, what=MERGER)
        self.act_fn = nn.GELU()
        self.linear_fc2 = RowParallelLinear(self.hidden, cfg.out_hidden_size, True, tp, what=MERGER)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [P, D] -> [P / merge_unit, out_hidden_size]
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.hidden))
        else:
            x = self.norm(x).view(-1, self.hidden)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3VisionTower(VisionTower):
    """Qwen3-VL's `model.visual` (deepstack features as transformers gives them: in block order,
    i.e. `deepstack_visual_indexes` order when it is sorted, as in every published checkpoint)."""

    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        side = int(cfg.num_position_embeddings**0.5)  # transformers uses the first side² rows
        if side < 1:
            raise ValueError(f"Qwen3-VL's vision tower needs num_position_embeddings >= 1, "
                             f"got {cfg.num_position_embeddings}")
        self.cfg, self.side = cfg, side
        self.patch_embed = VisionPatchEmbed(cfg, bias=True)
        self.pos_embed = EmbeddingTable(cfg.num_position_embeddings, cfg.hidden_size)
        self.rotary_pos_emb = VisionRotary(cfg.head_dim)
        self.blocks = nn.ModuleList(VisionBlock(cfg, tp, _layer_norm, VisionMLP(cfg, tp)) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, False, tp)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, True, tp) for _ in cfg.deepstack_visual_indexes)

    def plan(self, grid_thw: list[Grid], attention: AttentionBackend, device: torch.device) -> Qwen3Plan:
        """The call's `Qwen3Plan`, from the grids alone (host work, one copy to `device`)."""
        angles = self.rotary_pos_emb.angles(vision_positions(grid_thw, self.cfg.spatial_merge_size))
        angles, taps, weights = to_device((angles, *self.position_taps(grid_thw)), device)
        return Qwen3Plan(angles, attention.segments(frame_boundaries(grid_thw), device), taps, weights)

    def run(self, pixel_values: torch.Tensor, plan: Qwen3Plan) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward` on a plan made for these pixels: device work alone, nothing read back."""
        cfg = self.cfg
        rope = self.rotary_pos_emb(plan.angles)
        x = self.patch_embed(pixel_values)  # [P, D]
        table = self.pos_embed.weight  # [side², D]
        x = x + (table[plan.taps] * plan.weights).sum(1).to(x.dtype)  # float32 sums when the table is lower
        deepstack, residual = [], None
        for index, block in enumerate(self.blocks):
            x, residual = block(x, residual, rope, plan.frames)
            if index in cfg.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(residual + x))
        return self.merger(residual + x), deepstack

    def position_taps(self, grids: list[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        """The learned grid resampled to each image, as host data: for every patch (merge-block
        order, each frame alike) the four `pos_embed` rows it reads [P, 4] int64 and their
        weights [P, 4, 1] float32; the embedding is the weighted sum of those rows."""
        m = self.cfg.spatial_merge_size
        taps: list[torch.Tensor] = []
        weights: list[torch.Tensor] = []
        for t, h, w in grids:
            row_taps, row_weights = bilinear_taps(h, self.side)  # [h, 2] each
            col_taps, col_weights = bilinear_taps(w, self.side)  # [w, 2] each
            index = row_taps[:, None, :, None] * self.side + col_taps[None, :, None, :]  # [h, w, 2, 2]
            weight = row_weights[:, None, :, None] * col_weights[None, :, None, :]  # [h, w, 2, 2]
            for grid, out in ((index, taps), (weight, weights)):
                blocks = grid.reshape(h // m, m, w // m, m, 4).transpose(1, 2).reshape(h * w, 4)
                out.append(blocks.repeat(t, 1))
        return torch.cat(taps), torch.cat(weights)[..., None]


@dataclass
class Qwen3Plan(VisionPlan):
    """A Qwen3-VL tower call's plan: the position embedding's bilinear taps besides the rotary."""

    taps: torch.Tensor  # [P, 4] int64: the `pos_embed` rows each patch's position embedding reads
    weights: torch.Tensor  # [P, 4, 1] float32: their weights


def bilinear_taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` points spread over a `side`-long axis, ends on ends (align_corners=True): each
    point's two source indices [size, 2] int64 (clamped to the axis) and weights [size, 2] float32."""
    src = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights
