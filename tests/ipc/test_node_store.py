"""The node's item store with many writers (several API servers): what one server writes another
finds and copies out, a key being written is invisible and refused to a second writer, pins are
per server, and writer processes racing on shared and distinct keys under eviction leave a
consistent store whose every handle reads back its own bytes or nothing."""

from __future__ import annotations

import multiprocessing
import time

import msgspec

import pytest

from mmserve.ipc.items import ShmStoreInfo
from mmserve.item_store.node_store import NodeStoreClient, NodeStoreServer
from mmserve.ipc.private_dirs import make_ipc_dir, remove_private_dir
from mmserve.item_store.shm_store import ShmStore
from helpers.shm_items_for_tests import CHUNK, item, same

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')


@pytest.fixture
def server():
    ipc_dir = make_ipc_dir()
    s = NodeStoreServer(ShmStore(12 * CHUNK), ipc_dir)
    s.start()
    yield s
    s.close()
    remove_private_dir(ipc_dir)


def client(server: NodeStoreServer, index: int) -> NodeStoreClient:
    return NodeStoreClient(server.address, msgspec.msgpack.decode(server.info, type=ShmStoreInfo), index)


def settle(*clients: NodeStoreClient) -> None:
    """Every message each client sent has been applied (a round trip comes after them)."""
    for c in clients:
        assert c.stats is not None


def test_what_one_server_writes_the_other_finds_and_an_engine_reads(server):
    a, b = client(server, 0), client(server, 1)
    try:
        assert b.fetch("k1") is None
        handle = a.put("k1", item(1), "r1")
        assert handle is not None and b.lookup("k1", "r9") == handle
        copy = b.fetch("k1")
        assert copy is not None and same(copy, item(1))
        copy["pixel_values"] += 1  # a private copy
        engine = server.store.reader()  # what P1 and each TP worker attach
        with engine.get(handle) as lease:
            assert same(lease.data, item(1))
        engine.close()
        assert b.put("k1", item(1), "r9") == handle  # present: nothing written twice
        stats = a.stats
        assert (stats.puts, stats.queries, stats.hits, stats.entries) == (1, 1, 1, 1)  # fetch is not counted
    finally:
        a.close()
        b.close()
    server.store.check_integrity()


def test_a_key_being_written_is_invisible_and_refused_to_a_second_writer():
    with ShmStore(12 * CHUNK) as store:
        handle, fresh = store.reserve("k", CHUNK // 2, "s0:r")
        assert handle is not None and fresh
        assert store.lookup("k") is None and store.peek("k") is None
        assert store.reserve("k", CHUNK // 2, "s1:r") == (None, False)
        store.check_integrity()
        store.seal("k")
        assert store.peek("k") == handle and store.reserve("k", CHUNK // 2, "s1:r") == (handle, False)
        abandoned, _ = store.reserve("j", CHUNK // 2, "s1:r")
        store.seal("j", ok=False)  # the writer failed: an orphan, never an entry
        assert abandoned is not None and store.peek("j") is None and store.get(abandoned) is None
        store.finish_request("s0:r")
        store.finish_request("s1:r")
        assert store.pinned_requests() == []
        store.check_integrity()
        lost, _ = store.reserve("lost", CHUNK // 2, "s0:q")  # its writer never sealed (timed out, failed)
        store.finish_request("s0:q")  # the request's end abandons the reservation: the key is free again
        assert lost is not None and store.get(lost) is None
        assert store.reserve("lost", CHUNK // 2, "s1:q")[1]
        store.seal("lost")
        store.finish_request("s1:q")
        store.check_integrity()


def test_pins_are_per_server_and_end_with_each_request(server):
    a, b = client(server, 0), client(server, 1)
    try:
        handle = a.put("k1", item(1), "r1")
        b.lookup("k1", "r1")  # the same request id on another server is another request
        a.finish_request("r1")
        settle(a, b)
        assert server.store.pinned_requests() == ["s1:r1"]
        b.finish_request("r1")
        a.discard("k1")
        settle(a, b)
        assert server.store.pinned_requests() == [] and a.lookup("k1") is None
        assert server.store.get(handle) is None  # a discarded entry's handles resolve no more
    finally:
        a.close()
        b.close()
    server.store.check_integrity()


def _writer(address: str, info: bytes, index: int, rounds: int, out: multiprocessing.Queue) -> None:
    c = NodeStoreClient(address, msgspec.msgpack.decode(info, type=ShmStoreInfo), index)
    bad = 0
    for n in range(rounds):
        key = n % 6 if n % 2 else 100 * (index + 1) + n  # shared keys race, own keys fill the store
        request = f"r{n}"
        handle = c.put(f"k{key}", item(key), request)
        if handle is not None and (lease := c.get(handle)) is not None:
            bad += not same(lease.data, item(key))
            lease.release()
        c.finish_request(request)
    assert c.stats.puts > 0
    c.close()
    out.put(bad)


def test_writer_processes_racing_under_eviction_leave_a_consistent_store(server):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(server.address, server.info, i, 60, out)) for i in range(3)]
    for p in procs:
        p.start()
    bad = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert bad == [0, 0, 0] and all(p.exitcode == 0 for p in procs)
    stats = server.store.stats
    assert stats.evictions > 0 and stats.puts > 12  # the store turned over while they wrote
    assert server.store.pinned_requests() == []
    server.store.check_integrity()
    for key in range(6):  # every entry holds what its key names
        if (handle := server.store.peek(f"k{key}")) is not None:
            with server.store.get(handle) as lease:
                assert same(lease.data, item(key))


def test_an_owner_failure_answers_the_asker_at_once(server):
    """Issue 40: an exception in the owner sent no reply; the asker waited 10 s, then failed."""
    c = client(server, 0)

    def broken(*args):
        raise KeyError("a bug in the store")

    server.store.lookup = broken  # type: ignore[method-assign]
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="item store failed: KeyError"):
            c.lookup("some-key", "r1")
        assert time.monotonic() - start < 5.0  # an answer, not the 10 s timeout
    finally:
        c.close()
