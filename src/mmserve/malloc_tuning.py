"""glibc malloc settings for mmserve's serving processes: keep freed multi-MB buffers for reuse.

By default glibc serves a large allocation (a request body, the string of a data URL, a decoded
payload, an image's pixels) with a fresh `mmap` past a threshold that adapts, and hands freed
memory at the heap's top back to the OS past a trim threshold. The next request of the same size
then page-faults every 4 KiB page in again, and in a virtual machine each fault costs
microseconds (README, "Measurements behind the design": a repeated large image's body).

`retain_freed_memory` raises both, so that such buffers come from the heap and go back to it. The
price: memory a process freed stays in it (its RSS stays near its peak), as with jemalloc or
tcmalloc. `MMSERVE_MALLOC=default` keeps glibc's defaults (a debugging knob, read here only).

`HeapReserve` goes one step further for memory that is kept, not freed: P1's IPC receiver cache
holds every item it receives, so each new item lands in memory the process never touched, and
each of its 4 KiB pages faults while the item crosses from P0 (about half of the transfer's time,
measured with ZMQ alone: README). The reserve keeps a pad of free memory at the
top of the heap populated in advance, a few MiB at a time while the process is idle, so that the
next items are received into pages that are already there.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_TOP_PAD = -2
M_ARENA_MAX = -8
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in as if written, without changing them
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest on 64-bit: larger blocks are still mapped and unmapped
TRIM_THRESHOLD_BYTES = 1 << 30  # free memory at the heap's top kept before any is given back


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds in this process; whether they were set (not on
    another C library or platform, nor with MMSERVE_MALLOC=default)."""
    if os.environ.get("MMSERVE_MALLOC") == "default" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and others: their allocator, their defaults
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    done = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and done
    if not done:
        logger.debug("mallopt refused the thresholds; glibc's defaults stay")
    return done


MADV_HUGEPAGE = 14
HUGE_PAGE_BYTES = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory the kernel is asked to back with 2 MiB pages
    (`madvise(MADV_HUGEPAGE)` before the first touch; transparent huge pages in "madvise" or
    "always" mode), for the KV cache: decode attention reads each request's blocks wherever they
    lie, and with 4 KiB pages every block costs a handful of TLB misses. Elsewhere, or where the
    kernel says no, a plain zeroed tensor."""
    import torch  # the engine's processes only (API servers use the rest of this module)

    tensor = torch.empty(shape, dtype=dtype)
    if sys.platform.startswith("linux") and tensor.numel():
        start = tensor.data_ptr()
        first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        last = (start + tensor.numel() * tensor.element_size()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if last > first:
            try:
                madvise = ctypes.CDLL("libc.so.6", use_errno=True).madvise
                madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                madvise(first, last - first, MADV_HUGEPAGE)
            except (OSError, AttributeError):
                pass
    return tensor.zero_()


def release_freed_memory() -> bool:
    """Give the heap's free memory back to the OS once (`malloc_trim`): after start-up work that
    frees much more than serving will reuse (the weights' dense copies once packed), which the
    raised thresholds would otherwise keep. Whether glibc released any."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    return bool(malloc_trim(0))


class HeapReserve:
    """A populated pad of free memory at the top of the main heap (glibc on Linux only).

    `M_TOP_PAD` makes every extension of the heap (`sbrk`) `pad_bytes` larger than the allocation
    that asked for it, `M_ARENA_MAX` 1 puts every thread's allocations (ZMQ's I/O thread receives
    messages) in that one heap, and `refill` populates the pad below the heap's end with
    `MADV_POPULATE_WRITE`: pages still free read as zeros as before, pages in use are left as they
    are, so it changes no memory, only when its pages fault. Only the heap above its end at setup
    is populated (below it lies what the process used before), so the first item after setup
    still faults its pages in, and grows the heap by the pad that serves the next ones. Call
    `refill` when idle; each call does at most `budget_bytes`, so an input that arrives meanwhile
    waits for one chunk at most.

    Price: up to `pad_bytes` of resident memory that no object holds yet. Set it up before the
    process starts its other threads. Not thread-safe: one thread calls `refill`.
    """

    def __init__(self, pad_bytes: int) -> None:
        self.pad_bytes = pad_bytes
        self._libc: ctypes.CDLL | None = None
        self._floor = 0  # the heap's end at setup: below it, memory the process already used
        self._brk = 0  # the heap's end when the pad was last laid out
        self._cursor = 0  # populated from the pad's start up to here
        if pad_bytes <= 0 or os.environ.get("MMSERVE_MALLOC") == "default" or not sys.platform.startswith("linux"):
            return
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            libc.sbrk.argtypes, libc.sbrk.restype = [ctypes.c_ssize_t], ctypes.c_void_p
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            return
        if libc.mallopt(M_ARENA_MAX, 1) and libc.mallopt(M_TOP_PAD, pad_bytes):
            self._libc = libc
            self._floor = self._brk = self._cursor = libc.sbrk(0) or 0

    @property
    def enabled(self) -> bool:
        return self._libc is not None

    def pending(self) -> bool:
        """Whether part of the pad below the heap's end is not populated yet."""
        if self._libc is None:
            return False
        brk = self._libc.sbrk(0) or 0
        if brk != self._brk:  # the heap grew (or shrank): its new top pad is to be populated
            self._brk, self._cursor = brk, max(self._floor, (brk - self.pad_bytes) & ~(mmap.PAGESIZE - 1))
        return self._cursor < self._brk

    def refill(self, budget_bytes: int = 2 << 20) -> None:
        """Populate up to `budget_bytes` more of the pad (nothing when none is `pending`)."""
        if not self.pending():
            return
        assert self._libc is not None
        length = min(budget_bytes, self._brk - self._cursor)
        if self._libc.madvise(self._cursor, length, MADV_POPULATE_WRITE) != 0:  # an older kernel
            logger.debug("madvise(MADV_POPULATE_WRITE) failed (errno %d); no heap reserve", ctypes.get_errno())
            self._libc = None
            return
        self._cursor += length
