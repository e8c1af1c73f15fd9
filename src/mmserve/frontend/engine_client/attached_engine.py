"""Engine cores an API server did not start (`--api-server-count` > 1): the launcher's, attached to.

The launcher starts and restarts them; each API server binds its own pair of sockets per rank, at addresses both sides
derive from the launcher's ipc directory (`engine_addresses`), and attaches.

`AttachedEngineProcess` is the `EngineProcess` for such a rank: `start` and `stop` do nothing
(the launcher owns the process), and the API server watches the process by the pid its
`EngineCoreReady` carries — gone, or a zombie the launcher has not reaped yet, is dead. Until
that message the rank counts as alive while the launcher lives (an engine core outlives it by at
most a second), so an API server still starting when its launcher dies does not wait out the
startup timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass

from mmserve.config import EngineConfig
from mmserve.ipc.lifecycle import is_running
from mmserve.ipc.queues import ipc_address

_JOIN_POLL_S = 0.05


@dataclass(frozen=True)
class Attachment:
    """What an API server needs from its launcher.

    What API server `config.parallel.api_server_index` needs from its launcher: the `ipc_dir` of
    the engine cores' sockets, the coordinator's address (None without data parallelism), the
    `metrics_dir` where the servers share their figures (also PROMETHEUS_MULTIPROC_DIR), with
    `--mm-cache-type shm` the node store's address and `ShmStoreInfo` (msgpack; holds the secret),
    and the address of the node's response store (`launcher/response_store_server.py`)."""

    ipc_dir: str
    coordinator: str | None
    metrics_dir: str
    store: str | None = None
    store_info: bytes | None = dataclasses.field(default=None, repr=False)
    responses: str | None = None
    launcher_pid: int | None = None  # whose death stops the API server (even one still starting)


def engine_addresses(ipc_dir: str, server: int, rank: int) -> tuple[str, str]:
    """(input, output) socket addresses between API server `server` and engine rank `rank`."""
    return ipc_address(ipc_dir, f"in_s{server}_r{rank}"), ipc_address(ipc_dir, f"out_s{server}_r{rank}")


class AttachedEngineProcess:
    is_local = True
    host = None

    def __init__(self, launcher_pid: int | None = None) -> None:
        self.pid: int | None = None
        # the launcher's pid as it handed it down: a restart begun after the launcher died must not
        # take the re-parented parent (init) for the launcher and wait out startup_timeout_s
        self.launcher = os.getppid() if launcher_pid is None else launcher_pid

    def start(self, config: EngineConfig, model_dir: str, input_addr: str | Sequence[str],
              output_addr: str | Sequence[str], shm_info: bytes | None) -> None:
        pass  # the launcher started it

    def on_ready(self, pid: int) -> None:
        self.pid = pid

    def is_alive(self) -> bool:
        if self.pid is None:
            return os.getppid() == self.launcher and is_running(self.launcher)
        return is_running(self.pid)

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(_JOIN_POLL_S)

    def describe_exit(self) -> str:
        return "the launcher died" if self.pid is None else f"its process (pid {self.pid}) ended"

    def stop(self) -> None:
        pass  # the launcher stops it
