"""What the Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers share: a tower call as a plan then a
run (`VisionTower`), the patch embedding, the axial 2-D rotary, attention that never leaves its
segment (a frame of an image, or a window of one), the pre-norm block, and the tensor-parallel
fused QKV.

Shapes: P = patches of every image in one tower call (rows of `pixel_values`, images in order,
each image's patches in the processor's merge-block order: the m x m patches of a merge block are
consecutive, blocks row-major), D = the tower's hidden size, H = this rank's heads, Dh = head dim.
Segments (an attention backend's `SegmentAttention`) are given by cumulative boundaries `cu` in
patches ([S + 1] ints, `cu[0] == 0`), like transformers' `cu_seqlens`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.models.attention.backend import AttentionBackend, SegmentAttention
from mmserve.models.attention.torch_sdpa import TORCH
from mmserve.models.layers import add_norm
from mmserve.models.parallel import SINGLE, ParallelLinear, RowParallelLinear, Shard, TensorParallel
from mmserve.models.quantization.base import LinearMethod, LinearShape
from mmserve.models.qwen_config import QwenVisionConfig

Grid = tuple[int, int, int]  # (t, h, w) of one image in patches
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [P, 1, Dh] float32


def check_vision_shardable(cfg: QwenVisionConfig, tp: TensorParallel) -> None:
    """ValueError naming the vision size that does not split over tp.size."""
    tp.split(cfg.num_heads, "the vision tower's num_heads")
    tp.split(cfg.intermediate_size, "the vision tower's intermediate_size")
    tp.split(cfg.hidden_size * cfg.merge_unit, "the vision merger's hidden size (hidden_size * spatial_merge_size²)")


def check_grids(pixel_values: torch.Tensor, grids: list[Grid], cfg: QwenVisionConfig) -> None:
    """ValueError unless `pixel_values` holds exactly the patches of `grids`, in whole merge blocks."""
    m = cfg.spatial_merge_size
    if any(t < 1 or h < 1 or w < 1 or h % m or w % m for t, h, w in grids):
        raise ValueError(f"image grids {grids} must be positive, with h and w multiples of {m}")
    patches = sum(t * h * w for t, h, w in grids)
    if tuple(pixel_values.shape) != (patches, cfg.patch_dim):
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; grids {grids} "
                         f"need ({patches}, {cfg.patch_dim})")


def vision_positions(grids: list[Grid], merge: int) -> torch.Tensor:
    """(row, column) of every patch in merge-block order, each frame alike: [P, 2] int64."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        blocks = (h // merge, merge, w // merge, merge)
        rc = torch.stack([x.reshape(blocks).transpose(1, 2).flatten() for x in (rows, cols)], dim=-1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


def frame_boundaries(grids: list[Grid]) -> list[int]:
    """`cu` with one segment per frame of every image: full attention never crosses a frame."""
    cu = [0]
    for t, h, w in grids:
        cu += [cu[-1] + h * w * (i + 1) for i in range(t)]
    return cu


class VisionPatchEmbed(nn.Module):
    """One row per patch: a Conv3d whose kernel is its stride (temporal_patch_size x patch x patch),
    kept as `proj` with the checkpoint's weight shape [D, C, Tp, p, p] and computed as the matmul it
    is (the kernel covers the whole patch)."""

    def __init__(self, cfg: QwenVisionConfig, bias: bool) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [P, C * Tp * p * p] -> [P, D]
        weight = self.proj.weight.flatten(1)  # [D, C * Tp * p * p], the same (c, t, y, x) order as a row
        return F.linear(pixel_values.to(weight.dtype), weight, self.proj.bias)


class VisionRotary(nn.Module):
    """Axial 2-D rotary: Dh / 4 frequencies (theta 10000) on the patch's row, the same on its
    column, rotating the whole head (rotate-half over [row, column, row, column] angles). The
    angles are host work (`angles`, from the grids), their cos and sin the device's (`forward`)."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """positions: [P, 2] (row, column) on the host -> [P, Dh/2] float32: the row's angles, then the column's."""
        half = self.head_dim // 2
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, half, 2, dtype=torch.float, device="cpu") / half))  # [Dh/4]
        return (positions[..., None].float() * inv_freq).flatten(1)

    def forward(self, angles: torch.Tensor) -> Rope:
        """angles: [P, Dh/2] (`angles`) -> cos, sin: [P, 1, Dh] float32."""
        emb = torch.cat((angles, angles), dim=-1)[:, None, :]  # [P, 1, Dh]
        return emb.cos(), emb.sin()


@dataclass
class VisionPlan:
    """What one tower call derives from its grids (host data), made before the tower runs: its
    tensors built on the host and moved to the device in one pinned copy without blocking, the
    attention segments made by the backend; the tower's compute then reads nothing back to the
    host and copies nothing to the device. Rows in the tower's order (P patches)."""

    angles: torch.Tensor  # [P, Dh/2] float32: each patch's rotary angles (`VisionRotary.angles`)
    frames: SegmentAttention  # one segment per frame of every image


class VisionTower(nn.Module):
    """A Qwen tower (`model.visual`, parameter names and shapes as transformers' at TP=1): a call is
    `plan` (everything derived from the grids: host work, one copy to the device) then `run`
    (device work alone, nothing read back), which each family defines."""

    cfg: QwenVisionConfig

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[Grid],
                attention: AttentionBackend = TORCH) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values: [P, patch_dim] (the processor's rows of these images, concatenated in
        order), grid_thw: one (t, h, w) per image in patches -> (embeddings [P / merge_unit,
        out_hidden_size] in the processor's order, one [P / merge_unit, out_hidden_size] feature
        tensor per deepstack layer: Qwen3-VL's, in block order as transformers gives them)."""
        check_grids(pixel_values, grid_thw, self.cfg)
        return self.run(pixel_values, self.plan(grid_thw, attention, pixel_values.device))

    def plan(self, grid_thw: list[Grid], attention: AttentionBackend, device: torch.device) -> VisionPlan:
        raise NotImplementedError

    def run(self, pixel_values: torch.Tensor, plan: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        raise NotImplementedError


class QKVParallelLinear(ParallelLinear):
    """The fused `qkv` Linear ([3 * D, D] in the checkpoint), split by heads: this rank holds its
    heads' rows of q, then of k, then of v (three checkpoint row ranges, one when they touch, as at
    tp.size == 1: the plain [3 * D, D] Linear). Its weight takes any `LinearMethod` (a quantized
    tower): each of the method's tensors is read range by range along the axis its shard slices
    (packed words, groups, blocks) and concatenated, as the ranges' rows are."""

    def __init__(self, hidden_size: int, num_heads: int, tp: TensorParallel = SINGLE, bias: bool = True) -> None:
        D = hidden_size
        per = tp.split(num_heads, "the vision tower's num_heads") * (D // num_heads)  # rows of q (or k, v)
        self.ranges = _touching([Shard(0, part * D + tp.rank * per, per) for part in range(3)])
        super().__init__(LinearShape(3 * per, D, self.ranges[0] if len(self.ranges) == 1 else None), None, bias)
        if bias:
            self.tp_shards["bias"] = self.ranges[0] if len(self.ranges) == 1 else self.ranges
        if len(self.ranges) > 1:
            self._hold_over_ranges(self.method)

    def set_method(self, method: LinearMethod) -> None:
        """Hold the weight as `method` does, its tensors read over this rank's row ranges."""
        if len(self.ranges) == 1:
            super().set_method(method)
        else:
            self._hold_over_ranges(method)

    def _hold_over_ranges(self, method: LinearMethod) -> None:
        """`method`'s tensors for each row range, stacked along the axis each one's shard slices."""
        for name in self.weight_names:
            delattr(self, name)
            self.tp_shards.pop(name, None)
        self.method = method
        parts = [_RangeHolder(method, LinearShape(r.length, self.shape.in_features, r)) for r in self.ranges]
        for attr in method.attrs:
            setattr(self, attr, getattr(parts[0], attr))
        for name in parts[0].weight_names:
            params = [getattr(part, name) for part in parts]
            shards = [part.tp_shards[name] for part in parts if name in part.tp_shards]
            if len(shards) < len(parts):  # not sliced by rows (a per-tensor scale): one, whole
                setattr(self, name, params[0])
                continue
            stacked = nn.Parameter(torch.cat([p.detach() for p in params], dim=shards[0].dim), requires_grad=False)
            stacked.__dict__.update(params[0].__dict__)  # the method's marks (`register`)
            setattr(self, name, stacked)
            self.tp_shards[name] = shards
        self.weight_names = list(parts[0].weight_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [P, D] -> [P, 3 * H * Dh]
        return self.method.apply(self, x, self.bias)


class _RangeHolder(nn.Module):
    """The tensors `method` registers for one row range of a weight, and the slice of each."""

    def __init__(self, method: LinearMethod, shape: LinearShape) -> None:
        super().__init__()
        self.tp_shards: dict[str, Shard] = {}
        self.weight_names: list[str] = []
        method.create_weights(self, shape)


def _touching(ranges: list[Shard]) -> list[Shard]:
    """Row ranges in order, each run of ranges that touch joined into one."""
    out = [ranges[0]]
    for r in ranges[1:]:
        last = out[-1]
        if last.start + last.length == r.start:
            out[-1] = Shard(0, last.start, last.length + r.length)
        else:
            out.append(r)
    return out


class VisionAttention(nn.Module):
    """`qkv` (column-parallel by head), 2-D rotary in float32, attention within segments, `proj`
    (row-parallel, all-reduced)."""

    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.num_heads = tp.split(cfg.num_heads, "the vision tower's num_heads")
        self.head_dim = cfg.head_dim
        self.qkv = QKVParallelLinear(cfg.hidden_size, cfg.num_heads, tp)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, True, tp, what="the vision tower's hidden_size")

    def forward(self, x: torch.Tensor, rope: Rope, segments: SegmentAttention) -> torch.Tensor:
        # x: [P, D] -> [P, D]
        P = x.shape[0]
        q, k, v = self.qkv(x).view(P, 3, self.num_heads, self.head_dim).unbind(1)  # each [P, H, Dh]
        q, k = segments.ops.rotary_float32(q, k, *rope)
        out = segments.attend(q, k, v, self.head_dim**-0.5)  # [P, H, Dh]
        return self.proj(out.reshape(P, -1))


class VisionBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm1(x)), then + mlp(norm2(x)); the norm and the MLP
    are the family's (RMSNorm and gated SiLU for Qwen2.5-VL, LayerNorm and GELU for Qwen3-VL).

    The stream is carried as the decoder's is (llama.py): (x, residual), their sum the block's
    input, added by the norm that reads it (`add_norm`; residual None: x is the whole stream).
    The small ops are the segments' backend's (`SegmentAttention.ops`): one fused launch each on
    the triton backend, PyTorch's op by op on the torch backend."""

    def __init__(self, cfg: QwenVisionConfig, tp: TensorParallel, norm: Callable[[int], nn.Module],
                 mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = norm(cfg.hidden_size)
        self.norm2 = norm(cfg.hidden_size)
        self.attn = VisionAttention(cfg, tp)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                segments: SegmentAttention) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [P, D] -> (the MLP's output, the stream before it)
        ops = segments.ops
        h, residual = add_norm(ops, self.norm1, x, residual)
        h, residual = add_norm(ops, self.norm2, self.attn(h, rope, segments), residual)
        return self.mlp(h, ops), residual

