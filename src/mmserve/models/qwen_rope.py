"""M-RoPE: 3-D rotary positions (temporal, height, width) for the Qwen-VL decoders.

`mrope_positions` gives every token of a prompt its three position indices, as transformers'
`get_rope_index` (Qwen2.5-VL and Qwen3-VL) does for images: text runs sequentially on all three
axes; an image's placeholder tokens sit at `start + (t, row, column)` over its merged grid, where
`start` is the position after the text before it; text after an image resumes at the largest
position so far + 1 (5.x's refactor writes it as `start + max(h, w) / merge`, the same for an
image, whose temporal extent is 1). Generated tokens continue at `index + delta` on every axis.

`MRotaryEmbedding` turns [3, T] positions into cos / sin: the rotary half-dimension is split
into temporal, height and width frequencies by `mrope_section`, in blocks (Qwen2.5-VL) or
interleaved t, h, w, t, h, w, ... (Qwen3-VL).
"""

from __future__ import annotations

import torch
from torch import nn

ItemGrid = tuple[int, int, int, int]  # (placeholder offset, t, h, w) in patches before merging


def mrope_positions(token_ids: list[int], grids: list[ItemGrid], spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """Positions [3, len(token_ids)] int64 of a prompt whose images have `grids` (in prompt order),
    and the delta: token i >= len(token_ids) has position i + delta on every axis."""
    parts: list[torch.Tensor] = []
    index = next_pos = 0  # next token index, next position to give
    for offset, t, h, w in grids:
        if offset > index:  # text up to the image
            parts.append(torch.arange(next_pos, next_pos + offset - index).expand(3, -1))
            next_pos += offset - index
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
        parts.append(grid.reshape(3, -1) + next_pos)  # [3, t * gh * gw]
        index = offset + t * gh * gw
        next_pos += max(t, gh, gw)
    if len(token_ids) > index:
        parts.append(torch.arange(next_pos, next_pos + len(token_ids) - index).expand(3, -1))
        next_pos += len(token_ids) - index
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.int64)
    return positions, next_pos - len(token_ids)


class MRotaryEmbedding(nn.Module):
    """cos / sin of [3, T] positions (or [T]: the same on every axis), rotate-half layout."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, int, int], interleaved: bool) -> None:
        super().__init__()
        # a plain float32 attribute, not a buffer (see layers.RotaryEmbedding)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self.inv_freq = 1.0 / (theta**exponents)  # [Dh/2]
        self.axis = _axis_of_frequency(mrope_section, interleaved)  # [Dh/2]: which axis drives each

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T] or [T] -> cos, sin: [T, 1, Dh]."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        freqs = positions.float()[:, :, None] * self.inv_freq  # [3, T, Dh/2]
        freqs = freqs.gather(0, self.axis.expand(1, freqs.shape[1], -1))[0]  # [T, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, Dh]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def _axis_of_frequency(section: tuple[int, int, int], interleaved: bool) -> torch.Tensor:
    """For each rotary frequency, the axis (0 t, 1 h, 2 w) whose position drives it."""
    n = sum(section)  # tensors made on the CPU explicitly: models are built under the meta device
    if not interleaved:  # blocks: section[0] temporal, then height, then width
        return torch.cat([torch.full((size,), axis, device="cpu") for axis, size in enumerate(section)])
    axis = torch.zeros(n, dtype=torch.int64, device="cpu")  # t, h, w, t, h, w, ... while each has some left
    for a in (1, 2):
        axis[a:section[a] * 3:3] = a
    return axis
