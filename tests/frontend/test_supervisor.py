"""The one supervisor (`supervisor.py: EngineSupervisor`): what it launches is the deployment shape's
(an API server's clients, the launcher's processes); starting, watching, restarting and counting are its own."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mmserve.frontend.engine_client.supervisor import EngineSupervisor


@dataclass
class Engine:
    rank: int
    restarts: int
    alive: bool = True

    def is_alive(self) -> bool:
        return self.alive


def test_each_rank_starts_with_its_restart_count_and_is_restarted_up_to_the_limit():
    launched: list[Engine] = []

    def launch(rank: int, restarts: int) -> Engine:
        launched.append(Engine(rank, restarts))
        return launched[-1]

    supervisor = EngineSupervisor(2, 1, launch)
    first = [supervisor.start(rank) for rank in range(2)]
    assert supervisor.dead() == []
    first[1].alive = False
    assert supervisor.dead() == [1]
    assert supervisor.retire(1) is first[1] and supervisor.engines[1] is None and supervisor.dead() == []
    assert supervisor.can_restart(1)
    again = supervisor.restart(1)
    assert (again.rank, again.restarts) == (1, 1) and supervisor.engines == [first[0], again]
    assert supervisor.restarts.counts == [0, 1] and not supervisor.can_restart(1) and supervisor.can_restart(0)
    assert supervisor.retire_all() == [first[0], again] and supervisor.engines == [None, None]


def test_a_launch_that_fails_leaves_the_rank_without_an_engine_core_but_counted():
    def launch(rank: int, restarts: int) -> Engine:
        if restarts:
            raise RuntimeError("cannot start")
        return Engine(rank, restarts)

    supervisor = EngineSupervisor(1, 3, launch)
    supervisor.start(0)
    supervisor.retire(0)
    with pytest.raises(RuntimeError, match="cannot start"):
        supervisor.restart(0)
    assert supervisor.engines == [None] and supervisor.restarts.counts == [1]
