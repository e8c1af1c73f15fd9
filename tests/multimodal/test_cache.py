"""The processor cache and the IPC cache's mirrored halves, without processes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.multimodal.cache import ENTRY_OVERHEAD_BYTES, IpcReceiverCache, IpcSenderCache, LruBytes, item_size
from mmserve.multimodal.processor_cache import ProcessorCache
from mmserve.ipc.items import MultiModalItem, PlaceholderRange


def data(n_floats: int, fill: float = 1.0) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.full((n_floats,), fill)}


def item(key: str, n_floats: int = 4) -> MultiModalItem:
    return MultiModalItem("image", key, data(n_floats, float(hash(key) % 97)), PlaceholderRange(0, 3))


def test_item_size_counts_tensor_bytes_and_overhead():
    assert item_size(data(10)) == 40 + ENTRY_OVERHEAD_BYTES


def test_lru_evicts_least_recently_used_first_with_exact_bytes():
    lru: LruBytes[int] = LruBytes(300)
    for key in "abc":
        assert lru.put(key, 100)
    lru.touch("a")  # order now b, c, a
    assert lru.put("d", 150)  # evicts b then c
    assert lru.keys() == ["a", "d"] and lru.used == 250 and lru.stats.evictions == 2
    assert not lru.put("huge", 301)
    assert lru.put("e", 50, protected=["a", "d"])  # fits exactly
    assert not lru.put("f", 10, protected=["a", "d", "e"])  # cannot fit without a protected victim
    assert lru.keys() == ["a", "d", "e"] and lru.used == 300
    lru.check_integrity()


def test_processor_cache_hits_refreshes_and_skips_oversized_items():
    cache = ProcessorCache(2 * item_size(data(10)))
    cache.put("a", data(10))
    cache.put("b", data(10))
    assert cache.get("a") is not None  # a is now most recent
    cache.put("c", data(10))  # evicts b
    assert cache.get("b") is None and cache.get("c") is not None
    cache.put("big", data(1000))
    assert cache.get("big") is None
    stats = cache.stats()
    assert (stats.queries, stats.hits, stats.entries) == (4, 2, 2)
    cache.check_integrity()


def test_disabled_processor_cache_keeps_nothing():
    cache = ProcessorCache(0)
    cache.put("a", data(1))
    assert cache.get("a") is None and cache.stats().entries == 0


class Link:
    """P0's sender and P1's receiver joined as the frontend joins them: send, and on a miss start
    a new epoch and resend (`Admission.resend`)."""

    def __init__(self, sender_bytes: int, receiver_bytes: int) -> None:
        self.sender = IpcSenderCache(sender_bytes)
        self.receiver = IpcReceiverCache(receiver_bytes)
        self.resends = 0

    def send(self, items: list[MultiModalItem]) -> list[MultiModalItem]:
        wire = self._wire(items)
        if self.receiver.update(wire, self.sender.epoch):
            self.resends += 1
            self.sender.reset()
            wire = self._wire(items)
            assert not self.receiver.update(wire, self.sender.epoch), "a resend after reset must be whole"
        return wire

    def _wire(self, items: list[MultiModalItem]) -> list[MultiModalItem]:
        cached = self.sender.update(items)
        return [MultiModalItem(i.modality, i.mm_hash, None if hit else i.data, i.placeholder)
                for i, hit in zip(items, cached)]


requests_strategy = st.lists(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(1, 64)),
                                      min_size=0, max_size=4), max_size=30)


@settings(max_examples=150, deadline=None)
@given(requests_strategy, st.integers(0, 6000))
def test_sender_mirrors_receiver_and_p1_gets_what_it_would_uncached(requests, capacity):
    link = Link(capacity, capacity)
    sizes: dict[str, int] = {}
    for req in requests:
        items = [item(k, sizes.setdefault(k, n)) for k, n in req]  # one size per key, like real content
        got = link.send(items)
        assert [g.mm_hash for g in got] == [i.mm_hash for i in items]
        for g, i in zip(got, items):
            assert torch.equal(g.data["pixel_values"], i.data["pixel_values"])
        assert link.sender.keys() == link.receiver.keys()
        link.sender.check_integrity()
        link.receiver.check_integrity()
    assert link.resends == 0


def test_a_repeated_item_crosses_as_its_hash():
    link = Link(10_000, 10_000)
    first = link.send([item("a", 100)])
    second = link.send([item("b", 10), item("a", 100)])
    assert first[0].data is not None and second[1].data is not None  # restored by the receiver
    assert link.sender.stats().hits == 1 and link.sender.stats().bytes_saved == 400


def test_same_item_twice_in_one_request():
    link = Link(10_000, 10_000)
    got = link.send([item("a"), item("a")])
    assert all(g.data is not None for g in got) and link.resends == 0


def test_drift_from_a_lost_update_heals():
    link = Link(10_000, 10_000)
    link.sender.update([item("x")])  # P0 thinks P1 got x; the update never reached P1
    got = link.send([item("x"), item("y")])
    assert link.resends == 1 and all(g.data is not None for g in got)
    assert link.sender.keys() == link.receiver.keys() == ["x", "y"]


def test_drift_from_a_cleared_receiver_heals():
    link = Link(10_000, 10_000)
    link.send([item("a"), item("b")])
    link.receiver = IpcReceiverCache(10_000)  # P1's cache lost (e.g. reset on its side)
    got = link.send([item("b")])
    assert link.resends == 1 and got[0].data is not None
    assert link.sender.keys() == link.receiver.keys() == ["b"]


def test_drift_from_sizes_that_disagree_heals():
    one = item_size(data(100))
    link = Link(3 * one, 2 * one)  # P0 believes P1 holds 3 items; it holds 2
    for key in "abc":
        link.send([item(key, 100)])
    got = link.send([item("a", 100)])  # P1 evicted a
    assert link.resends == 1 and got[0].data is not None


def test_reset_clears_both_sides_together():
    link = Link(10_000, 10_000)
    link.send([item("a")])
    link.sender.reset()
    got = link.send([item("a")])
    assert got[0].data is not None and link.resends == 0
    assert link.receiver.epoch == link.sender.epoch == 1


def test_under_shm_neither_side_keeps_an_ipc_cache():
    """Both sides size the IPC cache from one derived property: 0 under --mm-cache-type shm, so P1
    keeps neither inline items nor views of released shared memory."""
    from mmserve.config import EngineConfig

    shm = EngineConfig.from_kwargs(mm_cache_type="shm", mm_ipc_cache_gb=4)
    lru = EngineConfig.from_kwargs(mm_cache_type="lru", mm_ipc_cache_gb=1)
    assert shm.multimodal.ipc_cache_bytes == 0 and lru.multimodal.ipc_cache_bytes == 1 << 30
    assert shm.needs_item_hash and EngineConfig.from_kwargs(
        mm_processor_cache_gb=0, mm_ipc_cache_gb=0, enable_prefix_caching=False).needs_item_hash  # encoder cache
