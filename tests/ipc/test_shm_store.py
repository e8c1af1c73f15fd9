"""The shared-memory object store: round trips and zero-copy views, duplicate keys, oversize and
full stores, pins of in-flight requests, the CLOCK policy, stale and tampered handles; and, across
spawned processes, readers that read correct bytes while the writer evicts, entries that survive
while held, and a reader killed with a lease that does not wedge the store."""

from __future__ import annotations

import multiprocessing
import os
import signal

import msgspec
import pytest
import torch

from mmserve.item_store.shm_store import ShmHandle, ShmStore, ShmStoreInfo, ShmStoreReader
from mmserve.item_store.shm_store_reader import ShmHandleError
from helpers.shm_items_for_tests import CHUNK, ITEM_BYTES, item, same

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')

CAPACITY = 8 * CHUNK


@pytest.fixture
def store():
    with ShmStore(CAPACITY) as s:
        yield s
        s.check_integrity()


def fill(store: ShmStore, start: int, count: int) -> list[ShmHandle | None]:
    handles = [store.put(f"k{i}", item(i)) for i in range(start, start + count)]
    store.check_integrity()
    return handles


def test_items_round_trip_as_zero_copy_views(store):
    data = {"pixel_values": torch.randn(3, 20, 24), "bf16": torch.randn(5, 7).to(torch.bfloat16),
            "ids": torch.arange(6), "mask": torch.tensor([True, False]), "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4), "strided": torch.randn(8, 6).t()}
    handle = store.put("img", data)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(handle), type=ShmHandle) == handle
    reader = store.reader()
    with reader.get(handle) as a, reader.get(handle) as b:
        assert same(a.data, data) and a.data["strided"].shape == (6, 8)
        assert a.data["pixel_values"].data_ptr() == b.data["pixel_values"].data_ptr()  # both view the segment
        kept = a.clone()
        kept["pixel_values"] += 1  # a clone is private and writable
        assert not torch.equal(kept["pixel_values"], b.data["pixel_values"])
    assert reader.num_held == 0
    reader.close()


def test_a_duplicate_key_is_written_once(store):
    first = store.put("k", item(0))
    assert store.put("k", item(0)) == first == store.lookup("k")
    stats = store.stats
    assert (stats.puts, stats.entries, stats.bytes_written, stats.queries, stats.hits) == (1, 1, first.nbytes, 1, 1)
    assert stats.bytes_saved == 3 * first.nbytes


def test_an_oversize_item_falls_back_and_changes_nothing():
    with ShmStore(CAPACITY, max_object_bytes=2 * ITEM_BYTES) as store:
        fill(store, 0, 3)
        before = store.stats
        assert store.put("big", item(0, hw=64)) is None
        assert store.stats.fallbacks_oversize == 1 and store.stats.entries == before.entries
        assert store.put("too-big-for-any-ring", {"x": torch.zeros(CAPACITY // 4)}) is None
        assert store.stats.fallbacks_oversize == 2 and store.stats.evictions == before.evictions == 0
        store.check_integrity()


def test_non_tensors_are_refused_before_anything_changes(store):
    with pytest.raises(TypeError, match="dense tensors only"):
        store.put("k", {"pixel_values": torch.zeros(3), "size": [336, 336]})
    assert not store.contains("k") and store.stats.puts == 0


def test_entries_of_in_flight_requests_are_never_evicted_and_a_full_store_falls_back(store):
    pinned = [store.put(f"k{i}", item(i), request_id=f"r{i % 2}") for i in range(8)]
    assert all(pinned) and store.put("new", item(99)) is None  # every byte is pinned
    assert store.stats.fallbacks_full == 1 and store.stats.evictions == 0
    store.finish_request("r0")
    store.finish_request("r0")  # finish and abort may both come: harmless
    fill(store, 100, 12)  # only r0's entries (even keys) may go
    assert all(store.contains(f"k{i}") for i in range(1, 8, 2))
    assert not any(store.contains(f"k{i}") for i in range(0, 8, 2))
    with store.get(pinned[1]) as lease:
        assert same(lease.data, item(1))


def test_hot_entries_outlive_cold_ones(store):
    store.put("first", item(-1, hw=16))  # so that k0 does not sit at offset 0, where every run starts
    handles = fill(store, 0, 7)
    for _ in range(3):
        store.lookup("k0")  # k0 is hot; k1, put at the same time, is not
    for i in range(8, 60):
        store.put(f"k{i}", item(i, hw=32 if i % 3 else 16))  # mixed sizes leave gaps to move into
        if i % 6 == 0:
            store.lookup("k0")
        store.check_integrity()
    assert store.contains("k0") and not store.contains("k1")
    assert store.stats.relocations > 0 and store.stats.fallbacks == 0
    assert store.get(handles[0]) is None  # k0 was re-inserted at the tail: its old handle is stale
    with store.get(store.lookup("k0")) as lease:
        assert same(lease.data, item(0))


def test_an_entry_a_reader_holds_does_not_block_eviction_behind_it(store):
    handles = fill(store, 0, 8)
    reader = store.reader()
    lease = reader.get(handles[0])
    assert all(fill(store, 8, 80))  # ten turns of the ring: no put fails
    assert store.contains("k0") and same(lease.data, item(0))
    lease.release()
    lease.release()  # idempotent
    fill(store, 88, 16)
    assert not store.contains("k0") and reader.get(handles[0]) is None
    assert store.stats.fallbacks == 0
    reader.close()


def test_stale_handles_are_detected_after_eviction_and_after_clear(store):
    handles = fill(store, 0, 8)
    fill(store, 8, 2)
    reader = store.reader()
    assert reader.get(handles[0]) is None and reader.get(handles[1]) is None
    lease = reader.get(handles[5])
    store.clear()
    store.check_integrity()
    assert reader.get(handles[7]) is None and reader.get(handles[5]) is None
    assert same(lease.data, item(5))  # what a reader held before clear stays readable
    again = store.put("k7", item(7))
    assert again != handles[7] and reader.get(handles[7]) is None
    with reader.get(again) as fresh:
        assert same(fresh.data, item(7))
    assert reader.num_stale == 5
    lease.release()
    reader.close()


def test_tampered_and_foreign_handles_are_refused(store):
    handle = store.put("k", item(0))
    fill(store, 1, 2)
    for tampered in (msgspec.structs.replace(handle, key="k1"), msgspec.structs.replace(handle, offset=CHUNK),
                     msgspec.structs.replace(handle, chunk_id=handle.chunk_id + 1),
                     msgspec.structs.replace(handle, nbytes=handle.nbytes - 4),
                     msgspec.structs.replace(handle, tag=bytes(16))):
        with pytest.raises(ShmHandleError):
            store.get(tampered)
    with ShmStore(CAPACITY) as other:
        with pytest.raises(ShmHandleError):
            other.get(handle)
        forged_secret = ShmStoreInfo(store.info.name, CAPACITY, other.info.secret)
        with pytest.raises(ShmHandleError):
            ShmStoreReader(forged_secret).get(handle)
    with store.get(handle) as lease:
        assert same(lease.data, item(0))


# ---- several processes ------------------------------------------------------------------------


def _reader_loop(info_bytes: bytes, conn) -> None:
    """Read every handle sent (ack each); hold the last two leases while the writer goes on and
    check their bytes again when letting go; report (ok, stale, bad)."""
    reader = ShmStoreReader(msgspec.msgpack.decode(info_bytes, type=ShmStoreInfo))
    conn.send_bytes(b"ready")
    ok = stale = bad = 0
    held: list[tuple[int, object]] = []
    while (msg := conn.recv_bytes()) != b"":
        i, handle = msgspec.msgpack.decode(msg, type=tuple[int, ShmHandle])
        lease = reader.get(handle)
        conn.send_bytes(b"")
        if lease is None:
            stale += 1
            continue
        held.append((i, lease))
        if len(held) > 2:
            j, old = held.pop(0)
            good = same(old.data, item(j))
            ok, bad = ok + good, bad + (not good)
            old.release()
    conn.send_bytes(msgspec.msgpack.encode((ok, stale, bad)))


def test_readers_read_correct_bytes_while_the_writer_keeps_evicting(store):
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_reader_loop, args=(msgspec.msgpack.encode(store.info), child)) for _, child in pipes]
    for proc in procs:
        proc.start()
    assert all(parent.recv_bytes() == b"ready" for parent, _ in pipes)
    window = 6  # messages a reader may lag behind: some of its handles go stale before it reads them
    for i in range(400):
        handle = store.put(f"k{i}", item(i))
        assert handle is not None  # two readers pin at most 3 of the 8 entries each: never full
        for parent, _ in pipes:
            parent.send_bytes(msgspec.msgpack.encode((i, handle)))
            if i >= window:
                parent.recv_bytes()
    for parent, _ in pipes:
        for _ in range(min(window, 400)):
            parent.recv_bytes()
        parent.send_bytes(b"")
    results = [msgspec.msgpack.decode(parent.recv_bytes(), type=tuple[int, int, int]) for parent, _ in pipes]
    for proc in procs:
        proc.join(timeout=30)
    assert all(bad == 0 and ok > 100 for ok, _, bad in results), results
    assert store.stats.evictions > 300 and all(proc.exitcode == 0 for proc in procs)


def _holder(info_bytes: bytes, handle_bytes: bytes, conn) -> None:
    """Hold one entry, check it on request, then keep holding until killed."""
    reader = ShmStoreReader(msgspec.msgpack.decode(info_bytes, type=ShmStoreInfo))
    lease = reader.get(msgspec.msgpack.decode(handle_bytes, type=ShmHandle))
    conn.send_bytes(b"held" if lease is not None else b"stale")
    conn.recv_bytes()
    conn.send_bytes(b"same" if same(lease.data, item(0)) else b"changed")
    conn.recv_bytes()  # blocks until killed


def test_an_entry_is_never_freed_while_held_and_a_dead_reader_does_not_wedge(store):
    handles = fill(store, 0, 8)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(msgspec.msgpack.encode(store.info),
                                             msgspec.msgpack.encode(handles[0]), child))
    proc.start()
    assert parent.recv_bytes() == b"held"
    assert all(fill(store, 8, 40))  # five turns of the ring around the held entry
    assert store.contains("k0")
    parent.send_bytes(b"check")
    assert parent.recv_bytes() == b"same"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=10)
    assert all(fill(store, 48, 16))  # the kernel dropped the dead reader's lock: k0 can go
    assert not store.contains("k0") and store.get(handles[0]) is None
    assert store.stats.fallbacks == 0
