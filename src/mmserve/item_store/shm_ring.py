"""A ring of chunks in one shared-memory segment: one writer allocates, readers pin with locks.

Layout. The segment (shm_segment: naming, space, cleanup after crashes) is `capacity` bytes,
tiled by chunks whose offsets and sizes are multiples of `ALIGN`. A live chunk is a 64-byte
header `(magic, state, chunk id, payload bytes, 16-byte tag)` and its payload; free chunks exist
only in the writer's memory. Chunk ids count up from 1 and are never reused, and the tag is a MAC
(made by the owner's `sign`) found nowhere in the segment but in its own header, so a header
matches `(offset, id, nbytes, tag)` only while that very allocation is live.

Allocation: a CLOCK hand over the ring. `allocate` grows a free run from the hand. A free chunk
joins it; a cold live chunk is evicted into it; a hot one (`hits` > 0, one per hit, given by the
owner) spends a hit and is moved to the start of the run, i.e. re-inserted at the tail with a new
id (one already at the start stays put), so the run stays contiguous; a pinned one (`pins` > 0,
or read-locked) is skipped: the run ends before it and restarts after it. A pinned chunk thus
costs only its own bytes, never the eviction of everything behind it. At the end of the segment
the run restarts at 0. After walking twice the capacity without a run of the size asked,
`allocate` gives None (so a refused allocation costs at most two turns of the hand).

Reader protocol. A reader pins a chunk with a shared OFD byte lock on the chunk's first byte,
then checks its header; the writer evicts or moves a chunk only under the exclusive lock on that
byte, and marks the header dead before unlocking. The kernel serialises the two, so a header a
reader validated stays live until it unlocks: a chunk is never freed or moved while any reader
holds it. The kernel's lock table is the chunk's reader counter: Python has no atomic
read-modify-write on shared memory, and a counter in the header would stay raised by a reader
that died. Readers map the segment read-only, so no reader can corrupt what others read.

Crash recovery. A lock belongs to the reader's open file, and the kernel drops it when the reader
dies, whatever killed it: a dead reader never wedges the ring, and there is nothing to reclaim.

Not thread-safe: one thread per `ShmRing` / `ShmRingReader`. Linux only (OFD locks, /dev/shm).
"""

from __future__ import annotations

import fcntl
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from mmserve.ipc.shm_segment import (create_segment, lock_held, open_segment, remove_stale_segments, try_lock,
                                     unlink_segment, unmap_segment)

ALIGN = 64  # bytes; chunk offsets and sizes are multiples of it
HEADER = struct.Struct("<IIQQ16s")  # magic, state, chunk id, payload bytes, tag
HEADER_BYTES = 64
MAGIC = 0x6D6D7368
LIVE, DEAD = 1, 2
MAX_HITS = 3  # a chunk survives at most this many passes of the hand without a new hit
_DEAD_HEADER = HEADER.pack(MAGIC, DEAD, 0, 0, bytes(16))


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(eq=False)
class Chunk:
    """The writer's record of one tile [offset, offset + size); free when `chunk_id` is None.

    A live chunk whose `key` is None is an orphan: cleared while a reader held it, freed by
    the hand once no reader does."""

    offset: int
    size: int  # header included
    chunk_id: int | None = None
    nbytes: int = 0  # payload bytes
    tag: bytes = b""
    key: str | None = None
    hits: int = 0  # 0..MAX_HITS, CLOCK second chances left
    pins: int = 0  # writer-side pins (in-flight requests)

    @property
    def end(self) -> int:
        return self.offset + self.size

    @property
    def live(self) -> bool:
        return self.chunk_id is not None


class ShmRing:
    """The writer side: owns the segment, the chunk tiling and the CLOCK hand.

    `sign(chunk)` makes the tag of a chunk from its key, offset, id and nbytes; `on_evict(chunk)`
    is told of every keyed chunk the hand evicts (not of moves: the Chunk object is updated)."""

    def __init__(self, capacity: int, sign: Callable[[Chunk], bytes],
                 on_evict: Callable[[Chunk], None]) -> None:
        if capacity < ALIGN or capacity % ALIGN:
            raise ValueError(f"capacity must be a positive multiple of {ALIGN} bytes; got {capacity}")
        remove_stale_segments()
        self.capacity = capacity
        self.name, self._fd, self._map = create_segment(capacity)
        self.closed = False
        self._buf = memoryview(self._map)
        self._sign, self._on_evict = sign, on_evict
        self._chunks: dict[int, Chunk] = {0: Chunk(0, capacity)}  # offset -> tile
        self._hand = 0
        self._next_id = 1
        self.num_evictions = self.num_relocations = 0

    def allocate(self, nbytes: int, key: str) -> Chunk | None:
        """A live chunk for `nbytes` of payload (header written, payload not), or None."""
        need = HEADER_BYTES + align(nbytes)
        if need > self.capacity:
            return None
        start = cursor = self._hand  # the free run is [start, cursor)
        walked = 0
        while cursor - start < need:
            if cursor == self.capacity or walked > 2 * self.capacity:
                self._mark_free(start, cursor)
                if walked > 2 * self.capacity:
                    self._hand = cursor % self.capacity
                    return None
                start = cursor = 0
                continue
            chunk = self._chunks.pop(cursor)
            walked += chunk.size
            cursor = chunk.end
            new_start = self._fold(chunk, start)
            if new_start is None:  # pinned: it stays, the run restarts after it
                self._chunks[chunk.offset] = chunk
                self._mark_free(start, chunk.offset)
                new_start = chunk.end
            start = new_start
        self._mark_free(start + need, cursor)
        self._hand = (start + need) % self.capacity
        chunk = self._chunks[start] = Chunk(start, need, nbytes=nbytes, key=key)
        self._publish(chunk)
        return chunk

    def payload(self, chunk: Chunk) -> memoryview:
        """The writable payload of a live chunk."""
        begin = chunk.offset + HEADER_BYTES
        return self._buf[begin:begin + chunk.nbytes]

    def clear(self) -> None:
        """Mark every live chunk dead; reader-locked ones stay as orphans until released."""
        for chunk in list(self._chunks.values()):
            if chunk.live and self._kill(chunk):
                self._chunks[chunk.offset] = Chunk(chunk.offset, chunk.size)
            elif chunk.live:  # a reader holds it: invalidate anyway, keep its bytes
                self.orphan(chunk)
                chunk.pins = 0

    def orphan(self, chunk: Chunk) -> None:
        """Invalidate a live chunk now.

        Invalidate a live chunk now: its header reads dead, so no handle resolves to it any more
        (readers that hold it keep their views); the hand frees it once nobody pins or holds it."""
        self._buf[chunk.offset:chunk.offset + HEADER.size] = _DEAD_HEADER
        chunk.key, chunk.hits = None, 0

    def chunks(self) -> list[Chunk]:
        """The tiles in offset order."""
        return [self._chunks[offset] for offset in sorted(self._chunks)]

    def is_read_locked(self, chunk: Chunk) -> bool:
        return lock_held(self._fd, chunk.offset)

    def close(self) -> None:
        """Unlink the segment; readers keep what they mapped."""
        if self.closed:
            return
        self.closed = True
        unlink_segment(self.name)
        unmap_segment(self._buf, self._map)
        os.close(self._fd)

    def check_integrity(self) -> None:
        end, ids = 0, set()
        for chunk in self.chunks():
            assert chunk.offset == end and chunk.size > 0 and chunk.size % ALIGN == 0, chunk
            end = chunk.end
            if chunk.live:
                assert chunk.chunk_id is not None, chunk
                assert chunk.chunk_id not in ids and chunk.chunk_id < self._next_id, chunk
                ids.add(chunk.chunk_id)
                assert HEADER_BYTES + chunk.nbytes <= chunk.size and 0 <= chunk.hits <= MAX_HITS
                header = HEADER.unpack_from(self._buf, chunk.offset)
                state = DEAD if chunk.key is None else LIVE
                assert header[:2] == (MAGIC, state), (chunk, header)
                if chunk.key is not None:
                    assert header[2:] == (chunk.chunk_id, chunk.nbytes, chunk.tag), (chunk, header)
        assert end == self.capacity and 0 <= self._hand < self.capacity

    def _fold(self, chunk: Chunk, start: int) -> int | None:
        """Fold a chunk into the free run before it.

        Fold `chunk` (popped at the run's end) into the free run [start, chunk.offset): the
        run's new start, or None when the chunk is pinned and must stay."""
        if not chunk.live:
            return start
        if chunk.pins:
            return None
        if chunk.hits and chunk.key is not None:  # second chance: re-insert at the run's start
            if start != chunk.offset and not self._kill(chunk):
                return None
            chunk.hits -= 1
            if start != chunk.offset:
                self._move(chunk, start)
            self._chunks[chunk.offset] = chunk
            return chunk.end
        if not self._kill(chunk):
            return None
        if chunk.key is not None:
            self.num_evictions += 1
            self._on_evict(chunk)
        return start

    def _kill(self, chunk: Chunk) -> bool:
        """Mark the header dead under the exclusive lock; False if a reader holds the chunk."""
        if not try_lock(self._fd, fcntl.F_WRLCK, chunk.offset):
            return False
        try:
            self._buf[chunk.offset:chunk.offset + HEADER.size] = _DEAD_HEADER
        finally:
            try_lock(self._fd, fcntl.F_UNLCK, chunk.offset)
        return True

    def _move(self, chunk: Chunk, offset: int) -> None:
        src = chunk.offset + HEADER_BYTES
        dst = offset + HEADER_BYTES
        self._buf[dst:dst + chunk.nbytes] = self._buf[src:src + chunk.nbytes]  # memmove
        chunk.offset = offset
        self.num_relocations += 1
        self._publish(chunk)

    def _publish(self, chunk: Chunk) -> None:
        chunk.chunk_id, self._next_id = self._next_id, self._next_id + 1
        chunk.tag = self._sign(chunk)
        HEADER.pack_into(self._buf, chunk.offset, MAGIC, LIVE, chunk.chunk_id, chunk.nbytes, chunk.tag)

    def _mark_free(self, start: int, end: int) -> None:
        if end > start:
            self._chunks[start] = Chunk(start, end - start)


class ShmRingReader:
    """A reader of one ring: maps it read-only and pins chunks with shared locks."""

    def __init__(self, name: str) -> None:
        self._fd, self._map = open_segment(name)
        self.closed = False
        self.capacity = len(self._map)
        self.buffer = memoryview(self._map)
        self._held: dict[int, int] = {}  # chunk offset -> acquires not yet released

    def acquire(self, offset: int, chunk_id: int, nbytes: int, tag: bytes) -> memoryview | None:
        """The payload of that chunk, pinned until `release(offset)`; None if it is gone."""
        if offset % ALIGN or not 0 <= offset <= self.capacity - HEADER_BYTES - nbytes:
            raise ValueError(f"chunk [{offset}, +{nbytes}) is outside the segment")
        held = self._held.get(offset, 0)
        if not held and not try_lock(self._fd, fcntl.F_RDLCK, offset):
            return None  # the writer is evicting it right now
        if HEADER.unpack_from(self.buffer, offset) != (MAGIC, LIVE, chunk_id, nbytes, tag):
            if not held:
                try_lock(self._fd, fcntl.F_UNLCK, offset)
            return None
        self._held[offset] = held + 1
        begin = offset + HEADER_BYTES
        return self.buffer[begin:begin + nbytes]

    def release(self, offset: int) -> None:
        left = self._held[offset] - 1
        if left:
            self._held[offset] = left
        else:
            del self._held[offset]
            try_lock(self._fd, fcntl.F_UNLCK, offset)

    @property
    def num_held(self) -> int:
        return sum(self._held.values())

    def close(self) -> None:
        """Drop every pin (views handed out must no longer be used) and unmap."""
        if self.closed:
            return
        self.closed = True
        os.close(self._fd)  # drops this reader's locks
        self._held.clear()
        unmap_segment(self.buffer, self._map)

