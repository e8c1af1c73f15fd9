"""The small, torch-free types of the shared-memory object store that travel in messages."""

from __future__ import annotations

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
