"""One restart counter per rank (`restarts.py`): the supervisor counts against the limit and hands
the count to the engine core it starts, which reports it back in its ready message."""

from __future__ import annotations

from mmserve.config import EngineConfig
from mmserve.frontend.engine_client.restarts import RankRestarts
from mmserve.ipc.messages import EngineCoreOutputs, EngineCoreReady
from mmserve.ipc.serial import MsgpackDecoder, MsgpackEncoder


def test_each_rank_counts_its_own_restarts_up_to_the_limit():
    restarts = RankRestarts(2, limit=2)
    restarts.count(1)
    assert restarts.counts == [0, 1] and restarts.can_restart(1)
    restarts.count(1)
    assert restarts.counts == [0, 2] and not restarts.can_restart(1) and restarts.can_restart(0)


def test_the_count_travels_to_the_engine_core_and_back():
    config = EngineConfig.from_kwargs(data_parallel_size=2).for_rank(1, 3)
    assert (config.parallel.data_parallel_rank, config.parallel.engine_restarts) == (1, 3)
    assert EngineConfig.from_kwargs(data_parallel_size=2).for_rank(1).parallel.engine_restarts == 0
    wire = MsgpackEncoder().encode(EngineCoreReady(64, 10, restarts=config.parallel.engine_restarts))
    ready = MsgpackDecoder(EngineCoreReady | EngineCoreOutputs).decode(wire)
    assert isinstance(ready, EngineCoreReady) and ready.restarts == 3
