"""The types every layer shares, torch-free and at the bottom of the import graph (ipc/ and
multimodal/ import them; they import neither): the multimodal item — the unit every cache layer
keys, stores and moves — and the small types of the shared-memory object store that travel in
messages in its place."""

from __future__ import annotations

from typing import Any

import msgspec


class ShmHandle(msgspec.Struct, frozen=True, array_like=True):
    """Where one entry lies; travels in messages in place of the item (~100 bytes)."""

    key: str
    offset: int
    chunk_id: int
    nbytes: int  # payload bytes
    tag: bytes


class ShmStoreInfo(msgspec.Struct, frozen=True):
    """What a reader needs to attach: the segment's name, its size and the handle secret."""

    name: str
    capacity: int
    secret: bytes


class PlaceholderRange(msgspec.Struct, frozen=True):
    """Where an item's placeholder tokens sit in the prompt: `length` tokens from `offset`."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """True when the token range [start, end) touches this placeholder range."""
        return self.offset < end and start < self.end


class MultiModalItem(msgspec.Struct):
    """One processed image (or other item) of one request.

    `data` holds the processor's output for this item alone, its pixels as uint8 codes and their
    values (ipc/pixel_codes.py), e.g. `{"pixel_codes": Tensor[3, H, W] uint8, "pixel_lut":
    Tensor[3, 256] float32}`; it is None while the item travels P0 -> P1
    as its hash alone (the engine core's IPC cache restores it) or as `shm_handle`, its place in
    the shared-memory object store (readers map it in place). `mm_hash` identifies the item's
    content (with model, processor settings and salt) for every cache layer.

    A video is one item per temporal group (modality "video", data shaped as an image's), so each
    group is cached, moved and encoded by itself: a group shared by two videos has one hash and one
    encoder output, wherever it sits.

    `position_key` is what the decoder's positions read of the item, declared by its family's
    P0 processor (`position_key`): () for LLaVA (1-D positions); the grid (t, h, w) for a Qwen-VL
    image or Qwen3-VL video group; the grid, the group's index in its video and its seconds per
    group for a Qwen2.5-VL video group (its temporal place). The model computes positions from
    it alone, and every prefix block the item overlaps carries it in its key (engine/block_hash.py);
    `mm_hash` (content) does not, so the encoder cache still shares a group wherever it sits.
    """

    modality: str
    mm_hash: str
    data: dict[str, Any] | None
    placeholder: PlaceholderRange
    shm_handle: ShmHandle | None = None
    position_key: tuple[int | float, ...] = ()
