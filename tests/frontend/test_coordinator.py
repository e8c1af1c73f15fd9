"""The data-parallel coordinator over real ZMQ sockets: every API server's `RemoteRouter` gets the
same routing picture (a repeat routed by another server goes where the image went), load comes
from the engine cores' `RankStats`, and a restarted rank is forgotten."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from mmserve.config import EngineConfig
from mmserve.launcher.coordinator import Coordinator
from mmserve.frontend.dp.remote_router import RemoteRouter
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.ipc.launcher_messages import RankStats
from mmserve.ipc.messages import EngineCoreRequest, SchedulerStats
from mmserve.ipc.private_dirs import make_ipc_dir, remove_private_dir
from mmserve.ipc.queues import QueueSender
from mmserve.ipc.serial import MsgpackEncoder
from mmserve.sampling_params import SamplingParams


@pytest.fixture
def coordinator():
    ipc_dir = make_ipc_dir()
    c = Coordinator(EngineConfig.from_kwargs(data_parallel_size=2, block_size=16), ipc_dir)
    c.start()
    yield c
    c.close()
    remove_private_dir(ipc_dir)


def request(rid: str, image: str) -> EngineCoreRequest:
    item = MultiModalItem("image", image, {"pixel_values": [0.0]}, PlaceholderRange(1, 64))
    return EngineCoreRequest(rid, [1] + [32000] * 64 + [5, 6, 7], [item], SamplingParams(max_tokens=1), None, 0.0)


def test_a_repeat_routed_by_another_api_server_goes_where_its_image_is(coordinator):
    a, b = RemoteRouter(coordinator.route_address), RemoteRouter(coordinator.route_address)
    try:
        ranks = []
        for i, image in enumerate(["img-a", "img-b"]):
            req = request(f"first-{i}", image)
            route = a.route(req, [0, 1])
            a.on_sent(route, req)
            ranks.append(route.rank)
        assert sorted(ranks) == [0, 1]  # the first sights spread
        for i, image in enumerate(["img-a", "img-b"]):
            req = request(f"repeat-{i}", image)
            route = b.route(req, [0, 1])
            assert (route.rank, route.reason) == (ranks[i], "cache")
            b.on_sent(route, req)
        assert b.decisions["cache"] == 2 and b.decisions["load"] == 2
        coordinator.forget(ranks[0])  # the rank restarted: its caches are empty
        assert b.route(request("after-restart", "img-a"), [0, 1]).reason == "load"
    finally:
        a.close()
        b.close()


def test_load_comes_from_the_engine_cores_stats(coordinator):
    ctx = zmq.Context()
    stats_out = QueueSender(ctx, coordinator.stats_address, MsgpackEncoder(), bind=False)
    router = RemoteRouter(coordinator.route_address)
    try:
        stats_out.send(RankStats(0, SchedulerStats(num_running=6, num_waiting=3, num_free_blocks=10,
                                                   num_total_blocks=100, num_preemptions=0)))
        time.sleep(0.3)  # the coordinator's thread takes it
        routes = {router.route(request(f"r{i}", f"new-{i}"), [0, 1]).rank for i in range(3)}
        assert routes == {1}  # rank 0 is busy: new images go to rank 1
        assert router.route(request("pinned", "x"), [0, 1], forced=0).reason == "pinned"
    finally:
        router.close()
        stats_out.close()
        ctx.destroy(linger=0)


def test_api_server_flags_are_checked_and_split_the_cache_budgets():
    for bad in ({"api_server_count": 0}, {"api_server_count": 2, "data_parallel_backend": "ray"},
                {"api_server_count": 2, "api_server_index": 2}):
        with pytest.raises(ValueError):
            EngineConfig.from_kwargs(**bad)
    config = EngineConfig.from_kwargs(api_server_count=4, mm_ipc_cache_gb=2, mm_processor_cache_gb=1)
    assert config.ipc_cache_bytes_per_server == (2 << 30) // 4
    assert config.processor_cache_bytes_per_server == (1 << 30) // 4
    assert config.for_api_server(3).parallel.api_server_index == 3


def test_offline_llm_refuses_api_servers():
    from mmserve import LLM

    with pytest.raises(ValueError, match="api_server_count"):
        LLM(model="builtin:tiny-llava", api_server_count=2)


def test_a_route_is_awaited_off_the_loop_and_a_coordinator_failure_answers_at_once(coordinator):
    """Issue 40: the round trip ran on the event loop, and an exception in the coordinator left the
    asker waiting out its 10 s timeout before a 500."""
    router = RemoteRouter(coordinator.route_address)
    asked_on: list[int] = []
    real = router._ask

    def ask(*args):
        asked_on.append(threading.get_ident())
        return real(*args)

    router._ask = ask  # type: ignore[method-assign]

    def broken(*args):
        raise KeyError("a bug in the router")

    try:
        async def run() -> None:
            route = await router.route_async(request("fine", "img-a"), [0, 1])
            assert route.rank in (0, 1)
            assert asked_on and threading.get_ident() not in asked_on
        asyncio.run(run())
        coordinator.router.route = broken  # type: ignore[method-assign]
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="coordinator failed: KeyError"):
            router.route(request("doomed", "img-b"), [0, 1])
        assert time.monotonic() - start < 5.0  # an answer, not the 10 s timeout
    finally:
        router.close()
