"""The readers of the shared-memory item store (`item_store/shm_store.py`).

P1, every TP worker, and with several API servers each server. A reader attaches by `ShmStoreInfo`, verifies a handle's
tag, and maps the entry's tensors in place under a lease (its read lock keeps the chunk alive)."""

from __future__ import annotations

import hashlib
import hmac
import struct
import warnings

import torch

from mmserve.ipc.items import ShmHandle, ShmStoreInfo
from mmserve.item_store.shm_layout import read_tensors
from mmserve.item_store.shm_ring import ALIGN, ShmRingReader

_SIGNED = struct.Struct("<QQQ")  # offset, chunk id, nbytes; the key's UTF-8 follows


class ShmHandleError(ValueError):
    """A handle this store did not make (forged, tampered with, or another store's)."""


class ShmLease:
    """One reader's pin on one entry: `data` views shared memory until `release()`."""

    def __init__(self, ring: ShmRingReader, offset: int, data: dict[str, torch.Tensor]) -> None:
        self._ring: ShmRingReader | None = ring
        self._offset = offset
        self.data = data  # read-only views; writing to one faults

    def clone(self) -> dict[str, torch.Tensor]:
        """Private, writable copies of the tensors (what a reader keeps past `release`)."""
        return {name: tensor.clone() for name, tensor in self.data.items()}

    def release(self) -> None:
        """Unpin; the views must not be used afterwards. Idempotent."""
        if self._ring is not None:
            self._ring.release(self._offset)
            self._ring, self.data = None, {}

    def __enter__(self) -> ShmLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ShmStoreReader:
    """A reader (P1, a TP worker): attaches by `ShmStoreInfo`, reads entries in place."""

    def __init__(self, info: ShmStoreInfo) -> None:
        self._secret = info.secret
        self._ring = ShmRingReader(info.name)
        if self._ring.capacity != info.capacity:
            raise ValueError(f"segment {info.name} holds {self._ring.capacity} bytes, not {info.capacity}")
        self.num_stale = 0  # gets that found their entry gone
        with warnings.catch_warnings():  # torch warns once per process about read-only buffers
            warnings.simplefilter("ignore")
            torch.frombuffer(self._ring.buffer[:ALIGN], dtype=torch.uint8)

    def get(self, handle: ShmHandle) -> ShmLease | None:
        """The entry's tensors, pinned until the lease is released; None if the entry is gone."""
        tag = sign(self._secret, handle.key, handle.offset, handle.chunk_id, handle.nbytes)
        if not hmac.compare_digest(tag, handle.tag):
            raise ShmHandleError(f"handle for {handle.key!r} does not verify: not made by this store")
        payload = self._ring.acquire(handle.offset, handle.chunk_id, handle.nbytes, handle.tag)
        if payload is None:
            self.num_stale += 1
            return None
        try:
            data = read_tensors(payload)
        except BaseException:
            self._ring.release(handle.offset)
            raise
        return ShmLease(self._ring, handle.offset, data)

    @property
    def num_held(self) -> int:
        """Leases not yet released."""
        return self._ring.num_held

    def close(self) -> None:
        """Drop every lease (their views must no longer be used) and detach."""
        self._ring.close()


def sign(secret: bytes, key: str, offset: int, chunk_id: int, nbytes: int) -> bytes:
    """The tag of a handle: keyed BLAKE2b (a MAC) of (offset, chunk id, nbytes, key)."""
    mac = hashlib.blake2b(_SIGNED.pack(offset, chunk_id, nbytes), digest_size=16, key=secret,
                          person=b"mmserve-shm")
    mac.update(key.encode())
    return mac.digest()
