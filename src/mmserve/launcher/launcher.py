"""`mmserve serve --api-server-count M` (M > 1): the launcher process and the M API servers.

The launcher (title `mmserve::launcher`):
- resolves the model once (the built-in one is generated here, not M times);
- binds the listening socket once (`entrypoints/openai/listen.py`) and hands it to M API-server
  processes (`mmserve::api_server_<i>`): the kernel gives each connection to one of them;
- makes one ipc directory for every socket between API servers and engine cores, and sets
  PROMETHEUS_MULTIPROC_DIR for the servers (one /metrics answers for all: `metrics.py`);
- with data parallelism, runs the `Coordinator` (one routing picture for every API server);
- owns the node's response store (`launcher/response_store_server.py`): a follow-up's
  `previous_response_id` is found whichever API server takes it;
- with `--mm-cache-type shm` (the default here: `deployment_defaults.py`), owns the node's item
  store (`item_store/node_store.py`): every API server writes into it and finds there what the others
  processed; every engine core reads it;
- starts the engine cores itself, each connected to every API server
  (`frontend/engine_client/attached_engine.py`), and supervises them with the one supervisor class
  (`frontend/engine_client/supervisor.py: EngineSupervisor`, which an API server alone uses for its
  own engine cores): a rank whose process ends is forgotten by the coordinator and started again
  while `--engine-restart-limit` allows (each API server moves its waiting requests meanwhile and
  re-admits the rank on its ready message);
- prints `mmserve: serving ...` once every API server accepts connections.

It exits 0 after SIGTERM / Ctrl-C (API servers first, then engine cores), `ENGINE_DEAD_EXIT_CODE`
once no rank is left to serve, and 1 if an API server dies; either way every child is stopped
and the ipc and metrics directories are removed.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import time
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event

from mmserve.config import EngineConfig
from mmserve.deployment_defaults import with_item_transport
from mmserve import log_levels
from mmserve.entrypoints.openai.api_server import ENGINE_DEAD_EXIT_CODE, serve_api_server
from mmserve.entrypoints.openai.listen import listen_socket
from mmserve.gc_tuning import pause_collection
from mmserve.entrypoints.openai.server_config import ServerConfig
from mmserve.frontend.engine_client.attached_engine import Attachment, engine_addresses
from mmserve.launcher.coordinator import Coordinator
from mmserve.launcher.response_store_server import ResponseStoreServer
from mmserve.frontend.engine_client.engine_process import LocalEngineProcess
from mmserve.frontend.engine_client.supervisor import EngineSupervisor
from mmserve.item_store.node_store import NodeStoreServer
from mmserve.ipc.private_dirs import make_ipc_dir, make_private_dir, remove_private_dir
from mmserve.item_store.shm_store import ShmStore
from mmserve.models.generation_config import announce, load_generation_defaults
from mmserve.models.hub import resolve_engine_model
from mmserve.serving_process import ServingProcess

logger = logging.getLogger(__name__)

SUPERVISE_POLL_S = 0.5
SERVER_STOP_S = 10.0  # how long an API server may take to stop after SIGTERM before it is killed


def run_launcher(server_config: ServerConfig, engine_config: EngineConfig) -> int:
    log_levels.configure(server_config.log_level)
    process = ServingProcess("launcher", retain_freed=False)
    engine_config = with_item_transport(engine_config)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM acts like Ctrl-C
    launcher = Launcher(server_config, engine_config, process)
    try:
        return launcher.run()
    except KeyboardInterrupt:
        return 0
    finally:
        launcher.shutdown()
        signal.signal(signal.SIGTERM, previous)


class Launcher:
    def __init__(self, server_config: ServerConfig, engine_config: EngineConfig,
                 process: ServingProcess | None = None) -> None:
        self.server_config = server_config
        self.process = process
        self.config = engine_config
        self.servers: list[BaseProcess] = []
        parallel = engine_config.parallel
        self.engines = EngineSupervisor(parallel.data_parallel_size, parallel.engine_restart_limit, self._launch)
        self.model_dir = ""
        self.coordinator: Coordinator | None = None
        self.store: NodeStoreServer | None = None
        self.responses: ResponseStoreServer | None = None
        self.ipc_dir = make_ipc_dir()
        self.metrics_dir = make_private_dir("metrics")
        self.sock: socket.socket | None = None

    def run(self) -> int:
        self.config = config = resolve_engine_model(self.config)  # once, before any process starts
        parallel = config.parallel
        self.model_dir = config.model.checkpoint_dir
        # said once, here, before the API servers start (each loads them again, quietly)
        announce(load_generation_defaults(self.model_dir, config.model.generation_config,
                                          config.model.override_generation_config))
        self.sock = listen_socket(self.server_config.host, self.server_config.port)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir  # the API servers inherit it
        if parallel.data_parallel_size > 1:
            self.coordinator = Coordinator(config, self.ipc_dir)
            self.coordinator.start()
        if config.multimodal.uses_shm:
            mm = config.multimodal
            self.store = NodeStoreServer(ShmStore.from_flags(mm.mm_shm_cache_gb, mm.mm_shm_max_object_mb), self.ipc_dir)
            self.store.start()
        self.responses = ResponseStoreServer(int(self.server_config.responses_store_mb * (1 << 20)), self.ipc_dir)
        self.responses.start()
        for rank in range(parallel.data_parallel_size):
            self.engines.start(rank)
        attachment = Attachment(self.ipc_dir, self.coordinator.route_address if self.coordinator else None,
                                self.metrics_dir, self.store.address if self.store else None,
                                self.store.info if self.store else None, self.responses.address, os.getpid())
        ctx = multiprocessing.get_context("spawn")
        ready = [ctx.Event() for _ in range(parallel.api_server_count)]
        for index, event in enumerate(ready):
            proc = ctx.Process(target=_api_server_main, name=f"mmserve-api-server-{index}", daemon=False,
                               args=(self.server_config, config.for_api_server(index), attachment, self.sock, event))
            proc.start()
            self.servers.append(proc)
        while not all(event.is_set() for event in ready):
            if (code := self._check()) is not None:
                return code
            time.sleep(0.05)
        host, port = self.sock.getsockname()[:2]
        print(f"mmserve: serving {config.model.model} on {self.server_config.scheme}://{host}:{port} "
              f"({parallel.api_server_count} API servers)", flush=True)
        if self.process is not None:
            self.process.serve()  # the coordinator's thread routes every request
        while (code := self._check()) is None:
            time.sleep(SUPERVISE_POLL_S)
        return code

    def _launch(self, rank: int, restarts: int) -> LocalEngineProcess:
        """Start rank `rank`'s engine core, connected to every API server (the supervisor's `launch`)."""
        servers = range(self.config.parallel.api_server_count)
        addresses = [engine_addresses(self.ipc_dir, server, rank) for server in servers]
        engine = LocalEngineProcess()
        engine.start(self.config.for_rank(rank, restarts), self.model_dir,
                     [a[0] for a in addresses], [a[1] for a in addresses],
                     self.store.info if self.store else None,
                     self.coordinator.stats_address if self.coordinator else None)
        return engine

    def _check(self) -> int | None:
        """One supervision turn: the exit code when the launcher must stop, else None."""
        for index, proc in enumerate(self.servers):
            if not proc.is_alive():
                logger.error("API server %d ended (%s); stopping", index, proc.exitcode)
                return ENGINE_DEAD_EXIT_CODE if proc.exitcode == ENGINE_DEAD_EXIT_CODE else 1
        for rank in self.engines.dead():
            engine = self.engines.retire(rank)
            assert engine is not None
            logger.error("engine rank %d ended (%s)", rank, engine.describe_exit())
            if self.coordinator is not None:
                self.coordinator.forget(rank)
            if self.engines.can_restart(rank):
                self.engines.restart(rank)
        if all(engine is None for engine in self.engines.engines):
            logger.error("no engine rank can serve; stopping")
            return ENGINE_DEAD_EXIT_CODE
        return None

    def shutdown(self) -> None:
        """API servers first (they finish their responses), then engine cores; then the directories."""
        for proc in self.servers:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + SERVER_STOP_S
        for proc in self.servers:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for engine in self.engines.retire_all():
            engine.stop()
        if self.coordinator is not None:
            self.coordinator.close()
        if self.store is not None:
            self.store.close()
        if self.responses is not None:
            self.responses.close()
        if self.sock is not None:
            self.sock.close()
        remove_private_dir(self.ipc_dir)
        remove_private_dir(self.metrics_dir)


def _api_server_main(server_config: ServerConfig, engine_config: EngineConfig, attachment: Attachment,
                     sock: socket.socket, ready: Event) -> None:
    pause_collection()  # until it serves (`serve_api_server`: ServingProcess.serve)
    code = serve_api_server(server_config, engine_config, attachment, sock, ready.set)
    if code:
        raise SystemExit(code)
