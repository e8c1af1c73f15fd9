"""M-RoPE: the 3-D rotary positions (temporal, height, width) of the Qwen-VL decoders.

`mrope_positions` gives each prompt token its three position indices, as transformers'
`get_rope_index` does:

- text runs sequentially, the same index on all three axes;
- an item's placeholder tokens sit at `start + (t_index * temporal_step, row, column)` over its
  merged grid (`row < h / merge`, `column < w / merge`), `start` being the position after what
  precedes it;
- text after an item resumes at the largest position so far + 1;
- a token i past the prompt (generated) has position `i + delta` on every axis.

transformers 5.23 (`Qwen2_5_VLModel.get_rope_index`, `Qwen3VLModel.get_rope_index`) agree for
images, whose grids have t = 1 and step 1. They differ for video: Qwen2.5-VL steps the temporal
index by `tokens_per_second * second_per_grid_ts` over a t > 1 grid; Qwen3-VL splits a video
into t = 1 grids, one per temporal group (step irrelevant), separated by timestamp text. Both
5.23 versions resume text at `start + max(h, w) / merge` rather than max + 1: the same for a
t = 1 grid, lower for a Qwen2.5-VL video whose scaled temporal extent exceeds the spatial one.
We follow the models' original code (transformers 4.5x) and vLLM there: max + 1.

`MRotaryEmbedding` turns [3, T] positions into rotate-half cos / sin: each rotary frequency
(of Dh / 2) takes its angle from one axis, chosen by `mrope_section` in blocks (Qwen2.5-VL:
temporal, then height, then width) or interleaved t, h, w, t, h, w, ... (Qwen3-VL, the tail
temporal), as transformers' `recomposition_frequencies` does (formerly
`apply_multimodal_rotary_pos_emb` / `apply_interleaved_mrope`).
"""

from __future__ import annotations

import torch
from torch import nn

ItemGrid = tuple[int, int, int, int]  # (placeholder offset, t, h, w); t, h, w in patches before merging


def mrope_positions(token_ids: list[int], grids: list[ItemGrid], spatial_merge_size: int,
                    temporal_steps: list[float] | None = None) -> tuple[torch.Tensor, int]:
    """Positions [3, L] int64 of a prompt of L tokens, and delta (token i >= L is at i + delta).

    `grids`: one (offset, t, h, w) per item in prompt order; its t*h*w / merge² placeholder tokens
    start at token `offset`. `temporal_steps`: per item, the temporal position step per temporal
    patch (Qwen2.5-VL video: `tokens_per_second * second_per_grid_ts`); None means 1 for all.
    """
    L = len(token_ids)
    steps = temporal_steps if temporal_steps is not None else [1.0] * len(grids)
    if len(steps) != len(grids):
        raise ValueError(f"{len(grids)} grids but {len(steps)} temporal steps")
    parts: list[torch.Tensor] = []
    index = next_pos = 0  # next token index to place, next position to give
    for (offset, t, h, w), step in zip(grids, steps):
        if offset < index:
            raise ValueError(f"an item at token {offset} overlaps the one before (ends at {index})")
        parts.append(_text_positions(next_pos, offset - index))
        next_pos += offset - index
        item = _grid_positions(next_pos, t, h, w, spatial_merge_size, step)  # [3, n]
        parts.append(item)
        index = offset + item.shape[1]
        next_pos = int(item.max()) + 1 if item.numel() else next_pos
    if index > L:
        raise ValueError(f"the last item's placeholders end at token {index}, past the prompt ({L})")
    parts.append(_text_positions(next_pos, L - index))
    next_pos += L - index
    return torch.cat(parts, dim=1), next_pos - L


def _text_positions(start: int, n: int) -> torch.Tensor:
    """[3, n]: start, start + 1, ... on every axis."""
    return torch.arange(start, start + n, dtype=torch.int64).expand(3, -1)


def _grid_positions(start: int, t: int, h: int, w: int, merge: int, step: float) -> torch.Tensor:
    """[3, t * gh * gw] in (t, row, column) order: start + (floor(t_index * step), row, column).

    The temporal product is taken in float32 as transformers 5.23 does (`arange(t) * interval`).
    """
    if h % merge or w % merge:
        raise ValueError(f"grid {h}x{w} patches does not divide by spatial_merge_size {merge}")
    gh, gw = h // merge, w // merge
    temporal = (torch.arange(t) * torch.tensor(step, dtype=torch.float32)).long()  # [t]
    axes = torch.meshgrid(temporal, torch.arange(gh), torch.arange(gw), indexing="ij")
    return torch.stack(axes).reshape(3, -1) + start


class MRotaryEmbedding(nn.Module):
    """cos / sin of [3, T] positions (or [T]: the same on every axis), rotate-half layout."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, int, int] | list[int],
                 interleaved: bool) -> None:
        super().__init__()
        if 2 * sum(mrope_section) != head_dim:
            raise ValueError(f"mrope_section {tuple(mrope_section)} must sum to head_dim / 2 ({head_dim // 2})")
        # plain float32 / int64 attributes made on the CPU, not buffers (see layers.RotaryEmbedding)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self.inv_freq = 1.0 / (theta**exponents)  # [Dh/2]
        t, h, w = mrope_section
        self.axis = frequency_axes((t, h, w), interleaved)  # [Dh/2]: 0 t, 1 h, 2 w

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T] or [T] int64 -> cos, sin: [T, 1, Dh] (broadcast over heads)."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        device = positions.device
        per_freq = positions[self.axis.to(device)].float().t()  # [T, Dh/2]: each frequency's axis
        freqs = per_freq * self.inv_freq.to(device)  # [T, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, Dh]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def frequency_axes(section: tuple[int, int, int], interleaved: bool) -> torch.Tensor:
    """For each of the sum(section) rotary frequencies, the axis (0 t, 1 h, 2 w) driving it.

    Blocks: section[0] temporal, then section[1] height, then section[2] width. Interleaved:
    frequency j is height when j % 3 == 1 and j < 3 * section[1], width when j % 3 == 2 and
    j < 3 * section[2], temporal otherwise.
    """
    n = sum(section)
    if not interleaved:
        return torch.cat([torch.full((size,), axis, dtype=torch.int64, device="cpu")
                          for axis, size in enumerate(section)])
    axis = torch.zeros(n, dtype=torch.int64, device="cpu")
    for a in (1, 2):
        axis[a:3 * section[a]:3] = a
    return axis
