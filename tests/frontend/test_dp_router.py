"""DPRouter: image- and prefix-aware routing over data-parallel ranks, with its imbalance guard."""

from __future__ import annotations

import pytest

from mmserve.config import EngineConfig
from mmserve.frontend.dp.dp_router import DPRouter
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.sampling_params import SamplingParams

BLOCK = 16


def request(rid: str, images: list[str], text: int = 8, salt: str | None = None, size: int = 40,
            tail: int = 200) -> EngineCoreRequest:
    """A prompt of `text` tokens, then `size` placeholder tokens per image, then `text` tokens from `tail`."""
    tokens, items = list(range(100, 100 + text)), []
    for h in images:
        items.append(MultiModalItem("image", h, None, PlaceholderRange(len(tokens), size)))
        tokens += [7] * size
    tokens += list(range(tail, tail + text))
    return EngineCoreRequest(rid, tokens, items, SamplingParams(), None, 0.0, cache_salt=salt)


def router(n: int = 2, **kw: object) -> DPRouter:
    return DPRouter(EngineConfig.from_kwargs(block_size=BLOCK, data_parallel_size=n, **kw), [64] * n)


def send(r: DPRouter, req: EngineCoreRequest, live: list[int] | None = None, pin: int | None = None) -> int:
    route = r.route(req, live if live is not None else list(range(len(r.ranks))), pin)
    r.on_sent(route, req)
    return route.rank


def test_first_sights_spread_and_repeats_follow_their_images():
    r = router()
    first = {h: send(r, request(f"a{h}", [h])) for h in "abcdef"}
    for h in first:
        r.on_finished(first[h])
    assert sorted(first.values()) == [0, 0, 0, 1, 1, 1]  # nothing cached anywhere: spread by load
    again = {h: send(r, request(f"b{h}", [h], text=3)) for h in "abcdef"}  # other text, same image
    assert again == first
    assert r.decisions["cache"] == 6 and r.decisions["load"] == 6


def test_a_shared_header_does_not_pull_but_a_small_image_does():
    r = router()
    texts = [send(r, request(f"t{i}", [], text=24, tail=300 + 40 * i)) for i in range(4)]  # one shared block
    for rank in texts:
        r.on_finished(rank)
    assert sorted(texts) == [0, 0, 1, 1] and r.decisions["cache"] == 0
    first = send(r, request("a", ["tiny"], size=9))
    r.on_finished(first)
    again = [send(r, request(f"b{i}", ["tiny"], size=9, tail=500)) for i in range(2)]
    assert again == [first, first] and r.decisions["cache"] == 2  # 9 image tokens, less than a block


def test_the_prefix_counts_and_a_salt_is_another_prefix():
    r = router()
    rank = send(r, request("a", ["x"], text=40))
    r.on_finished(rank)
    assert r.ranks[rank].reuse(r.route(request("b", ["x"], text=40), [0, 1]).block_hashes,
                               request("b", ["x"], text=40), BLOCK) >= 5 * BLOCK
    salted = request("c", ["x"], text=40, salt="tenant")
    hashes = r.route(salted, [0, 1]).block_hashes
    assert r.ranks[rank].reuse(hashes, salted, BLOCK) == 40  # only the encoder output is shared


def test_the_imbalance_guard_spills_a_hot_image():
    r = router(dp_imbalance_slack=2)
    ranks = [send(r, request(f"r{i}", ["hot"])) for i in range(8)]  # none finishes
    assert ranks[:3] == [ranks[0]] * 3  # affinity while within the slack
    assert set(ranks) == {0, 1} and r.decisions["imbalance"] > 0
    loads = [view.inflight for view in r.ranks]
    assert max(loads) - min(loads) <= 2 + min(loads) // 2 + 1


def test_load_routing_ignores_caches():
    r = router(dp_routing="load")
    first = send(r, request("a", ["x"]))
    r.on_finished(first)
    second = send(r, request("b", ["x"]))
    assert second != first  # least routed, not where the image is
    assert r.decisions["cache"] == 0


def test_pin_dead_ranks_and_forget():
    r = router(3)
    assert send(r, request("a", ["x"]), pin=2) == 2 and r.decisions["pinned"] == 1
    r.on_finished(2)
    assert send(r, request("b", ["x"]), live=[0, 1]) in (0, 1)  # rank 2 holds it but is not live
    r.forget(2)
    assert not r.ranks[2].items and not r.ranks[2].blocks and r.ranks[2].inflight == 0


def test_mirrors_stay_within_each_ranks_budgets():
    r = DPRouter(EngineConfig.from_kwargs(block_size=BLOCK, data_parallel_size=1, encoder_cache_tokens=100), [4])
    for i in range(10):
        send(r, request(f"r{i}", [f"img{i}"]))
    view = r.ranks[0]
    assert len(view.blocks) <= 4 and view.item_tokens <= 100 and list(view.items) == ["img8", "img9"]


@pytest.mark.parametrize("bad", [dict(data_parallel_size=0), dict(dp_routing="random"),
                                 dict(data_parallel_backend="k8s"), dict(dp_imbalance_slack=-1)])
def test_bad_parallel_settings_are_refused(bad):
    with pytest.raises(ValueError):
        EngineConfig.from_kwargs(**bad)
