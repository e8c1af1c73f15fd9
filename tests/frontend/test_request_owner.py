"""A request's frontend state has one owner (issue 48, item 1): while it runs, its id is a key of
one P0 table (`OpenRequests`; the store's pins sit in the store under it), and whatever ends it —
its last output, an abort, the client leaving mid-stream or mid-admission, its engine's death, a
shadow re-run — leaves no entry, output state, pin, processed item in flight or logits row."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any, Callable

import pytest

from helpers.mm_prompts import PARAMS, generate, one
from helpers.tiny_models import make_checkpoint
from mmserve import SamplingParams
from mmserve.config import EngineConfig
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.frontend.engine_client.core_client import EngineDeadError

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("owner"))
    e = AsyncLLM(EngineConfig.from_kwargs(model=path, mm_cache_type="shm", mm_shm_cache_gb=0.01,
                                          cache_verify_rate=1.0, engine_restart_limit=2))
    yield e
    e.shutdown()


def leftovers(engine: AsyncLLM) -> dict[str, Any]:
    """What P0 could hold of a request that has ended."""
    assert engine.transport.shm is not None
    store = engine.transport.shm.store
    return {"open": engine.requests.ids(), "output states": list(engine.output_processor.states),
            "pins": {k: c.pins for k, c in store._entries.items() if c.pins}, "pinned": dict(store._requests),
            "items in flight": dict(engine.input_processor.items.inflight.futures),
            "logits rows": engine.verifier.kept, "shadow running": engine.verifier.busy}


NOTHING = {"open": [], "output states": [], "pins": {}, "pinned": {}, "items in flight": {}, "logits rows": 0,
           "shadow running": False}


async def until(done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not done():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def tables_keyed_by(root: object, key: str) -> list[dict]:
    """Every dict reachable from `root` through mmserve objects that has `key` as a key."""
    found: list[dict] = []
    seen: set[int] = set()
    todo: list[object] = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            if key in obj:
                found.append(obj)
            todo += [v for v in obj.values() if type(v).__module__.startswith("mmserve")]
        elif isinstance(obj, (list, tuple)):
            todo += [v for v in obj if type(v).__module__.startswith("mmserve")]
        elif type(obj).__module__.startswith("mmserve") and hasattr(obj, "__dict__"):
            todo += list(vars(obj).values())
    return found


def test_a_running_requests_id_keys_one_table(engine):
    """Structural: fails on the code before the owner (queues, flights, output states and the store's pins:
    four tables)."""
    async def run() -> list[dict]:
        outputs = engine.generate("one-owner", one(11), LONG)
        await outputs.__anext__()
        try:
            return tables_keyed_by(engine, "one-owner")
        finally:
            await outputs.aclose()

    tables = asyncio.run(run())  # a verifier candidate (rate 1): its logits row is its own too
    assert len(tables) == 2, [sorted(t) for t in tables]
    assert engine.transport.shm is not None
    one_owner = [engine.requests._open, engine.transport.shm.store._requests]  # the store's pins sit in the store
    assert sorted(map(id, tables)) == sorted(map(id, one_owner)), [sorted(t) for t in tables]
    assert leftovers(engine) == NOTHING


def test_finish_abort_and_disconnect_leave_nothing(engine):
    async def run() -> None:
        async for _ in engine.generate("finishes", one(12), PARAMS):
            pass
        await until(lambda: not engine.verifier.busy)  # a cache-served one's shadow re-run ends too
        aborted = engine.generate("aborted", one(12), LONG)
        await aborted.__anext__()
        await engine.abort("aborted")
        await aborted.aclose()
        gone = engine.generate("gone", one(13), LONG)
        await gone.__anext__()
        await gone.aclose()  # the client left mid-stream

    asyncio.run(run())
    assert leftovers(engine) == NOTHING


def test_a_client_gone_during_admission_leaves_nothing(engine):
    async def run() -> None:
        async def consume() -> None:
            async for _ in engine.generate("early", one(14), PARAMS):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)  # admission has begun: its worker thread resolves the image
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: not engine.requests.ids() and not engine.input_processor.items.inflight.futures)

    asyncio.run(run())
    assert leftovers(engine) == NOTHING


def test_a_shadow_re_run_leaves_nothing(engine):
    assert generate(engine, one(15), "cold")
    before = engine.verifier.figures.matches + engine.verifier.figures.mismatches

    async def run() -> None:
        async for _ in engine.generate("warm", one(15), PARAMS):  # served by the caches: verified
            pass
        await until(lambda: not engine.verifier.busy and engine.requests.ids() == [])

    asyncio.run(run())
    assert engine.verifier.figures.matches + engine.verifier.figures.mismatches == before + 1
    assert leftovers(engine) == NOTHING


def test_an_engine_death_leaves_nothing(engine):
    """A stream that cannot resume fails; one that shows nothing until its end moves and finishes."""
    unresumable = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, presence_penalty=0.5)

    async def run() -> None:
        stream = engine.generate("dies", one(16), unresumable)
        await stream.__anext__()
        whole = asyncio.ensure_future(_last(engine.generate("moves", one(17), LONG, stream=False)))
        await until(lambda: engine.requests.get("moves") is not None and engine.requests.get("moves").rank == 0)
        victim = engine.client.engine
        assert victim.process is not None and victim.process.pid is not None
        os.kill(victim.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert (await whole).finished
        await until(lambda: not engine.verifier.busy and engine.requests.ids() == [])

    asyncio.run(run())
    assert leftovers(engine) == NOTHING


async def _last(outputs: Any) -> Any:
    final = None
    async for out in outputs:
        final = out
    return final
