"""The one supervisor of the ranks' engine cores: starts, watches, restarts and counts them.

One class for every deployment shape. With one API server it lives in that server's process
(`EngineRanks`: what it starts is each rank's `EngineCoreClient`, which places the engine core
through its `EngineProcess`); with several it lives in the launcher (`launcher.py`: what it starts
is each rank's `LocalEngineProcess`, connected to every API server), and the API servers attach to
its engine cores. The deployment shape is the `launch` function it is given.

Contract.
- `start(rank)` launches rank `rank`'s engine core with the rank's restart count so far (the one
  counter per rank, `restarts.py: RankRestarts`; the engine core reports it back in its ready
  message) and holds it in `engines[rank]`; a launch that raises leaves the rank without one.
- `retire(rank)` hands back the rank's engine core (the caller stops it) and leaves none;
  `dead()` lists the ranks whose engine core no longer runs (they still hold it until retired).
- `restart(rank)` counts a restart against `--engine-restart-limit` (the caller checked
  `can_restart`) and starts the rank again.
"""

from __future__ import annotations

from typing import Callable, Generic, Protocol, TypeVar

from mmserve.frontend.engine_client.restarts import RankRestarts


class Watched(Protocol):
    def is_alive(self) -> bool: ...


E = TypeVar("E", bound=Watched)


class EngineSupervisor(Generic[E]):
    """Per rank: its engine core (`engines`, None while it has none) and its restarts (`restarts.counts`)."""

    def __init__(self, size: int, restart_limit: int, launch: Callable[[int, int], E]) -> None:
        """`launch(rank, restarts)` starts rank `rank`'s engine core, told its restarts so far."""
        self.engines: list[E | None] = [None] * size
        self.restarts = RankRestarts(size, restart_limit)
        self._launch = launch

    def __len__(self) -> int:
        return len(self.engines)

    def start(self, rank: int) -> E:
        engine = self._launch(rank, self.restarts.counts[rank])
        self.engines[rank] = engine
        return engine

    def can_restart(self, rank: int) -> bool:
        return self.restarts.can_restart(rank)

    def restart(self, rank: int) -> E:
        """Count a restart of `rank` and start it again (the exception if it cannot start)."""
        self.restarts.count(rank)
        return self.start(rank)

    def retire(self, rank: int) -> E | None:
        """Take rank `rank`'s engine core away (the caller stops it); the rank has none after."""
        engine, self.engines[rank] = self.engines[rank], None
        return engine

    def dead(self) -> list[int]:
        """The ranks holding an engine core that no longer runs."""
        return [rank for rank, engine in enumerate(self.engines) if engine is not None and not engine.is_alive()]

    def retire_all(self) -> list[E]:
        """Every engine core held, taken away (the caller stops them)."""
        return [engine for rank in range(len(self)) if (engine := self.retire(rank)) is not None]
