"""One writer, N readers: a ring of message slots in shared memory (P1's step broadcast to workers).

Layout. One segment (shm_segment: per-instance name, /dev/shm space check, unlinked at close, at
exit and on SIGTERM; a SIGKILLed writer's segment goes in the next writer's stale sweep) holds
`num_slots` slots of `SLOT_HEADER + slot_bytes` bytes. Slot header: byte 0 `written`, byte 1 + i
reader i's `read` flag, and at `_META_AT` the message's (seq, kind, nbytes). An INLINE payload is
the message's frames (serial.py) as `u32 count, u64 length * count, bytes...`.

Protocol. Flags are single bytes, so each store to one is atomic; `_fence()` orders the payload
against them (a no-op on x86's TSO, a real barrier elsewhere).
- writer, message seq n, slot n % K: wait until `written` is 0 or every `read` flag is 1; then
  `written` = 0, every `read` = 0, payload and header, fence, `written` = 1.
- reader i, expecting seq n at slot n % K: wait until its `read` flag is 0 and then `written` is 1
  (in that order: having seen its flag cleared it cannot see the stale `written` of the message
  before), copy the payload out, fence, `read` = 1. The header's seq must be n.
So every reader gets every message once, in order, and the writer never overwrites a slot that a
reader has not copied out. A reader copies before it acknowledges, so decoded tensors never alias
the ring.

Overflow. A message bigger than `slot_bytes` travels over ZMQ: the writer sends its frames on
reader i's PUSH socket (one per reader, bound by the writer) and then publishes a slot of kind
OVERFLOW; a reader meeting one receives the message from its socket. Order is kept: every
message still takes one slot.

Waiting. Both sides spin with sched_yield for a short while, then sleep with a backoff up to
`_MAX_SLEEP_S` (the latency an idle reader adds to the next message). Each wait is bounded by
`timeout_s`, and calls `on_wait()` about every `_CHECK_EVERY_S`: the caller checks its peers
there (and raises to give up). A reader that died never acknowledges, so the writer would wait
for it: whoever writes must watch the reader processes through `on_wait`.

Not thread-safe: one thread per writer / reader. Linux only (/dev/shm).
"""

from __future__ import annotations

import os
import shutil
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import zmq

from mmserve.ipc.worker_messages import ShmBroadcastInfo
from mmserve.ipc.queues import ipc_address
from mmserve.ipc.serial import Frames, MsgpackDecoder, MsgpackEncoder
from mmserve.ipc.shm_segment import (SHM_DIR, ShmSpaceError, create_segment, open_segment, remove_stale_segments,
                                     unlink_segment, unmap_segment)

T = TypeVar("T")

SLOT_HEADER = 64  # bytes before each slot's payload
MAX_READERS = 31  # read flags live in header bytes 1..31
_META_AT = 32
_META = struct.Struct("<QQQ")  # seq, kind, payload bytes
INLINE, OVERFLOW = 1, 2
_SPINS = 200  # sched_yield rounds before sleeping
_MIN_SLEEP_S, _MAX_SLEEP_S = 20e-6, 1e-3
_CHECK_EVERY_S = 0.1
_FENCE_LOCK = threading.Lock()


def _fence() -> None:
    """A full memory barrier (a lock round trip is an atomic read-modify-write)."""
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


def _wait(ready: Callable[[], bool], timeout_s: float | None, on_wait: Callable[[], None] | None) -> bool:
    """Poll `ready` until it holds (True) or `timeout_s` passes (False; None waits forever)."""
    start = time.monotonic()
    next_check = start + _CHECK_EVERY_S
    spins = 0
    while not ready():
        spins += 1
        if spins < _SPINS:
            os.sched_yield()
        else:
            time.sleep(min(_MAX_SLEEP_S, _MIN_SLEEP_S * 2 ** min(spins - _SPINS, 10)))
        now = time.monotonic()
        if timeout_s is not None and now - start >= timeout_s:
            return ready()
        if on_wait is not None and now >= next_check:
            on_wait()
            next_check = now + _CHECK_EVERY_S
    return True


class ShmBroadcast(Generic[T]):
    """The writer: owns the segment and one overflow PUSH socket per reader.

    Counters since start: `num_messages`, `num_overflows`, `bytes_sent` (encoded message bytes,
    once per message whatever the number of readers), `send_s` (time in `enqueue`, waits included).
    """

    def __init__(self, num_readers: int, encoder: MsgpackEncoder, ctx: zmq.Context, ipc_dir: str,
                 num_slots: int = 4, slot_bytes: int = 4 << 20) -> None:
        if not 1 <= num_readers <= MAX_READERS:
            raise ValueError(f"a broadcast ring takes 1 to {MAX_READERS} readers; got {num_readers}")
        remove_stale_segments()
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        self._stride = SLOT_HEADER + slot_bytes
        need = num_slots * self._stride
        free = shutil.disk_usage(SHM_DIR).free if os.path.isdir(SHM_DIR) else 0
        if need > free:
            raise ShmSpaceError(f"the tensor-parallel step broadcast needs {need / 2**20:.0f} MiB of {SHM_DIR}, "
                                f"which has {free / 2**20:.0f} MiB free: enlarge it (docker run --shm-size=...)")
        self.name, self._fd, self._map = create_segment(need)
        self._buf = memoryview(self._map)
        self._encoder = encoder
        self._all_read = b"\x01" * num_readers
        self._sockets: list[zmq.Socket] = []
        self.overflow_addresses = [ipc_address(ipc_dir, f"broadcast-{i}") for i in range(num_readers)]
        for address in self.overflow_addresses:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
            self._sockets.append(sock)
        self._seq = 0
        self.closed = False
        self.num_messages = self.num_overflows = self.bytes_sent = 0
        self.send_s = 0.0

    @property
    def info(self) -> ShmBroadcastInfo:
        return ShmBroadcastInfo(self.name, self.num_slots, self.slot_bytes, self.num_readers, self.overflow_addresses)

    def enqueue(self, obj: T, timeout_s: float | None = None, on_wait: Callable[[], None] | None = None) -> None:
        """Publish `obj` to every reader; TimeoutError if a slot does not free up in `timeout_s`."""
        start = time.perf_counter()
        frames = self._encoder.encode(obj)
        sizes = [memoryview(f).nbytes for f in frames]
        nbytes = 4 + 8 * len(frames) + sum(sizes)
        base = (self._seq % self.num_slots) * self._stride
        if not _wait(lambda: self._buf[base] == 0 or self._buf[base + 1:base + 1 + self.num_readers] == self._all_read,
                     timeout_s, on_wait):
            raise TimeoutError(f"broadcast readers did not free a slot within {timeout_s} s")
        self._buf[base] = 0
        self._buf[base + 1:base + 1 + self.num_readers] = bytes(self.num_readers)
        if nbytes <= self.slot_bytes:
            kind = INLINE
            _write_frames(self._buf, base + SLOT_HEADER, frames, sizes)
        else:
            kind = OVERFLOW
            self.num_overflows += 1
            for sock in self._sockets:
                _send_frames(sock, frames, timeout_s, on_wait)
        _META.pack_into(self._buf, base + _META_AT, self._seq, kind, nbytes)
        _fence()
        self._buf[base] = 1
        self._seq += 1
        self.num_messages += 1
        self.bytes_sent += nbytes
        self.send_s += time.perf_counter() - start

    def close(self) -> None:
        """Close the sockets and unlink the segment (readers keep what they mapped)."""
        if self.closed:
            return
        self.closed = True
        for sock in self._sockets:
            sock.close(linger=0)
        unlink_segment(self.name)
        unmap_segment(self._buf, self._map)
        os.close(self._fd)


class ShmBroadcastReader(Generic[T]):
    """Reader `index` of a ring: gets every message, in order, decoded with `decoder`."""

    def __init__(self, info: ShmBroadcastInfo, index: int, decoder: MsgpackDecoder, ctx: zmq.Context) -> None:
        self.info, self.index = info, index
        self._fd, self._map = open_segment(info.name, writable=True)
        self._buf = memoryview(self._map)
        self._stride = SLOT_HEADER + info.slot_bytes
        self._decoder = decoder
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(info.overflow_addresses[index])
        self._seq = 0
        self.closed = False

    def dequeue(self, timeout_s: float | None = None, on_wait: Callable[[], None] | None = None) -> T | None:
        """The next message, or None if none came within `timeout_s` (None: wait forever)."""
        base = (self._seq % self.info.num_slots) * self._stride
        flag = base + 1 + self.index
        if not _wait(lambda: self._buf[flag] == 0 and self._buf[base] == 1, timeout_s, on_wait):
            return None
        _fence()
        seq, kind, nbytes = _META.unpack_from(self._buf, base + _META_AT)
        if seq != self._seq:
            raise RuntimeError(f"broadcast reader {self.index} expected message {self._seq}, found {seq}")
        data = bytearray(self._buf[base + SLOT_HEADER:base + SLOT_HEADER + nbytes]) if kind == INLINE else None
        _fence()
        self._buf[flag] = 1
        self._seq += 1
        if data is not None:
            return self._decoder.decode(_read_frames(data))
        return self._decoder.decode(_recv_frames(self._sock, timeout_s, on_wait))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._sock.close(linger=0)
        unmap_segment(self._buf, self._map)
        os.close(self._fd)


def _write_frames(buf: memoryview, at: int, frames: Frames, sizes: list[int]) -> None:
    struct.pack_into(f"<I{len(sizes)}Q", buf, at, len(sizes), *sizes)
    at += 4 + 8 * len(sizes)
    for frame, size in zip(frames, sizes):
        buf[at:at + size] = frame
        at += size


def _read_frames(data: bytearray) -> list[memoryview]:
    """Views of `data` (writable: decoded tensors keep `data` alive, never the ring)."""
    (count,) = struct.unpack_from("<I", data, 0)
    sizes = struct.unpack_from(f"<{count}Q", data, 4)
    view, at, frames = memoryview(data), 4 + 8 * count, []
    for size in sizes:
        frames.append(view[at:at + size])
        at += size
    return frames


def _send_frames(sock: zmq.Socket, frames: Frames, timeout_s: float | None, on_wait: Callable[[], None] | None) -> None:
    def sent() -> bool:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:  # the reader is not connected (yet, or any more)
            return False

    if not _wait(sent, timeout_s, on_wait):
        raise TimeoutError(f"a broadcast reader did not take an oversized message within {timeout_s} s")


def _recv_frames(sock: zmq.Socket, timeout_s: float | None, on_wait: Callable[[], None] | None) -> list[Any]:
    frames: list[Any] = []

    def received() -> bool:
        try:
            frames.extend(sock.recv_multipart(flags=zmq.NOBLOCK, copy=False))
            return True
        except zmq.Again:
            return False

    if not _wait(received, timeout_s, on_wait):  # the writer sent it before publishing the slot
        raise TimeoutError(f"an oversized broadcast message did not arrive within {timeout_s} s")
    return frames


