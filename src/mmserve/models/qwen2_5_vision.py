"""Qwen2.5-VL's vision tower (`model.visual`), equal to transformers'
`Qwen2_5_VisionTransformerPretrainedModel`.

The patch embeddings are put in window order: each frame's merged grid is tiled by windows of
`window_size // spatial_merge_size // patch_size` merge blocks a side from its top-left corner
(windows at the right and bottom edges are cut short). Blocks in `fullatt_block_indexes` attend
over each whole frame, the others within each window. The merger maps each merge block's patches
to one embedding, and the window order is then undone, so rows come out in the processor's order.
Norms are RMSNorm (eps 1e-6), the MLP is gated SiLU with bias.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.models.attention.backend import AttentionBackend, SegmentAttention
from mmserve.models.layers import TORCH_OPS, LayerOps, RMSNorm, activation, add_norm
from mmserve.models.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel, project
from mmserve.models.qwen_config import QwenVisionConfig
from mmserve.models.qwen_vision import (Grid, VisionBlock, VisionPatchEmbed, VisionPlan, VisionRotary, VisionTower,
                                        frame_boundaries, vision_positions)
from mmserve.worker.device import to_device

INTERMEDIATE = "the vision tower's intermediate_size"
MERGER = "the vision merger's hidden size (hidden_size * spatial_merge_size²)"


def _rms_norm(dim: int) -> nn.Module:
    return RMSNorm(dim, 1e-6)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), all with bias; gate/up column-parallel (one matrix once packed,
    `fuse_projections`), down row-parallel. A SiLU gate is the backend's `silu_mul`."""

    fused_projections = (("gate_proj", "up_proj"),)

    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        D, inner = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = ColumnParallelLinear(D, inner, True, tp, what=INTERMEDIATE)
        self.up_proj = ColumnParallelLinear(D, inner, True, tp, what=INTERMEDIATE)
        self.down_proj = RowParallelLinear(inner, D, True, tp, what=INTERMEDIATE)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, ops: LayerOps = TORCH_OPS) -> torch.Tensor:
        # x: [P, D] -> [P, D]
        gate, up = project(x, self.gate_proj, self.up_proj)  # views of one [P, 2I / N] once packed
        return self.down_proj(ops.silu_mul(gate, up) if self.act is F.silu else self.act(gate) * up)


class PatchMerger(nn.Module):
    """`ln_q` (RMSNorm on each patch; Qwen2-VL's is a LayerNorm: `norm`), each merge block's
    patches concatenated, then `mlp`: Linear (column-parallel), exact GELU, Linear (row-parallel)
    to out_hidden_size."""

    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE,
                 norm: Callable[[int], nn.Module] = _rms_norm) -> None:
        super().__init__()
        self.hidden = cfg.hidden_size * cfg.merge_unit
        self.ln_q = norm(cfg.hidden_size)
        self.mlp = nn.Sequential(ColumnParallelLinear(self.hidden, self.hidden, True, tp, what=MERGER), nn.GELU(),
                                 RowParallelLinear(self.hidden, cfg.out_hidden_size, True, tp, what=MERGER))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                ops: LayerOps = TORCH_OPS) -> torch.Tensor:
        # x (+ residual, the stream as the blocks carry it): [P, D] -> [P / merge_unit, out_hidden_size]
        return self.mlp(add_norm(ops, self.ln_q, x, residual)[0].view(-1, self.hidden))


class Qwen2_5VisionTower(VisionTower):
    """Qwen2.5-VL's `model.visual`."""

    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = VisionPatchEmbed(cfg, bias=False)
        self.rotary_pos_emb = VisionRotary(cfg.head_dim)
        self.blocks = nn.ModuleList(VisionBlock(cfg, tp, _rms_norm, GatedMLP(cfg, tp)) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, tp)

    def plan(self, grid_thw: list[Grid], attention: AttentionBackend, device: torch.device) -> WindowPlan:
        """The call's `WindowPlan`, from the grids alone (host work, one copy to `device`)."""
        cfg = self.cfg
        order, window_cu = window_order(grid_thw, cfg)  # merge blocks in window order; cu in patches
        positions = by_block(vision_positions(grid_thw, cfg.spatial_merge_size), order, cfg.merge_unit)
        angles, order, restore = to_device((self.rotary_pos_emb.angles(positions), order, torch.argsort(order)),
                                           device)
        frames = attention.segments(frame_boundaries(grid_thw), device)  # windows never cross a frame
        return WindowPlan(angles, frames, attention.segments(window_cu, device), order, restore)

    def run(self, pixel_values: torch.Tensor, plan: WindowPlan) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward` on a plan made for these pixels: device work alone, nothing read back."""
        cfg = self.cfg
        rope = self.rotary_pos_emb(plan.angles)
        x = by_block(self.patch_embed(pixel_values), plan.order, cfg.merge_unit)  # [P, D], window order
        residual = None
        for index, block in enumerate(self.blocks):
            x, residual = block(x, residual, rope, plan.frames if index in cfg.fullatt_block_indexes else plan.windows)
        merged = self.merger(x, residual, plan.frames.ops)  # [P / merge_unit, out_hidden_size], window order
        return merged[plan.restore], []


@dataclass
class WindowPlan(VisionPlan):
    """A Qwen2.5-VL tower call's plan: rows in window order (merge blocks permuted by `order`)."""

    windows: SegmentAttention  # one segment per window
    order: torch.Tensor  # [P / merge_unit] int64: the merge blocks in window order
    restore: torch.Tensor  # [P / merge_unit] int64: its inverse, window order back to the processor's


def by_block(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """x: [P, ...] with P = blocks * unit -> the same rows, merge blocks taken in `order` [blocks]."""
    return x.reshape(-1, unit, *x.shape[1:])[order].reshape(x.shape)


def window_order(grids: list[Grid], cfg: QwenVisionConfig) -> tuple[torch.Tensor, list[int]]:
    """(the merge blocks of all images in window order [P / merge_unit] int64, the windows' `cu`
    in patches). Frames and images in order; each frame's windows row-major, and the blocks of
    each window row-major. Transformers pads the grid to whole windows and drops the padding: the
    same blocks in the same order."""
    side = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size  # window side in merge blocks
    if side < 1:
        raise ValueError(f"window_size {cfg.window_size} is smaller than one merge block")
    orders, sizes, first = [], [], 0
    for t, h, w in grids:
        gh, gw = h // cfg.spatial_merge_size, w // cfg.spatial_merge_size
        nh, nw = -(-gh // side), -(-gw // side)  # windows down and across
        blocks = torch.arange(first, first + t * gh * gw).view(t, gh, gw)
        padded = F.pad(blocks, (0, nw * side - gw, 0, nh * side - gh), value=-1)  # [t, nh * side, nw * side]
        windows = padded.view(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
        orders.append(windows[windows >= 0])  # row-major within each window
        sizes.append((windows >= 0).sum(1))  # [t * nh * nw] blocks per window
        first += t * gh * gw
    cu = torch.cat(sizes).cumsum(0) * cfg.merge_unit
    return torch.cat(orders), [0, *cu.tolist()]
