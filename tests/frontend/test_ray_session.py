"""`--data-parallel-backend ray` with no Ray running: the first rank starts a local cluster (from
a short-lived thread, as EngineRanks starts ranks: the cluster must outlive it), and the last
rank's shutdown stops it (a cluster the client did not start is left alone: see
test_ray_engine.py, whose module fixture owns its cluster). With tensor parallelism the workers
are local children of the engine-core actor."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from mmserve import LLM
from mmserve.config import EngineConfig
from mmserve.frontend.engine_client.core_client import EngineCoreClient
from mmserve.ipc.lifecycle import is_running
from helpers.core_client_runs import ENGINE_ARGS, collect, expected_tokens, request
from helpers.tiny_models import make_checkpoint

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # a Ray cluster, an engine-core actor, its TP workers


def child_titles(pid: int) -> list[str]:
    out = subprocess.run(["ps", "--ppid", str(pid), "-o", "args="], capture_output=True, text=True).stdout
    return sorted(line for line in out.splitlines() if line.startswith("mmserve::"))


def test_ranks_start_a_local_ray_and_the_last_ones_shutdown_stops_it(tmp_path):
    from mmserve.frontend.engine_client.ray_engine import RayEngineProcess

    path = make_checkpoint(tmp_path)
    llm = LLM(model=path, **ENGINE_ARGS)
    config = EngineConfig.from_kwargs(model=path, data_parallel_size=2, tensor_parallel_size=2,
                                      data_parallel_backend="ray", **ENGINE_ARGS)
    assert not ray.is_initialized()
    with ThreadPoolExecutor(1) as pool:  # its thread ends here
        client = pool.submit(EngineCoreClient, config.for_rank(0), path).result()
    try:
        assert ray.is_initialized() and client.is_alive() and client.is_local
        assert ray.cluster_resources()["CPU"] >= 2 * 3  # every rank's bundles fit, whatever the cores
        actor = ray.get(client.engine._pid)
        assert child_titles(actor) == ["mmserve::worker_dp0_tp0", "mmserve::worker_dp0_tp1"]
        client.add_request(request(llm, "tp", seed=1, max_tokens=5))
        assert collect(client, {"tp"})[0]["tp"][0] == expected_tokens(llm, seed=1, max_tokens=5)
        second = RayEngineProcess(config.for_rank(1), timeout_s=10)  # placed, not started
    finally:
        client.shutdown()
    assert client.engine.describe_exit() == "exit code 0"
    assert not is_running(actor)
    assert ray.is_initialized()  # the second rank still uses it
    second.stop()
    second.stop()  # idempotent
    assert not ray.is_initialized()
