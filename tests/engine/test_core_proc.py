"""The engine core in its own process (P1) behind `EngineCoreClient`: same tokens as in
process, aborts free blocks, bad requests come back as errors, and P1's failures and
shutdown leave no process, socket file or temp dir behind."""

from __future__ import annotations

import asyncio
import glob
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time

import pytest

from mmserve import LLM, SamplingParams
from mmserve.config import EngineConfig
from mmserve.frontend.engine_client.core_client import EngineCoreClient, EngineDeadError
from mmserve.ipc.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from helpers.core_client_runs import ENGINE_ARGS, PROMPT, collect, request
from helpers.tiny_models import make_checkpoint, make_image

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("core_proc"))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model=path, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def client(path):
    c = EngineCoreClient(EngineConfig.from_kwargs(model=path, **ENGINE_ARGS), path)
    yield c
    c.shutdown()


def our_ipc_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"mmserve-{os.getpid()}-*")))


def socket_paths(client: EngineCoreClient) -> list[str]:
    return glob.glob(os.path.join(client._res.ipc_dir, "*.sock"))


def wait_until_idle(client: EngineCoreClient, timeout_s: float = 10.0) -> SchedulerStats:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = client.get_output(timeout_s=0.2)
        stats = out.stats if out is not None else None
        if stats and not stats.num_running and not stats.num_waiting:
            return stats
    raise AssertionError("P1 did not become idle")


def test_outputs_match_the_in_process_engine(client, llm):
    assert (client.max_model_len, client.num_kv_blocks) == (64, 32)
    reqs = [request(llm, f"match-{i}", seed=i, max_tokens=4 + 3 * i) for i in range(3)]
    for r in reqs:
        client.add_request(r)
    done, stats = collect(client, {r.request_id for r in reqs})
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": make_image(i)}} for i in range(3)]
    expected = llm.generate(prompts, [r.sampling_params for r in reqs])
    for r, e in zip(reqs, expected):
        assert done[r.request_id] == (e.outputs[0].token_ids, "length", None)
    assert stats.num_free_blocks == stats.num_total_blocks == 32


def test_abort_mid_way_frees_every_block(client, llm):
    client.add_request(request(llm, "long", seed=5, max_tokens=30))
    while not any(o.new_token_ids for o in client.get_output(timeout_s=10).outputs):
        pass
    client.abort_requests(["long", "unknown-id"])
    stats = wait_until_idle(client)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_rejected_request_comes_back_as_an_error_and_the_next_one_runs(client, llm):
    good = request(llm, "after-reject", seed=1, max_tokens=3)
    too_long = EngineCoreRequest("too-long", list(range(1, 101)), [], good.sampling_params, None, time.time())
    client.add_request(too_long)
    client.add_request(good)
    done, stats = collect(client, {"too-long", "after-reject"})
    tokens, reason, error = done["too-long"]
    assert (tokens, reason) == ([], "abort") and "max_model_len" in error
    assert done["after-reject"][1:] == ("length", None) and len(done["after-reject"][0]) == 3
    assert stats.num_free_blocks == stats.num_total_blocks


def test_async_outputs_do_not_block_the_event_loop(client, llm):
    """While the reader awaits P1's outputs, the loop runs other tasks. The request is added from a
    timer thread once the reader waits, so a reader that blocked the loop would hold it until then
    (the ticks counted by that time stay at most one or two); P1's speed cannot change that."""
    async def main() -> tuple[list[int], int]:
        ticks = 0
        seen: list[int] = []

        async def tick() -> None:  # runs whenever the loop is free
            nonlocal ticks
            while True:
                await asyncio.sleep(0)
                ticks += 1

        async def read() -> list[int]:
            tokens: list[int] = []
            while True:
                out: EngineCoreOutputs = await client.get_output_async()
                tokens += [t for o in out.outputs for t in o.new_token_ids]
                if any(o.finish_reason for o in out.outputs):
                    return tokens

        def add() -> None:
            seen.append(ticks)  # the ticks while the reader waited on an empty socket
            client.add_request(request(llm, "async", seed=2, max_tokens=6))

        ticker, reader = asyncio.create_task(tick()), asyncio.create_task(read())
        timer = threading.Timer(0.2, add)
        timer.start()
        try:
            tokens = await asyncio.wait_for(reader, timeout=60)
        finally:
            timer.cancel()
            ticker.cancel()
        return tokens, seen[0]

    expected = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": make_image(2)}},
                            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6))
    tokens, ticks_while_waiting = asyncio.run(main())
    assert ticks_while_waiting >= 10
    assert tokens == expected[0].outputs[0].token_ids


def test_shutdown_stops_p1_and_removes_its_files(client, llm):
    sockets, ipc_dir = socket_paths(client), client._res.ipc_dir
    assert len(sockets) == 2 and client.is_alive()
    client.shutdown()
    client.shutdown()  # idempotent
    assert client.proc.exitcode == 0  # SIGTERM handled: a clean exit
    assert client.proc not in multiprocessing.active_children()
    assert not any(os.path.exists(p) for p in sockets) and not os.path.exists(ipc_dir)
    assert not client.is_alive()
    with pytest.raises(EngineDeadError):
        client.add_request(request(llm, "late", seed=0))
    with pytest.raises(EngineDeadError):
        client.get_output(timeout_s=0.1)


def test_startup_failure_is_a_clear_error_and_leaves_nothing(path, tmp_path):
    no_weights = tmp_path / "no-weights"
    shutil.copytree(path, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    before, children = our_ipc_dirs(), set(multiprocessing.active_children())  # another test's may still end
    with pytest.raises(RuntimeError, match="engine core failed to start: .*safetensors"):
        EngineCoreClient(EngineConfig.from_kwargs(model=str(no_weights)), str(no_weights))
    assert set(multiprocessing.active_children()) <= children
    assert our_ipc_dirs() == before


def test_startup_timeout_kills_p1_and_leaves_nothing(path):
    before, children = our_ipc_dirs(), set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="did not start within"):
        EngineCoreClient(EngineConfig.from_kwargs(model=path, **ENGINE_ARGS), path, startup_timeout_s=0.1)
    assert set(multiprocessing.active_children()) <= children
    assert our_ipc_dirs() == before


def test_p1_killed_makes_the_client_raise_engine_dead(path, llm):
    children = set(multiprocessing.active_children())
    c = EngineCoreClient(EngineConfig.from_kwargs(model=path, **ENGINE_ARGS), path)
    ipc_dir = c._res.ipc_dir
    c.add_request(request(llm, "doomed", seed=0, max_tokens=30))
    os.kill(c.proc.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="exited unexpectedly .killed by SIGKILL"):
        while True:
            c.get_output()
    assert time.monotonic() - start < 5
    assert not c.is_alive()
    with pytest.raises(EngineDeadError):
        c.add_request(request(llm, "after-death", seed=0))
    c.shutdown()
    assert c.proc.exitcode == -signal.SIGKILL
    assert not os.path.exists(ipc_dir) and set(multiprocessing.active_children()) <= children
