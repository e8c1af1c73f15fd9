"""glibc malloc settings for mmserve's serving processes: keep freed multi-MB buffers for reuse.

By default glibc serves a large allocation (a request body, the string of a data URL, a decoded
payload, an image's pixels) with a fresh `mmap` past a threshold that adapts, and hands freed
memory at the heap's top back to the OS past a trim threshold. The next request of the same size
then page-faults every 4 KiB page in again, and in a virtual machine each fault costs
microseconds: on a 2-core VM a repeated 1344 px image (a 5.6 MB body) spent 21 ms of a 34 ms warm
TTFT receiving and parsing its body; with the thresholds raised, 7 ms.

`retain_freed_memory` raises both, so that such buffers come from the heap and go back to it. The
price: memory a process freed stays in it (its RSS stays near its peak), as with jemalloc or
tcmalloc. `MMSERVE_MALLOC=default` keeps glibc's defaults (a debugging knob, read here only).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
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
