"""The serving processes' malloc settings: applied on glibc, skipped when asked."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = "from mmserve.malloc_tuning import retain_freed_memory; print(retain_freed_memory())"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("env, expected", [({}, "True"), ({"MMSERVE_MALLOC": "default"}, "False")])
def test_retain_freed_memory_sets_glibc_thresholds_unless_told_not_to(env, expected):
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", **env}).stdout.strip()
    assert out == expected


def test_the_serving_processes_apply_it():
    """P0 (each API server), P1 and every tensor-parallel worker call it at start (through their
    one set-up helper, `serving_process.py: ServingProcess`)."""
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "mmserve"
    assert "retain_freed_memory()" in (src / "serving_process.py").read_text()
    for path in ("entrypoints/openai/api_server.py", "engine/core_proc.py", "worker/worker_proc.py"):
        assert "ServingProcess(" in (src / path).read_text(), path


RESERVE_CODE = """
import os
from mmserve.malloc_tuning import HeapReserve, retain_freed_memory
retain_freed_memory()
reserve = HeapReserve(8 << 20)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
print(reserve.enabled, reserve.pending())
kept = [bytes([i % 251]) * (1 << 20) for i in range(1)]  # grows the heap: its top pad is laid out
pending, before = reserve.pending(), rss()
while reserve.pending():
    reserve.refill(1 << 20)
print(pending, rss() - before >= (7 << 20), all(k == bytes([i % 251]) * (1 << 20) for i, k in enumerate(kept)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, Linux's madvise")
def test_heap_reserve_populates_the_pad_above_the_heap_and_changes_no_memory():
    """Nothing is pending until the heap grows past its end at setup; then the pad (8 MiB) is
    populated chunk by chunk (resident memory grows by it) and what the heap held is unchanged."""
    out = subprocess.run([sys.executable, "-c", RESERVE_CODE], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout.split()
    assert out == ["True", "False", "True", "True", "True"]


def test_heap_reserve_is_off_when_told():
    code = "from mmserve.malloc_tuning import HeapReserve; r = HeapReserve(8 << 20); print(r.enabled, r.pending())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "MMSERVE_MALLOC": "default"}).stdout.split()
    assert out == ["False", "False"]


KEEPER_CODE = """
import asyncio
from mmserve.malloc_tuning import HeapReserve, retain_freed_memory
from mmserve.entrypoints.openai.api_server import _keep_heap_reserve
retain_freed_memory()
reserve = HeapReserve(8 << 20)
kept = [bytes(1 << 20)]  # grows the heap: its pad is pending


class Engine:
    num_requests = 1


async def main():
    engine = Engine()
    keeper = asyncio.create_task(_keep_heap_reserve(reserve, engine))
    await asyncio.sleep(0.3)
    busy = reserve.pending()
    engine.num_requests = 0
    await asyncio.sleep(0.3)
    keeper.cancel()
    print(busy, reserve.pending())


asyncio.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, Linux's madvise")
def test_the_api_server_fills_its_heap_reserve_only_while_no_request_is_in_flight():
    out = subprocess.run([sys.executable, "-c", KEEPER_CODE], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout.split()
    assert out == ["True", "False"]


RELEASE = """
from mmserve.malloc_tuning import release_freed_memory, retain_freed_memory
def rss_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1])
retain_freed_memory()
chunks = [bytearray(8 << 20) for _ in range(8)]  # 64 MiB from the heap (each below the mmap threshold)
held = rss_kib()
del chunks  # freed, and kept by the raised thresholds
kept = rss_kib()
print(release_freed_memory(), held - kept, kept - rss_kib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_freed_memory_gives_the_kept_heap_back():
    """What the raised thresholds keep (a start-up's freed dense weights) goes back to the OS on
    `release_freed_memory`."""
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout.split()
    released, dropped_by_free, dropped_by_release = out[0], int(out[1]), int(out[2])
    assert dropped_by_free < 16 << 10  # freeing alone kept (nearly) all of the 64 MiB
    assert released == "True" and dropped_by_release > 48 << 10


HUGE = """
import torch
from mmserve.malloc_tuning import zeros_on_huge_pages
def anon_huge_kib():
    text = open("/proc/self/smaps_rollup").read()
    return int(next(l for l in text.splitlines() if l.startswith("AnonHugePages:")).split()[1])
before = anon_huge_kib()
t = zeros_on_huge_pages((1024, 16, 4, 128), torch.float32)  # 32 MiB: a layer's K cache of 16k tokens
print(bool((t == 0).all()), t.shape == (1024, 16, 4, 128), anon_huge_kib() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise")
def test_the_kv_cache_is_zeroed_and_on_huge_pages_where_the_kernel_allows():
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read() if sys.platform.startswith("linux") else ""
    out = subprocess.run([sys.executable, "-c", HUGE], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout.split()
    assert out[:2] == ["True", "True"]
    if "[never]" not in mode:  # "madvise" or "always": the advised range is backed by 2 MiB pages
        assert int(out[2]) >= 16 << 10
