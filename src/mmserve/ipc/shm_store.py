"""Shared-memory object store: P0 writes each processed item once; P1 and every TP worker read
it in place by handle (`--mm-cache-type shm`).

Contract.
- `ShmStore` is the single writer (P0). `put(key, item)` lays an absent key's tensors out in one
  `ShmRing` chunk (`u32 meta length | msgpack [[name, dtype, shape, offset, nbytes], ...] |
  tensor bytes`, each tensor 64-byte aligned) and returns a `ShmHandle`; a present key returns
  its handle without writing (a key names its content: same key, same bytes).
- `lookup(key)` is the counted query; a hit gives the entry a CLOCK second chance (up to
  `MAX_HITS`), so entries that keep getting hits outlive cold ones (policy: see shm_ring).
- `put` / `lookup` with a `request_id` pin the entry until `finish_request(request_id)`: a pinned
  entry is neither evicted nor moved, so the handles an in-flight request carries stay valid.
  Entries nobody pins or reads are evicted by the ring's hand when room is needed.
- `put` returns None when the item exceeds `max_object_bytes` or no contiguous run can be freed
  (pins everywhere); the caller sends the item inline. A refused put may have evicted cold
  entries on its way; it writes nothing.
- Handles carry `tag` = keyed BLAKE2b (a MAC, like HMAC) of (offset, chunk id, nbytes, key) under
  a per-store secret that readers get in `ShmStoreInfo` at attach time and that is never written
  to the segment. A reader raises ShmHandleError for a tag that does not verify (forged,
  tampered, another store's) and returns None for a stale handle (entry evicted, moved or
  cleared): the chunk header must hold the same id and tag, which no other allocation can.
- `ShmStoreReader.get(handle)` returns a `ShmLease`: zero-copy, read-only tensor views, valid
  until `release()`; the reader's lock keeps the chunk alive until then. Clone what you keep.
- `clear()` invalidates every handle and drops every pin; chunks a reader holds are freed after.

Not thread-safe: one thread per store / reader.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import struct
import warnings
from collections import Counter
from collections.abc import Mapping

import msgspec
import torch

from mmserve.ipc.serial import tensor_bytes, tensor_from_bytes
from mmserve.ipc.items import ShmHandle, ShmStoreInfo
from mmserve.ipc.shm_ring import ALIGN, HEADER_BYTES, MAX_HITS, Chunk, ShmRing, ShmRingReader, align

_SIGNED = struct.Struct("<QQQ")  # offset, chunk id, nbytes; the key's UTF-8 follows
_U32 = struct.Struct("<I")
_Specs = list[tuple[str, str, list[int], int, int]]  # name, dtype, shape, offset, nbytes
_META_ENCODER = msgspec.msgpack.Encoder()
_META_DECODER = msgspec.msgpack.Decoder(_Specs)


class ShmHandleError(ValueError):
    """A handle this store did not make (forged, tampered with, or another store's)."""


@dataclasses.dataclass
class ShmStoreStats:
    """The writer's counters since start and its current size (metrics layer "shm")."""

    queries: int = 0  # lookup() calls
    hits: int = 0  # lookup() calls that found the key
    puts: int = 0  # items written
    bytes_written: int = 0  # payload bytes put() wrote
    bytes_saved: int = 0  # payload bytes of every handle handed out: kept off the P0 -> P1 wire
    evictions: int = 0  # entries the hand evicted or clear() dropped
    relocations: int = 0  # hot entries re-inserted at the tail
    fallbacks_oversize: int = 0  # put() refused: over max_object_bytes
    fallbacks_full: int = 0  # put() refused: no contiguous room could be freed
    entries: int = 0
    bytes_used: int = 0  # chunk bytes of the entries, headers included

    @property
    def fallbacks(self) -> int:
        return self.fallbacks_oversize + self.fallbacks_full


class ShmStore:
    """The single writer: keys -> entries in a shared-memory ring of `capacity_bytes`."""

    def __init__(self, capacity_bytes: int, max_object_bytes: int | None = None) -> None:
        capacity = capacity_bytes // ALIGN * ALIGN
        self._secret = secrets.token_bytes(32)
        self.max_object_bytes = min(capacity - HEADER_BYTES, capacity if max_object_bytes is None else max_object_bytes)
        self._entries: dict[str, Chunk] = {}
        self._requests: dict[str, list[Chunk]] = {}  # request id -> entries it pins
        self._stats = ShmStoreStats()
        self._ring = ShmRing(capacity, self._sign_chunk, self._on_evict)
        self._reader: ShmStoreReader | None = None

    @classmethod
    def from_flags(cls, mm_shm_cache_gb: float, mm_shm_max_object_mb: float) -> ShmStore:
        """Sized by `--mm-shm-cache-gb` (GiB) and `--mm-shm-max-object-mb` (MiB)."""
        return cls(int(mm_shm_cache_gb * 2**30), int(mm_shm_max_object_mb * 2**20))

    @property
    def info(self) -> ShmStoreInfo:
        return ShmStoreInfo(self._ring.name, self._ring.capacity, self._secret)

    def contains(self, key: str) -> bool:
        """Whether `key` has an entry; counts nothing, touches nothing."""
        return key in self._entries

    def lookup(self, key: str, request_id: str | None = None) -> ShmHandle | None:
        """The handle of `key` (a hit: one more second chance), pinned for `request_id`; or None."""
        self._stats.queries += 1
        chunk = self._entries.get(key)
        if chunk is None:
            return None
        self._stats.hits += 1
        chunk.hits = min(chunk.hits + 1, MAX_HITS)
        return self._hand_out(chunk, request_id)

    def put(self, key: str, item: Mapping[str, torch.Tensor], request_id: str | None = None) -> ShmHandle | None:
        """Write `item` under `key` unless present; its handle, or None (too big, or no room)."""
        chunk = self._entries.get(key)
        if chunk is not None:
            return self._hand_out(chunk, request_id)
        meta, placements, nbytes = _layout(item)
        if nbytes > self.max_object_bytes:
            self._stats.fallbacks_oversize += 1
            return None
        chunk = self._ring.allocate(nbytes, key)
        if chunk is None:
            self._stats.fallbacks_full += 1
            return None
        _write(self._ring.payload(chunk), meta, placements)
        self._entries[key] = chunk
        self._stats.puts += 1
        self._stats.bytes_written += nbytes
        return self._hand_out(chunk, request_id)

    def discard(self, key: str) -> None:
        """Drop `key`'s entry (written for a request that then never reached a reader): the chunk
        becomes an orphan that the hand frees; handles to it no longer resolve."""
        chunk = self._entries.pop(key, None)
        if chunk is not None:
            chunk.key, chunk.hits = None, 0

    def finish_request(self, request_id: str) -> None:
        """Unpin what `request_id` pinned; an unknown id is ignored (finish and abort may both call)."""
        for chunk in self._requests.pop(request_id, ()):
            chunk.pins -= 1

    def pinned_requests(self) -> list[str]:
        """The ids of the requests that pin entries now (none once every request finished)."""
        return sorted(self._requests)

    def get(self, handle: ShmHandle) -> ShmLease | None:
        """Read through this process's own reader (tests, P0); see `ShmStoreReader.get`."""
        if self._reader is None:
            self._reader = ShmStoreReader(self.info)
        return self._reader.get(handle)

    def reader(self) -> ShmStoreReader:
        """A new reader of this store (its own open file, so its own locks)."""
        return ShmStoreReader(self.info)

    def clear(self) -> None:
        """Drop every entry and pin; every handle made so far is stale from now on."""
        self._stats.evictions += len(self._entries)
        self._entries.clear()
        self._requests.clear()
        self._ring.clear()

    @property
    def stats(self) -> ShmStoreStats:
        """A snapshot."""
        return dataclasses.replace(self._stats, relocations=self._ring.num_relocations,
                                   entries=len(self._entries),
                                   bytes_used=sum(chunk.size for chunk in self._entries.values()))

    def close(self) -> None:
        """Unlink the segment (readers keep what they mapped)."""
        if self._reader is not None:
            self._reader.close()
        self._ring.close()

    def __enter__(self) -> ShmStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_integrity(self) -> None:
        self._ring.check_integrity()
        live = {chunk.key: chunk for chunk in self._ring.chunks() if chunk.live and chunk.key is not None}
        assert live.keys() == self._entries.keys(), (live.keys(), self._entries.keys())
        pins = Counter(id(chunk) for chunks in self._requests.values() for chunk in chunks)
        for key, chunk in self._entries.items():
            assert live[key] is chunk and chunk.tag == self._sign_chunk(chunk), key
            assert chunk.pins == pins.pop(id(chunk), 0), key
        assert not pins, "a request pins an entry that is gone"

    def _hand_out(self, chunk: Chunk, request_id: str | None) -> ShmHandle:
        if request_id is not None:
            chunk.pins += 1
            self._requests.setdefault(request_id, []).append(chunk)
        self._stats.bytes_saved += chunk.nbytes
        assert chunk.key is not None and chunk.chunk_id is not None
        return ShmHandle(chunk.key, chunk.offset, chunk.chunk_id, chunk.nbytes, chunk.tag)

    def _sign_chunk(self, chunk: Chunk) -> bytes:
        assert chunk.key is not None and chunk.chunk_id is not None
        return _sign(self._secret, chunk.key, chunk.offset, chunk.chunk_id, chunk.nbytes)

    def _on_evict(self, chunk: Chunk) -> None:
        del self._entries[chunk.key]  # type: ignore[arg-type]  # the ring tells keyed chunks only
        self._stats.evictions += 1


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
        tag = _sign(self._secret, handle.key, handle.offset, handle.chunk_id, handle.nbytes)
        if not hmac.compare_digest(tag, handle.tag):
            raise ShmHandleError(f"handle for {handle.key!r} does not verify: not made by this store")
        payload = self._ring.acquire(handle.offset, handle.chunk_id, handle.nbytes, handle.tag)
        if payload is None:
            self.num_stale += 1
            return None
        try:
            data = _tensors(payload)
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


def _sign(secret: bytes, key: str, offset: int, chunk_id: int, nbytes: int) -> bytes:
    mac = hashlib.blake2b(_SIGNED.pack(offset, chunk_id, nbytes), digest_size=16, key=secret,
                          person=b"mmserve-shm")
    mac.update(key.encode())
    return mac.digest()


def _layout(item: Mapping[str, torch.Tensor]) -> tuple[bytes, list[tuple[int, memoryview]], int]:
    """The msgpack meta, each tensor's (payload offset, bytes), and the payload size.

    TypeError (before anything is written) for a value that is not a dense tensor."""
    specs: _Specs = []
    views = []
    offset = 0  # from the first tensor's byte
    for name, tensor in item.items():
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(f"the shared-memory store holds dense tensors only; {name!r} is a {type(tensor)}")
        view = tensor_bytes(tensor)  # no copy for a contiguous CPU tensor
        specs.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, view.nbytes))
        views.append(view)
        offset = align(offset + view.nbytes)
    meta = _META_ENCODER.encode(specs)
    start = align(_U32.size + len(meta))
    return meta, [(start + spec[3], view) for spec, view in zip(specs, views)], start + offset


def _write(payload: memoryview, meta: bytes, placements: list[tuple[int, memoryview]]) -> None:
    _U32.pack_into(payload, 0, len(meta))
    payload[_U32.size:_U32.size + len(meta)] = meta
    for offset, view in placements:
        payload[offset:offset + view.nbytes] = view


def _tensors(payload: memoryview) -> dict[str, torch.Tensor]:
    (meta_len,) = _U32.unpack_from(payload)
    specs = _META_DECODER.decode(payload[_U32.size:_U32.size + meta_len])
    start = align(_U32.size + meta_len)
    data = {}
    for name, dtype_name, shape, offset, nbytes in specs:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown tensor dtype {dtype_name!r}")
        data[name] = tensor_from_bytes(payload[start + offset:start + offset + nbytes], dtype, shape)
    return data
