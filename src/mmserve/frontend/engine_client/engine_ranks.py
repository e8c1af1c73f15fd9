"""The data-parallel engine cores seen from P0: one `EngineCoreClient` per rank, each restartable.

The ranks start together; each restarts on its own.

Contract.
- Construction starts every rank at once (one thread each) and returns when all are ready; if
  any cannot start, the others are shut down and the first error is raised.
- A rank is "ready" (serving), "restarting" (its engine died; a new one is being started) or
  "dead" (it died and its restarts, `--engine-restart-limit`, are used up). `mark_dead` retires a
  rank's client (shut down: no process, socket or shm mapping of it is left); `restart` starts a
  new one in a worker thread. Starting, restarting and counting are the `EngineSupervisor`'s
  (`supervisor.py`, the same class the launcher supervises its engine cores with).
- `live()` lists the ready ranks whose process still runs, in rank order.
- With an `Attachment` (`--api-server-count` > 1) the launcher starts and restarts the engine
  cores: a rank's client then binds this API server's own sockets for it and waits for the
  engine core's ready message, and `restart` waits for the launcher's new engine core; the rank's
  restart count is then the launcher's, read from that message (one counter per rank).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from mmserve.config import EngineConfig
from mmserve.frontend.engine_client.attached_engine import AttachedEngineProcess, Attachment, engine_addresses
from mmserve.frontend.engine_client.core_client import EngineCoreClient
from mmserve.frontend.engine_client.supervisor import EngineSupervisor

logger = logging.getLogger(__name__)

_EXIT_GRACE_S = 5.0  # how long a dead rank's engine core may take to exit by itself before it is stopped


def _retire(client: EngineCoreClient) -> None:
    client.engine.join(_EXIT_GRACE_S)
    client.shutdown()


class EngineRanks:
    def __init__(self, config: EngineConfig, model_dir: str, shm_info: bytes | None,
                 attachment: Attachment | None = None) -> None:
        self.config = config
        self.attachment = attachment
        self.model_dir = model_dir
        self.shm_info = shm_info
        n = config.parallel.data_parallel_size
        self.supervisor = EngineSupervisor(n, config.parallel.engine_restart_limit, self._launch)
        self.clients = self.supervisor.engines  # None while a rank has no engine core
        self.status = ["restarting"] * n
        self.restarts = self.supervisor.restarts.counts  # per rank; the launcher's with an attachment
        self.last_error: list[str | None] = [None] * n
        self._retired: list[EngineCoreClient] = []
        with ThreadPoolExecutor(n, thread_name_prefix="mmserve-start") as pool:
            futures = [pool.submit(self._start, rank) for rank in range(n)]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            self.shutdown()
            raise errors[0]  # type: ignore[misc]

    def _launch(self, rank: int, restarts: int) -> EngineCoreClient:
        """Start rank `rank`'s engine core (or, attached, wait for the launcher's) and its client."""
        att = self.attachment
        if att is None:
            return EngineCoreClient(self.config.for_rank(rank, restarts), self.model_dir, shm_info=self.shm_info)
        client = EngineCoreClient(self.config.for_rank(rank), self.model_dir,
                                  engine=AttachedEngineProcess(att.launcher_pid),
                                  addresses=engine_addresses(att.ipc_dir, self.config.parallel.api_server_index, rank))
        self.restarts[rank] = client.restarts  # the launcher's supervisor counts this rank's restarts
        return client

    def _start(self, rank: int) -> EngineCoreClient:
        client = self.supervisor.start(rank)
        self.status[rank] = "ready"
        return client

    def __len__(self) -> int:
        return len(self.clients)

    def client(self, rank: int) -> EngineCoreClient:
        client = self.clients[rank]
        if client is None:
            raise RuntimeError(f"engine rank {rank} has no engine core now ({self.status[rank]})")
        return client

    def live(self) -> list[int]:
        return [r for r, c in enumerate(self.clients) if self.status[r] == "ready" and c is not None and c.is_alive()]

    def can_restart(self, rank: int) -> bool:
        return self.supervisor.can_restart(rank)

    def mark_dead(self, rank: int, reason: str) -> None:
        """Retire rank `rank`'s engine core (it died, or failed): "restarting" while restarts remain."""
        self.last_error[rank] = reason
        self.status[rank] = "restarting" if self.can_restart(rank) else "dead"
        client = self.supervisor.retire(rank)
        if client is not None and self.attachment is not None:
            client.shutdown()  # at once: its socket files must be gone before the next client binds them
        elif client is not None:  # off the event loop: a failed engine core exits by itself first
            self._retired.append(client)
            threading.Thread(target=_retire, args=(client,), name=f"mmserve-retire-dp{rank}", daemon=True).start()

    async def restart(self, rank: int) -> EngineCoreClient:
        """Start a new engine core for `rank` (counted); the exception if it cannot start."""
        try:
            client = await asyncio.to_thread(self.supervisor.restart, rank)
        except BaseException as e:
            self.last_error[rank] = f"restart failed: {e}"
            self.status[rank] = "restarting" if self.can_restart(rank) else "dead"
            raise
        self.status[rank] = "ready"
        return client

    def health(self) -> list[dict[str, object]]:
        """Per rank: its status, restarts so far, and why it last died (if it did)."""
        live = self.live()
        return [{"rank": r, "status": "ready" if r in live else "down" if self.status[r] == "ready" else self.status[r],
                 "restarts": self.restarts[r], "last_error": self.last_error[r]} for r in range(len(self))]

    def shutdown(self) -> None:
        for retired in self._retired:
            retired.shutdown()
        for client in self.supervisor.retire_all():
            client.shutdown()
