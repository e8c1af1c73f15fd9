"""The shared-memory ring and its segment: wrap-around, full, pins, the CLOCK hand, clear, stale
chunks, random operations against the tiling invariants, and the segment's life (space check,
SIGTERM, cleanup after SIGKILL)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mmserve
from mmserve.ipc import shm_segment
from mmserve.item_store.shm_ring import HEADER_BYTES, MAX_HITS, Chunk, ShmRing, ShmRingReader
from mmserve.ipc.shm_segment import ShmSpaceError, check_shm_space, remove_stale_segments

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')

SRC = str(Path(mmserve.__file__).parents[1])
ITEM = 1000  # payload bytes; a chunk of HEADER_BYTES + 1024 = 1088
CHUNK = HEADER_BYTES + 1024


class Ring:
    """A ring whose chunks carry a byte pattern of their key, and the keys it evicted."""

    def __init__(self, capacity: int = 3 * CHUNK + 64) -> None:
        self.evicted: list[str] = []
        self.ring = ShmRing(capacity, _sign, lambda chunk: self.evicted.append(chunk.key))

    def put(self, key: str, nbytes: int = ITEM) -> Chunk | None:
        chunk = self.ring.allocate(nbytes, key)
        if chunk is not None:
            self.ring.payload(chunk)[:] = pattern(key, nbytes)
        self.ring.check_integrity()
        return chunk


def _sign(chunk: Chunk) -> bytes:
    return hashlib.blake2b(f"{chunk.key}|{chunk.offset}|{chunk.chunk_id}|{chunk.nbytes}".encode(),
                           digest_size=16).digest()


def pattern(key: str, nbytes: int) -> bytes:
    return (hashlib.sha256(key.encode()).digest() * (nbytes // 32 + 1))[:nbytes]


def acquire(reader: ShmRingReader, chunk: Chunk) -> memoryview | None:
    return reader.acquire(chunk.offset, chunk.chunk_id, chunk.nbytes, chunk.tag)


@pytest.fixture
def r():
    ring = Ring()
    yield ring
    ring.ring.close()


def test_chunks_wrap_around_evicting_from_the_head(r):
    chunks = [r.put(f"k{i}") for i in range(5)]
    assert [c.offset for c in chunks] == [0, CHUNK, 2 * CHUNK, 0, CHUNK]
    assert r.evicted == ["k0", "k1"]
    reader = ShmRingReader(r.ring.name)
    assert acquire(reader, chunks[2]) == pattern("k2", ITEM)
    reader.close()


def test_an_item_bigger_than_the_ring_is_refused_and_changes_nothing(r):
    r.put("k0")
    assert r.ring.allocate(r.ring.capacity, "huge") is None
    assert r.evicted == [] and [c.key for c in r.ring.chunks() if c.live] == ["k0"]


def test_full_when_every_chunk_is_pinned(r):
    chunks = [r.put(f"k{i}") for i in range(3)]
    for chunk in chunks:
        chunk.pins += 1
    assert r.put("k3") is None and r.evicted == []
    chunks[1].pins -= 1
    assert r.put("k3").offset == CHUNK and r.evicted == ["k1"]


def test_a_chunk_a_reader_holds_is_skipped_not_blocking(r):
    chunks = [r.put(f"k{i}") for i in range(3)]
    reader = ShmRingReader(r.ring.name)
    held = acquire(reader, chunks[0])
    assert r.ring.is_read_locked(chunks[0])
    for i in range(3, 30):  # ten turns of the ring: everything but the held chunk keeps moving
        assert r.put(f"k{i}") is not None
    assert "k0" not in r.evicted and chunks[0].offset == 0 and held == pattern("k0", ITEM)
    reader.release(chunks[0].offset)
    assert not r.ring.is_read_locked(chunks[0])
    r.put("k30")
    r.put("k31")
    assert "k0" in r.evicted
    reader.close()


def test_a_hot_chunk_is_reinserted_at_the_tail_and_outlives_cold_ones(r):
    r.put("k0")
    hot = r.put("hot")
    r.put("k2")
    hot.hits = 2
    old = (hot.offset, hot.chunk_id, hot.nbytes, hot.tag)
    r.put("k3", nbytes=100)  # wraps, evicts k0, leaves a gap of free bytes before `hot`
    r.put("k4")  # the hand meets `hot`: it moves into the gap (one hit spent); cold k2 goes
    assert r.evicted == ["k0", "k2"] and r.ring.num_relocations == 1 and hot.hits == 1
    assert hot.offset == HEADER_BYTES + 128 and hot.chunk_id != old[1]
    reader = ShmRingReader(r.ring.name)
    assert reader.acquire(*old) is None  # its old place is dead
    assert acquire(reader, hot) == pattern("hot", ITEM)
    reader.release(hot.offset)
    for i in range(5, 12):
        r.put(f"k{i}")
    assert "hot" in r.evicted  # no hits since: it goes like the rest
    reader.close()


def test_clear_invalidates_everything_and_frees_held_chunks_on_release(r):
    chunks = [r.put(f"k{i}") for i in range(3)]
    reader = ShmRingReader(r.ring.name)
    held = acquire(reader, chunks[1])
    r.ring.clear()
    r.ring.check_integrity()
    assert acquire(reader, chunks[0]) is None and acquire(reader, chunks[2]) is None
    assert held == pattern("k1", ITEM) and chunks[1].live and chunks[1].key is None  # an orphan
    for i in range(3, 8):
        assert r.put(f"k{i}") is not None
    assert chunks[1] in r.ring.chunks()
    reader.release(chunks[1].offset)
    for i in range(8, 12):
        r.put(f"k{i}")
    assert chunks[1] not in r.ring.chunks() and r.evicted.count(None) == 0
    reader.close()


def test_a_stale_or_wrong_chunk_is_refused_and_not_held(r):
    chunk = r.put("k0")
    reader = ShmRingReader(r.ring.name)
    assert reader.acquire(chunk.offset, chunk.chunk_id + 1, chunk.nbytes, chunk.tag) is None
    assert reader.acquire(chunk.offset, chunk.chunk_id, chunk.nbytes, bytes(16)) is None
    assert reader.acquire(CHUNK, 1, ITEM, chunk.tag) is None  # no chunk starts there
    assert reader.num_held == 0 and not r.ring.is_read_locked(chunk)
    with pytest.raises(ValueError):
        reader.acquire(r.ring.capacity - 64, chunk.chunk_id, chunk.nbytes, chunk.tag)
    reader.close()


_ops = st.lists(st.tuples(st.sampled_from(["put", "put", "put", "hit", "pin", "unpin", "hold", "drop", "clear"]),
                          st.integers(0, 2000)), max_size=60)


@settings(max_examples=40, deadline=None)
@given(_ops)
def test_random_operations_keep_the_tiling_entries_and_held_bytes(ops):
    r = Ring(capacity=8 * CHUNK)
    reader = ShmRingReader(r.ring.name)
    held: list[tuple[Chunk, str, int, memoryview]] = []
    try:
        for n, (op, arg) in enumerate(ops):
            live = [c for c in r.ring.chunks() if c.key is not None]
            pick = live[arg % len(live)] if live else None
            if op == "put":
                r.put(f"k{n}", nbytes=arg)
            elif op == "hit" and pick:
                pick.hits = min(pick.hits + 1, MAX_HITS)
            elif op == "pin" and pick:
                pick.pins += 1
            elif op == "unpin" and pick and pick.pins:
                pick.pins -= 1
            elif op == "hold" and pick and (view := acquire(reader, pick)) is not None:
                held.append((pick, pick.key, pick.nbytes, view))
            elif op == "drop" and held:
                chunk, _, _, _ = held.pop(arg % len(held))
                reader.release(chunk.offset)
            elif op == "clear":
                r.ring.clear()
            r.ring.check_integrity()
            for chunk in r.ring.chunks():  # moves keep every entry's bytes
                assert chunk.key is None or r.ring.payload(chunk) == pattern(chunk.key, chunk.nbytes)
            for chunk, key, nbytes, view in held:
                assert view == pattern(key, nbytes) and chunk in r.ring.chunks()
        assert reader.num_held == len(held)
    finally:
        reader.close()
        r.ring.close()


# ---- the segment's life -------------------------------------------------------------------------


def test_segment_is_private_named_by_pid_and_unlinked_on_close():
    ring = ShmRing(4096, _sign, lambda chunk: None)
    path = Path(shm_segment.SHM_DIR, ring.name)
    assert ring.name.startswith(f"mmserve_{os.getpid()}_") and path.stat().st_mode & 0o777 == 0o600
    assert path.stat().st_size == 4096
    ring.close()
    assert not path.exists()


def test_too_little_space_is_a_clear_error_that_names_the_flag():
    free = os.statvfs(shm_segment.SHM_DIR).f_bavail * os.statvfs(shm_segment.SHM_DIR).f_frsize
    before = set(os.listdir(shm_segment.SHM_DIR))
    with pytest.raises(ShmSpaceError, match="--mm-shm-cache-gb"):
        check_shm_space(free + (1 << 30))
    with pytest.raises(ShmSpaceError, match="--mm-shm-cache-gb"):
        ShmRing((free + (1 << 30)) // 64 * 64, _sign, lambda chunk: None)
    assert set(os.listdir(shm_segment.SHM_DIR)) <= before


def test_stale_segments_are_removed_live_ones_kept():
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())

    def fake(pid: int) -> Path:
        path = Path(shm_segment.SHM_DIR, f"mmserve_{pid}_{uuid.uuid4().hex}")
        path.write_bytes(b"x")
        return path

    dead, foreign, reused, young = fake(pid_max + 1), fake(pid_max + 1), fake(os.getpid()), fake(os.getpid())
    os.utime(reused, (time.time() - 3600, time.time() - 3600))  # our pid, no owner lock: pid reused
    owner = os.open(foreign, os.O_RDWR)  # a live writer whose pid we cannot see (another pid namespace)
    assert shm_segment.try_lock(owner, fcntl.F_WRLCK, shm_segment.OWNER_BYTE)
    ring = ShmRing(4096, _sign, lambda chunk: None)  # runs remove_stale_segments first
    try:
        assert not dead.exists() and not reused.exists() and foreign.exists() and young.exists()
        os.utime(Path(shm_segment.SHM_DIR, ring.name), (time.time() - 3600, time.time() - 3600))
        assert ring.name not in remove_stale_segments()  # old, but its owner lock is held
    finally:
        os.close(owner)
        foreign.unlink()
        young.unlink()
        ring.close()


_CHILD = """
import signal, sys, time
from mmserve.item_store.shm_ring import ShmRing
if {own_handler}:
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
ring = ShmRing(1 << 20, lambda c: bytes(16), lambda c: None)
print(ring.name, flush=True)
time.sleep(60)
"""


def start_writer(own_handler: bool = False) -> tuple[subprocess.Popen, Path]:
    code = textwrap.dedent(_CHILD.format(own_handler=own_handler))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": SRC})
    path = Path(shm_segment.SHM_DIR, proc.stdout.readline().strip())
    assert path.exists() and path.name.startswith(f"mmserve_{proc.pid}_")
    return proc, path


@pytest.mark.parametrize("own_handler", [False, True])
def test_sigterm_unlinks_the_segment_then_runs_the_previous_handler(own_handler):
    proc, path = start_writer(own_handler)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == (7 if own_handler else -signal.SIGTERM)
    assert not path.exists()
    assert not [n for n in os.listdir(shm_segment.SHM_DIR) if n.startswith(f"mmserve_{proc.pid}_")]


def test_after_sigkill_the_next_start_removes_the_segment():
    proc, path = start_writer()
    proc.kill()
    proc.wait(timeout=10)
    assert path.exists()  # nothing ran in the killed writer
    assert path.name in remove_stale_segments() and not path.exists()
