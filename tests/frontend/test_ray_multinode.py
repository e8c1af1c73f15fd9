"""`--data-parallel-backend ray` across nodes (two simulated with `ray.cluster_utils.Cluster`, a
custom resource naming each): the rank on the driver's node maps the shm store, the rank on the
other node is not given it and serves a request whose image travels in-band."""

from __future__ import annotations

import pytest

from mmserve import LLM
from mmserve.config import EngineConfig
from mmserve.frontend.engine_client.core_client import EngineCoreClient
from mmserve.transport.item_transport import ItemTransport
from mmserve.transport.undo import UndoLog
from helpers.core_client_runs import ENGINE_ARGS, collect, expected_tokens, request
from helpers.tiny_models import make_checkpoint
from helpers.shm_listing import shm_listing

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")
pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # starts a two-node Ray cluster and engine-core actors

NODE_ARGS = dict(num_cpus=1, object_store_memory=80 << 20)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    c = cluster_utils.Cluster(initialize_head=True, head_node_args=dict(resources={"node_a": 1}, **NODE_ARGS))
    try:
        c.add_node(resources={"node_b": 1}, **NODE_ARGS)
        ray.init(address=c.address)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ray_multinode"))



def start_ranks(config: EngineConfig, path: str, shm_info: bytes | None, clients: list[EngineCoreClient]) -> None:
    """Rank 0 on the driver's node (node_a), rank 1 on the other (node_b)."""
    from mmserve.frontend.engine_client.ray_engine import RayEngineProcess

    for rank, node in enumerate(["node_a", "node_b"]):
        rank_config = config.for_rank(rank)
        engine = RayEngineProcess(rank_config, timeout_s=60, resources={node: 1})
        clients.append(EngineCoreClient(rank_config, path, shm_info=shm_info, engine=engine))


def test_a_rank_on_another_node_gets_no_shm_and_serves_items_in_band(path):
    llm = LLM(model=path, **ENGINE_ARGS)
    expected = expected_tokens(llm, seed=3, max_tokens=5)
    config = EngineConfig.from_kwargs(model=path, data_parallel_size=2, data_parallel_backend="ray",
                                      mm_cache_type="shm", mm_shm_cache_gb=0.02, **ENGINE_ARGS)
    before = shm_listing()
    transport = ItemTransport(config)
    clients: list[EngineCoreClient] = []
    try:
        start_ranks(config, path, transport.shm_info, clients)
        local, remote = clients
        assert (local.is_local, local.uses_shm) == (True, True)
        assert (remote.is_local, remote.uses_shm) == (False, False)
        by_handle, by_ref = transport.to_wire(request(llm, "by-handle", seed=3, max_tokens=5), UndoLog())
        assert by_ref and all(item.shm_handle is not None for item in by_handle.mm_items)
        local.add_request(by_handle)
        in_band = request(llm, "in-band", seed=3, max_tokens=5)
        assert all(item.data is not None for item in in_band.mm_items)
        remote.add_request(in_band)
        assert collect(local, {"by-handle"})[0]["by-handle"] == (expected, "length", None)
        assert collect(remote, {"in-band"})[0]["in-band"] == (expected, "length", None)
        transport.finish("by-handle")
    finally:
        for c in clients:
            c.shutdown()
        transport.close()
    assert [c.engine.describe_exit() for c in clients] == ["exit code 0"] * 2  # SIGTERM reached both
    table = ray.util.placement_group_table()
    assert [table[c.engine.placement_group_id]["state"] for c in clients] == ["REMOVED", "REMOVED"]
    for c in clients:
        with pytest.raises(ValueError):  # the actor is gone
            ray.get_actor(c.engine.name)
    assert shm_listing() == before
