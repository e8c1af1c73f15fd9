"""Items for the shared-memory store's tests: distinct bytes per index, and their comparison."""

from __future__ import annotations

import torch

from mmserve.item_store.shm_ring import HEADER_BYTES

ITEM_BYTES = 3 * 32 * 32 * 4  # one `item(i)`: 12 KiB of float32 pixels
CHUNK = HEADER_BYTES + 64 + ITEM_BYTES  # header, meta, pixels: the chunk one item takes


def item(i: int, hw: int = 32) -> dict[str, torch.Tensor]:
    """A pixel_values tensor whose every element depends on `i`: no two items share bytes."""
    return {"pixel_values": torch.arange(3 * hw * hw, dtype=torch.float32).view(3, hw, hw) + i * 1e4}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
