"""Qwen3-VL's vision tower (`model.visual`), as transformers' `Qwen3VLVisionModel` defines it.

A learned square grid of position embeddings is resampled (bilinear, corners aligned) to each
image's patch grid and added to the patch embeddings; blocks (LayerNorm, GELU MLP) attend within
each frame; after each block in `deepstack_visual_indexes` a deepstack merger (norm after the
2x2 shuffle) maps the hidden states to decoder-sized features, and the final merger gives the
embeddings.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.layers import activation
from mmserve.models.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel
from mmserve.models.qwen_config import QwenVisionConfig
from mmserve.models.qwen_vit import Grid, VisionAttention, VisionPatchEmbed, VisionRotary, frame_boundaries, vision_positions


class VisionMLP(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        D, inner, what = cfg.hidden_size, cfg.intermediate_size, "the vision tower's intermediate_size"
        self.linear_fc1 = ColumnParallelLinear(D, inner, True, tp, what=what)
        self.linear_fc2 = RowParallelLinear(inner, D, True, tp, what=what)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg, tp)
        self.mlp = VisionMLP(cfg, tp)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, cu)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm (before the 2x2 shuffle, or after it for deepstack mergers), Linear, GELU, Linear."""

    def __init__(self, cfg: QwenVisionConfig, postshuffle_norm: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.hidden = cfg.hidden_size * cfg.merge_unit
        self.postshuffle_norm = postshuffle_norm
        what = "the vision merger's hidden size"
        self.norm = nn.LayerNorm(self.hidden if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = ColumnParallelLinear(self.hidden, self.hidden, True, tp, what=what)
        self.act_fn = nn.GELU()
        self.linear_fc2 = RowParallelLinear(self.hidden, cfg.out_hidden_size, True, tp, what=what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [P, Dv] -> [P / merge_unit, out_hidden_size]
        x = self.norm(x.view(-1, self.hidden)) if self.postshuffle_norm else self.norm(x).view(-1, self.hidden)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = VisionPatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.side = int(cfg.num_position_embeddings**0.5)
        self.rotary_pos_emb = VisionRotary(cfg.head_dim)
        self.blocks = nn.ModuleList(VisionBlock(cfg, tp) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, False, tp)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, True, tp) for _ in cfg.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values: [P, C * Tp * p * p] of the images with `grids` -> embeddings
        [P / merge_unit, out_hidden_size] and one deepstack feature tensor of that shape per
        deepstack layer (in `deepstack_visual_indexes` order)."""
        x = self.patch_embed(pixel_values)  # [P, Dv]
        x = x + self._position_embeddings(grids).to(x.dtype)
        positions = vision_positions(grids, self.cfg.spatial_merge_size)
        rope = self.rotary_pos_emb(positions, x.dtype)
        frames = frame_boundaries(grids)
        deepstack: dict[int, torch.Tensor] = {}
        layers = self.cfg.deepstack_visual_indexes
        for index, block in enumerate(self.blocks):
            x = block(x, rope, frames)
            if index in layers:
                deepstack[index] = self.deepstack_merger_list[layers.index(index)](x)
        return self.merger(x), [deepstack[index] for index in sorted(deepstack)]

    def _position_embeddings(self, grids: list[Grid]) -> torch.Tensor:
        """The learned grid resampled bilinearly (corners aligned) to each image: [P, Dv] in the
        processor's merge-block order, repeated for each frame."""
        out = []
        merge, table = self.cfg.spatial_merge_size, self.pos_embed.weight
        for t, h, w in grids:
            rows = _taps(h, self.side)  # (index [h, 2], weight [h, 2])
            cols = _taps(w, self.side)
            index = rows[0][:, None, :, None] * self.side + cols[0][None, :, None, :]  # [h, w, 2, 2]
            weight = rows[1][:, None, :, None] * cols[1][None, :, None, :]
            grid = (table[index.reshape(h, w, 4)] * weight.reshape(h, w, 4, 1)).sum(2)  # [h, w, Dv]
            blocks = grid.reshape(h // merge, merge, w // merge, merge, -1).transpose(1, 2)
            out.append(blocks.reshape(h * w, -1).repeat(t, 1))
        return torch.cat(out)


def _taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps of `size` points over a `side`-long axis, corners aligned: the two source
    indices per point [size, 2] and their weights [size, 2]."""
    src = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights
