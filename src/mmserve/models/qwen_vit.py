"""Pieces both Qwen vision towers share: the 3-D patch embedding, the 2-D rotary, attention that
never crosses a segment (an image, a frame or a window), and the tensor-parallel fused QKV.

Shapes: P = patches of all images in a call (rows of `pixel_values`, in the image processor's
merge-block order), Dv = the tower's hidden size, H = heads (this rank's), Dh = head dim.
Segments are given as cumulative boundaries `cu` ([S + 1] ints, `cu[0] == 0`), as transformers'
`cu_seqlens`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.models.layers import apply_rotary
from mmserve.models.parallel import SINGLE, RowParallelLinear, Shard, TensorParallel
from mmserve.models.qwen_config import QwenVisionConfig

Grid = tuple[int, int, int]  # (t, h, w) in patches


class VisionPatchEmbed(nn.Module):
    """A Conv3d whose kernel is its stride (temporal_patch_size x patch x patch): one row per patch."""

    def __init__(self, cfg: QwenVisionConfig, bias: bool) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=bias)
        self.shape = (cfg.in_channels, *kernel)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [P, C * Tp * p * p] -> [P, Dv]
        x = pixel_values.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(x.shape[0], -1)


class VisionRotary(nn.Module):
    """Axial 2-D rotary: head_dim / 4 frequencies for the patch's row, as many for its column."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        half = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float, device="cpu") / half))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [P, 2] (row, column) -> cos, sin: [P, 1, Dh] (broadcast over heads)."""
        freqs = positions[..., None].float() * self.inv_freq  # [P, 2, Dh/4]
        hw = freqs.flatten(1)  # [P, Dh/2]: rows' frequencies, then columns'
        emb = torch.cat((hw, hw), dim=-1)  # [P, Dh]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def vision_positions(grids: list[Grid], merge: int) -> torch.Tensor:
    """(row, column) of every patch, in merge-block order (the processor's row order): [P, 2]."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        blocks = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(blocks).transpose(1, 2).flatten()
        cols = cols.reshape(blocks).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def frame_boundaries(grids: list[Grid]) -> list[int]:
    """`cu` of one segment per frame of every image (attention never crosses a frame)."""
    cu = [0]
    for t, h, w in grids:
        cu += [cu[-1] + h * w * (i + 1) for i in range(t)]
    return cu


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float) -> torch.Tensor:
    """q, k, v: [P, H, Dh]; full attention within each segment [cu[i], cu[i+1]) -> [P, H, Dh]."""
    out = torch.empty_like(q)
    for lo, hi in zip(cu[:-1], cu[1:]):
        if hi > lo:
            qs, ks, vs = (x[lo:hi].transpose(0, 1)[None] for x in (q, k, v))  # [1, H, n, Dh]
            out[lo:hi] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)[0].transpose(0, 1)
    return out


class QKVParallelLinear(nn.Module):
    """The fused `qkv` Linear [3 * D, D] split by heads: this rank holds its rows of q, then k,
    then v (three checkpoint ranges, read and concatenated by the loader)."""

    def __init__(self, dim: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        per = tp.split(dim, "the vision tower's hidden_size (its heads)")
        self.weight = nn.Parameter(torch.empty(3 * per, dim))
        self.bias = nn.Parameter(torch.empty(3 * per))
        ranges = [Shard(0, part * dim + tp.rank * per, per) for part in range(3)]
        self.tp_shards = {"weight": ranges, "bias": ranges}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class VisionAttention(nn.Module):
    """`qkv` (fused, column-parallel), 2-D rotary, attention within segments, `proj` (row-parallel)."""

    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.num_heads = tp.split(cfg.num_heads, "the vision tower's num_heads")
        self.head_dim = cfg.head_dim
        self.qkv = QKVParallelLinear(cfg.hidden_size, tp)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, True, tp, what="the vision tower's num_heads")

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu: list[int]) -> torch.Tensor:
        P = x.shape[0]
        q, k, v = self.qkv(x).view(P, 3, self.num_heads, self.head_dim).unbind(1)  # each [P, H, Dh]
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = segment_attention(q, k, v, cu, self.head_dim**-0.5)
        return self.proj(out.reshape(P, -1))  # [P, Dv], all-reduced


def check_vision_shardable(cfg: QwenVisionConfig, tp: TensorParallel) -> None:
    """ValueError naming the vision size that does not split over tp.size."""
    tp.split(cfg.num_heads, "the vision tower's num_heads")
    tp.split(cfg.intermediate_size, "the vision tower's intermediate_size")
    tp.split(cfg.hidden_size * cfg.merge_unit, "the vision merger's hidden size")
