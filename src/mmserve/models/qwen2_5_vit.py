"""Qwen2.5-VL's vision tower (`model.visual`), as transformers'
`Qwen2_5_VisionTransformerPretrainedModel` defines it.

Patches are reordered window by window (windows of `window_size` pixels over the merged grid,
padded at the right and bottom edges); blocks in `fullatt_block_indexes` attend over each whole
frame, the others within each window; the merger then maps each 2x2 block of patches to one
embedding, and the window order is undone. Norms are RMSNorm, the MLP is gated SiLU with bias.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.layers import RMSNorm, activation
from mmserve.models.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel
from mmserve.models.qwen_config import QwenVisionConfig
from mmserve.models.qwen_vit import (Grid, VisionAttention, VisionPatchEmbed, VisionRotary, frame_boundaries,
                                     vision_positions)


class GatedMLP(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        D, inner, what = cfg.hidden_size, cfg.intermediate_size, "the vision tower's intermediate_size"
        self.gate_proj = ColumnParallelLinear(D, inner, True, tp, what=what)
        self.up_proj = ColumnParallelLinear(D, inner, True, tp, what=what)
        self.down_proj = RowParallelLinear(inner, D, True, tp, what=what)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, 1e-6)
        self.norm2 = RMSNorm(cfg.hidden_size, 1e-6)
        self.attn = VisionAttention(cfg, tp)
        self.mlp = GatedMLP(cfg, tp)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, cu)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm, then each merge block's patches concatenated -> Linear, GELU, Linear."""

    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.hidden = cfg.hidden_size * cfg.merge_unit
        what = "the vision merger's hidden size"
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6)
        self.mlp = nn.Sequential(ColumnParallelLinear(self.hidden, self.hidden, True, tp, what=what), nn.GELU(),
                                 RowParallelLinear(self.hidden, cfg.out_hidden_size, True, tp, what=what))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [P, Dv] -> [P / merge_unit, out_hidden_size]
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2_5VisionTower(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = VisionPatchEmbed(cfg, bias=False)
        self.rotary_pos_emb = VisionRotary(cfg.head_dim)
        self.blocks = nn.ModuleList(VisionBlock(cfg, tp) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, tp)

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values: [P, C * Tp * p * p] of the images with `grids` -> embeddings
        [P / merge_unit, out_hidden_size] in the processor's order, and no deepstack features."""
        unit = self.cfg.merge_unit
        order, window_cu = window_order(grids, self.cfg)  # over merge blocks; cu over patches
        x = self.patch_embed(pixel_values)  # [P, Dv]
        x = _permute(x, order, unit)
        cos, sin = self.rotary_pos_emb(vision_positions(grids, self.cfg.spatial_merge_size), x.dtype)
        rope = (_permute(cos, order, unit), _permute(sin, order, unit))
        frames = frame_boundaries(grids)
        for index, block in enumerate(self.blocks):
            x = block(x, rope, frames if index in self.cfg.fullatt_block_indexes else window_cu)
        merged = self.merger(x)  # [P / unit, out], in window order
        return merged[torch.argsort(order)], []


def _permute(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """Reorder rows by merge block: x [P, ...] with P = blocks * unit, blocks taken in `order`."""
    return x.reshape(-1, unit, *x.shape[1:])[order].reshape(x.shape)


def window_order(grids: list[Grid], cfg: QwenVisionConfig) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks of all images in window order, and the windows' `cu` in patches.

    Windows are `window_size // merge // patch` merged cells square, laid over each frame's merged
    grid from its top-left corner; edge windows are smaller (padding cells are dropped)."""
    merge, unit = cfg.spatial_merge_size, cfg.merge_unit
    side = cfg.window_size // merge // cfg.patch_size
    order, cu, first = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        for frame in range(t):
            for r in range(0, gh, side):
                for c in range(0, gw, side):
                    cells = index[frame, r:r + side, c:c + side].flatten()
                    order.append(cells + first)
                    cu.append(cu[-1] + cells.numel() * unit)
        first += t * gh * gw
    return torch.cat(order), cu
