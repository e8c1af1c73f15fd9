"""Tensor parallelism: TP=2 worker processes give transformers' greedy tokens, fail fast and clean.

Models are tiny (2 ranks of gloo on 2 cores) and outputs short. Each engine with TP=2 spawns two
worker processes; every test checks that none survives it and that /dev/shm is as before.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest

from mmserve import LLM, SamplingParams
from mmserve.config import EngineConfig
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.frontend.engine_client.core_client import EngineDeadError
from mmserve.ipc.worker_messages import SchedulerOutput
from mmserve.models.hf_config import load_model_config
from mmserve.models.parallel import TensorParallel
from mmserve.models.registry import check_shardable
from mmserve.worker.executor import InProcessExecutor
from mmserve.worker.multiproc_executor import WorkerFailedError
from helpers.hf_reference import hf_greedy
from helpers.mm_prompts import PARAMS, generate, one
from helpers.tiny_models import make_checkpoint, make_image

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')

MAX_NEW = 6
SMALL = dict(num_kv_blocks=64)  # allocating the default 1 GiB of KV cache per rank would dominate
VISION = dict(image_size=28, patch_size=14)  # 4 placeholder tokens per image
VARIANTS = {  # heads divide by 2; KV heads split (4/2) or replicated (4/1)
    "gqa-4h-2kv": dict(text_config=dict(num_attention_heads=4, num_key_value_heads=2), vision_config=VISION),
    "gqa-4h-1kv-replicated": dict(text_config=dict(num_attention_heads=4, num_key_value_heads=1),
                                  vision_config=VISION, vision_feature_select_strategy="full"),
}


def shm_listing(*pids: int) -> set[str]:
    """mmserve's segments made by this process or `pids` (a segment's name holds its writer's
    pid; other test runs on the machine make theirs meanwhile)."""
    prefixes = tuple(f"mmserve_{pid}_" for pid in (os.getpid(), *pids))
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefixes)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead (its parent has not reaped it yet)
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def prompts() -> list[dict]:
    a, b = make_image(0, (40, 40)), make_image(1, (64, 48))
    return [
        {"prompt": "USER: hello there ASSISTANT:"},
        {"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": a}},
        {"prompt": "USER: compare <image> and <image> please ASSISTANT:", "multi_modal_data": {"image": [b, a]}},
    ]


def run(llm: LLM, items: list[dict]) -> list[list[int]]:
    outs = llm.generate(items, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_greedy_equals_tp1_and_transformers(variant, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(variant), **VARIANTS[variant])
    items = prompts()
    refs, _ = hf_greedy(path, items, MAX_NEW)
    assert refs[1] != refs[2], "the images must change the outputs, or the test could pass by accident"
    assert run(LLM(model=path, **SMALL), items) == refs
    before = shm_listing()
    # small steps: prefill chunks split the images, and requests run as cached ones between steps
    llm = LLM(model=path, tensor_parallel_size=2, max_num_batched_tokens=8, block_size=4, **SMALL)
    executor = llm.engine.core.executor
    pids = executor.pids
    try:
        assert len(pids) == 2 and len(shm_listing() - before) == 1  # the broadcast ring
        assert run(llm, items) == refs
        assert executor.broadcast.num_messages > 3
        again = llm.generate(items, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))  # every rank copies
        assert [o.outputs[0].token_ids for o in again] == refs  # the repeats' last blocks from the first run's
        assert any(o.num_cached_tokens == len(o.prompt_token_ids) and (len(o.prompt_token_ids) - 1) % 4
                   for o in again), "no repeat copied a last block of more than one token (and took its first token)"
    finally:
        llm.engine.core.shutdown()
    assert not any(alive(pid) for pid in pids)
    assert shm_listing() == before


def test_tp1_starts_no_process(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("tp1"), **VARIANTS["gqa-4h-2kv"])
    before = set(multiprocessing.active_children())
    llm = LLM(model=path, **SMALL)
    assert isinstance(llm.engine.core.executor, InProcessExecutor)
    assert set(multiprocessing.active_children()) == before


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_a_killed_rank_fails_the_step_in_seconds_and_leaves_nothing(tmp_path_factory, overlap):
    """With --async-scheduling too: the engine core then waits in `MultiprocExecutor.collect`."""
    path = make_checkpoint(tmp_path_factory.mktemp("kill"), **VARIANTS["gqa-4h-2kv"])
    before = shm_listing()
    llm = LLM(model=path, tensor_parallel_size=2, max_num_batched_tokens=8, async_scheduling=overlap, **SMALL)
    executor = llm.engine.core.executor
    pids, ipc_dir = executor.pids, executor._res.ipc_dir
    send, steps = executor._send, []

    def send_then_kill(msg):  # rank 1 dies mid-run, while its step is in flight
        send(msg)
        steps.append(msg)
        if len(steps) == 4:
            os.kill(pids[1], signal.SIGKILL)

    executor._send = send_then_kill
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match=r"rank 1 .* died \(killed by SIGKILL\)"):
        run(llm, prompts())
    assert time.monotonic() - start < 10
    assert not any(alive(pid) for pid in pids), "the executor stops every rank when one dies"
    assert shm_listing() == before and not os.path.exists(ipc_dir)
    with pytest.raises(WorkerFailedError, match="rank 1"):  # and stays failed
        llm.engine.core.check_health()


def test_an_error_on_a_rank_is_reported_with_its_reason(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("error"), **VARIANTS["gqa-4h-2kv"])
    before = shm_listing()
    llm = LLM(model=path, tensor_parallel_size=2, **SMALL)
    executor = llm.engine.core.executor
    pids = executor.pids
    unknown = SchedulerOutput([], [], {"no-such-request": 1}, {}, [], [])  # every rank raises KeyError
    with pytest.raises(WorkerFailedError, match=r"tensor-parallel rank \d failed: KeyError: 'no-such-request'"):
        executor.execute_model(unknown)
    assert not any(alive(pid) for pid in pids)
    assert shm_listing() == before


def test_a_killed_rank_takes_the_engine_core_down_cleanly(tmp_path_factory):
    """Through P1: the in-flight request fails with the reason, P1 exits non-zero, no orphan."""
    path = make_checkpoint(tmp_path_factory.mktemp("p1"), **VARIANTS["gqa-4h-2kv"])
    expected = LLM(model=path, **SMALL).generate(one(1), PARAMS)[0].outputs[0].token_ids
    before = shm_listing()
    engine = AsyncLLM(EngineConfig.from_kwargs(model=path, tensor_parallel_size=2, mm_cache_type="shm",
                                               mm_shm_cache_gb=0.02, engine_restart_limit=0, **SMALL))
    p1, p1_engine = engine.client.proc, engine.client.engine
    try:
        assert generate(engine, one(1), "a") == expected  # items reach every rank by shm handle
        workers = worker_pids(p1.pid)
        assert len(workers) == 2
        start = asyncio.run(kill_a_rank_mid_request(engine, workers[-1]))
        p1_engine.join(10)  # beside the thread retiring the dead rank, which joins it too
        assert p1_engine.describe_exit() == "exit code 1" and time.monotonic() - start < 10
        assert not engine.is_healthy  # what /health reports
        assert not any(alive(pid) for pid in workers)
    finally:
        engine.shutdown()
    assert shm_listing(p1.pid, *workers) == before


async def kill_a_rank_mid_request(engine: AsyncLLM, pid: int) -> float:
    """Kill `pid` after the request's first output; its stream must end in EngineDeadError."""
    stream = engine.generate("long", one(2), SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
    await anext(stream)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"rank \d .* died \(killed by SIGKILL\)"):
        async for _ in stream:
            pass
    return start


def worker_pids(parent: int) -> list[int]:
    """`parent`'s tensor-parallel workers, by their process title (not its resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == parent and cmdline.startswith(b"mmserve::worker_dp"):
            found.append(int(entry))
    return sorted(found)


@pytest.mark.parametrize("text, vision, size, message", [
    (dict(num_attention_heads=4, num_key_value_heads=2), {}, 3, r"num_attention_heads \(4\) is not divisible .*\(3\)"),
    (dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48), {}, 2,
     r"num_key_value_heads \(3\) is not divisible"),
    (dict(num_attention_heads=4, num_key_value_heads=1), dict(num_attention_heads=2), 4,
     r"vision tower's num_attention_heads \(2\)"),
])
def test_heads_that_do_not_divide_are_a_clear_error(tmp_path_factory, text, vision, size, message):
    path = make_checkpoint(tmp_path_factory.mktemp("heads"), text_config=text, vision_config=vision)
    with pytest.raises(ValueError, match=message):
        check_shardable(load_model_config(path), TensorParallel(0, size))


def test_the_engine_refuses_them_before_starting_any_process(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("heads"))
    before = shm_listing()
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by --tensor-parallel-size \(3\)"):
        LLM(model=path, tensor_parallel_size=3)
    assert shm_listing() == before


def test_tensor_parallel_size_is_a_flag_and_an_engine_argument():
    import argparse

    from mmserve.config import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert parser.parse_args(["--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    assert EngineConfig.from_kwargs(tensor_parallel_size=2).parallel.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig.from_kwargs(tensor_parallel_size=0)
