"""`--data-parallel-backend ray` for one rank: the engine core as a Ray actor in its own
placement group serves the same tokens as the mp backend; its death (ray.kill, SIGKILL) makes the
client raise EngineDeadError; shutdown leaves no actor, placement group or process."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import pytest

from mmserve import LLM
from mmserve.config import EngineConfig
from mmserve.frontend.engine_client.core_client import EngineCoreClient, EngineDeadError
from mmserve.frontend.engine_client.engine_process import place_engine
from mmserve.ipc.lifecycle import is_running
from helpers.core_client_runs import ENGINE_ARGS, collect, request
from helpers.tiny_models import make_checkpoint

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # starts a Ray cluster and engine-core actors

RAY_ARGS = dict(data_parallel_backend="ray", **ENGINE_ARGS)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ray_engine"))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model=path, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def client(path):
    c = EngineCoreClient(EngineConfig.from_kwargs(model=path, **RAY_ARGS), path)
    yield c
    c.shutdown()


def serve_two(client: EngineCoreClient, llm: LLM) -> dict[str, list[int]]:
    for i in range(2):
        client.add_request(request(llm, f"r{i}", seed=i, max_tokens=4 + 3 * i))
    done, stats = collect(client, {"r0", "r1"})
    assert stats is not None and stats.num_free_blocks == stats.num_total_blocks
    return {rid: tokens for rid, (tokens, _, _) in done.items()}


def actor_pid(client: EngineCoreClient) -> int:
    return ray.get(client.engine._pid)


def assert_nothing_left(client: EngineCoreClient, pid: int) -> None:
    engine = client.engine
    with pytest.raises(ValueError):  # a dead named actor is gone from the namespace
        ray.get_actor(engine.name)
    assert ray.util.placement_group_table()[engine.placement_group_id]["state"] == "REMOVED"
    assert not is_running(pid)


def test_a_ray_rank_serves_the_tokens_of_the_mp_backend(client, llm, path):
    assert client.is_local and not client.uses_shm  # no shm_info given
    assert client._res.inputs.address.startswith("tcp://") and client._res.ipc_dir is None
    with open(f"/proc/{actor_pid(client)}/cmdline", "rb") as f:
        assert f.read().startswith(b"mmserve::engine_dp0")
    mp = EngineCoreClient(EngineConfig.from_kwargs(model=path, **ENGINE_ARGS), path)
    try:
        expected = serve_two(mp, llm)
    finally:
        mp.shutdown()
    assert serve_two(client, llm) == expected
    client.engine.join(0.1)  # a serving engine core does not end by itself
    assert client.is_alive()


def test_shutdown_stops_the_actor_and_removes_its_placement_group(client, llm):
    pid = actor_pid(client)
    client.shutdown()
    client.shutdown()  # idempotent
    assert client.engine.describe_exit() == "exit code 0"  # SIGTERM handled: a clean exit
    assert_nothing_left(client, pid)
    assert not client.is_alive()
    with pytest.raises(EngineDeadError):
        client.add_request(request(llm, "late", seed=0))


@pytest.mark.parametrize("how, cause", [("ray.kill", "it was killed by `ray.kill`"),
                                        ("SIGKILL", "its worker process has died")])
def test_a_dead_actor_makes_the_client_raise_engine_dead(path, llm, how, cause):
    c = EngineCoreClient(EngineConfig.from_kwargs(model=path, **RAY_ARGS), path)
    pid = actor_pid(c)
    c.add_request(request(llm, "doomed", seed=0, max_tokens=30))
    if how == "ray.kill":
        ray.kill(c.engine._actor)
    else:
        os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError) as dead:
        while True:
            c.get_output()
    assert str(dead.value).endswith(f"exited unexpectedly (its Ray actor died: {cause})")
    assert time.monotonic() - start < 5 and not c.is_alive()
    start = time.monotonic()
    c.engine.join(5.0)
    assert time.monotonic() - start < 1  # at once: the actor is gone
    c.shutdown()
    assert_nothing_left(c, pid)


def test_a_startup_failure_is_a_clear_error_and_leaves_nothing(path, tmp_path):
    no_weights = tmp_path / "no-weights"
    shutil.copytree(path, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    before = ray.util.placement_group_table()
    with pytest.raises(RuntimeError, match="engine core failed to start: .*safetensors"):
        EngineCoreClient(EngineConfig.from_kwargs(model=str(no_weights), **RAY_ARGS), str(no_weights))
    created = [v for k, v in ray.util.placement_group_table().items() if k not in before]
    assert [v["state"] for v in created] == ["REMOVED"]
    assert not [a for a in ray.util.list_named_actors() if a.startswith("mmserve_engine_")]


def test_an_unplaceable_rank_is_a_clear_error_and_leaves_no_placement_group(path):
    config = EngineConfig.from_kwargs(model=path, tensor_parallel_size=4, **RAY_ARGS)  # 5 CPUs of 2
    before = ray.util.placement_group_table()
    with pytest.raises(RuntimeError, match=r"could not place engine core rank 0 .*within 0.5 s"):
        EngineCoreClient(config, path, startup_timeout_s=0.5)
    created = {k: v for k, v in ray.util.placement_group_table().items() if k not in before}
    assert [v["state"] for v in created.values()] == ["REMOVED"]


def test_without_ray_the_backend_names_the_extra(path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails
    monkeypatch.delitem(sys.modules, "mmserve.frontend.engine_client.ray_engine")
    monkeypatch.delitem(sys.modules, "mmserve.frontend.engine_client.ray_session")
    with pytest.raises(ImportError, match=r"pip install mmserve\[ray\]"):
        place_engine(EngineConfig.from_kwargs(model=path, **RAY_ARGS), timeout_s=1.0)


def test_data_parallel_on_ray_equals_one_engine(path, llm):
    """DP=2 with every rank a Ray actor: the same greedy tokens as one local engine, both ranks used."""
    from mmserve.sampling_params import SamplingParams
    from helpers.tiny_models import make_image

    prompts = [{"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": make_image(600 + i)}}
               for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    dp = LLM(model=path, data_parallel_size=2, **RAY_ARGS)
    try:
        got = [o.outputs[0].token_ids for o in dp.generate(prompts, params)]
        served = [r.requests for r in dp.engine.dp_figures().ranks]
    finally:
        dp.shutdown()
    assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert served == [2, 2]
