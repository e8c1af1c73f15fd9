"""The response store holds what it says (issue 49): its real memory, measured with tracemalloc,
stays within 1.5x its configured size however small its entries (regression: it counted JSON bytes
only and a 4 MiB store of one-turn conversations used 22 MiB); responses are scoped by API key and
cache_salt; the launcher's store answers every API server (the node's one store); conversations
are encoded off the event loop."""

from __future__ import annotations

import asyncio
import threading
import tracemalloc
import uuid

import msgspec

from mmserve.entrypoints.openai.response_store import KeptResponses, ResponseStore, scope_of
from mmserve.entrypoints.openai.response_store_client import ResponseStoreClient
from mmserve.launcher.response_store_server import ResponseStoreServer

TURN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_real_memory_stays_within_the_configured_size():
    capacity = 1 << 20
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = ResponseStore(capacity)
        for _ in range(20_000):  # far more than fit
            store.put(f"{scope_of(None, None)}:resp_{uuid.uuid4().hex}", msgspec.json.encode(TURN))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    store.check_integrity()
    assert store.used_bytes <= capacity and len(store) > 1000
    assert used <= 1.5 * capacity, f"{used} bytes held for a {capacity}-byte store"


def test_responses_are_scoped_by_api_key_and_salt():
    kept = KeptResponses(ResponseStore(1 << 20))

    async def run() -> None:
        await kept.put(scope_of("key-a", "salt"), "resp_1", TURN)
        assert await kept.get(scope_of("key-a", "salt"), "resp_1") == TURN
        for other in (scope_of("key-b", "salt"), scope_of("key-a", None), scope_of(None, "salt"), scope_of(None, None)):
            assert await kept.get(other, "resp_1") is None

    asyncio.run(run())
    assert scope_of("a", "bc") != scope_of("ab", "c") and scope_of(None, "x") != scope_of("", "x")


def test_encoding_runs_off_the_event_loop():
    seen: list[threading.Thread] = []

    class Watched(ResponseStore):
        def put(self, key: str, data: bytes) -> None:
            seen.append(threading.current_thread())
            super().put(key, data)

    async def run() -> None:
        await KeptResponses(Watched(1 << 20)).put("s", "r", TURN)
        assert seen and seen[0] is not threading.current_thread()

    asyncio.run(run())


def test_the_launchers_store_serves_every_api_server(tmp_path):
    server = ResponseStoreServer(1 << 20, str(tmp_path))
    server.start()
    clients = [ResponseStoreClient(server.address) for _ in range(2)]
    try:
        async def run() -> None:
            first, second = (KeptResponses(c) for c in clients)
            await first.put("s", "resp_x", TURN)
            assert await second.get("s", "resp_x") == TURN
            assert await second.get("s", "resp_y") is None

        asyncio.run(run())
        server.store.check_integrity()
    finally:
        for client in clients:
            client.close()
        server.close()
