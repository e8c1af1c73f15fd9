"""P0's side of the engine channel: starts P1, sends it requests, receives its outputs.

`EngineCoreClient` places P1 (`frontend/engine_client/engine_process.py`: a local process under mp, a Ray actor
in its own placement group under ray), binds two ZMQ sockets — ipc:// in a private temp directory
(P0 owns the socket files), or tcp:// on this node's IP under Ray, where P1 may run on another
node — starts P1 (`run_engine_core`) and waits for `EngineCoreReady`. After that:
`add_request` / `abort_requests` send without waiting for P1, `get_output` /
`get_output_async` return P1's next `EngineCoreOutputs`, and raise `EngineDeadError` once P1
has died or reported a fatal error (outputs it sent before dying are still returned first).

Invariant: after `shutdown()` (idempotent; also run at interpreter exit and when the client is
garbage collected) no P1 process, socket or socket file of this client is left (under Ray: no
actor, no placement group).
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from mmserve.config import EngineConfig
from mmserve.frontend.engine_client.engine_process import EngineProcess, LocalEngineProcess, place_engine
from mmserve.ipc.messages import (AbortRequests, EngineCoreEvent, EngineCoreFailed, EngineCoreInput,
                                  EngineCoreOutputs, EngineCoreReady, EngineCoreRequest, ResetCaches)
from mmserve.ipc.private_dirs import make_ipc_dir, remove_private_dir
from mmserve.ipc.queues import QueueReceiver, QueueSender, ipc_address, tcp_address
from mmserve.ipc.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

_LIVENESS_POLL_S = 0.5  # longest wait between checks that P1 is alive
_LAST_WORDS_S = 0.2  # after P1 died: how long to wait for its EngineCoreFailed, already sent


class EngineDeadError(RuntimeError):
    """P1 died or failed; the client cannot serve any more requests."""


@dataclass
class _Resources:
    """What a client owns; `release()` frees all of it and may run more than once."""

    ipc_dir: str | None = None  # the ipc:// socket files' directory (P1 on this machine, mp)
    ctx: zmq.Context | None = None
    inputs: QueueSender[EngineCoreInput] | None = None
    outputs: QueueReceiver[EngineCoreEvent] | None = None
    engine: EngineProcess | None = None

    def release(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        for queue in (self.inputs, self.outputs):
            if queue is not None:
                queue.close()
        self.inputs = self.outputs = None
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
            self.ctx = None
        if self.ipc_dir is not None:
            remove_private_dir(self.ipc_dir)


class EngineCoreClient:
    """The engine core running in its own process (P1), seen from P0.

    Attributes: `max_model_len`, `num_kv_blocks` (from P1's ready message); `engine`, where P1
    runs (`proc`: its local process under mp); `is_local`: whether P1 runs on this machine's Ray
    node (always under mp); `uses_shm`: whether P1 got `shm_info` — a rank on another node does
    not (it cannot map this machine's /dev/shm), so its items must go in-band.
    One thread (or one event loop) at a time uses a client.
    """

    def __init__(self, config: EngineConfig, model_dir: str, startup_timeout_s: float = 300.0,
                 shm_info: bytes | None = None, engine: EngineProcess | None = None,
                 addresses: tuple[str, str] | None = None) -> None:
        """Start (or attach to) P1 and wait for its ready message.

        `shm_info`: the msgpack-encoded `ShmStoreInfo` P1 attaches to (with --mm-cache-type shm),
        dropped for a P1 on another node. `engine`: where to run P1, already placed (default:
        `place_engine(config)` by `--data-parallel-backend`); the client owns it from here on.
        `addresses`: the (input, output) ipc:// addresses to bind, in a directory someone else
        owns (an API server attached to the launcher's engine cores); default: a fresh directory."""
        self._res = _Resources(engine=engine)
        self._finalizer = weakref.finalize(self, self._res.release)  # also runs at exit
        self._dead_reason: str | None = None
        try:
            ready = self._start(config, model_dir, startup_timeout_s, shm_info, addresses)
        except BaseException:
            self.shutdown()
            raise
        self.max_model_len = ready.max_model_len
        self.num_kv_blocks = ready.num_kv_blocks
        self.restarts = ready.restarts  # the rank's restarts so far, counted by its supervisor
        self.dtype = ready.dtype

    @property
    def engine(self) -> EngineProcess:
        assert self._res.engine is not None
        return self._res.engine

    @property
    def proc(self) -> BaseProcess:
        """P1's local process (the mp backend only)."""
        engine = self.engine
        assert isinstance(engine, LocalEngineProcess) and engine.process is not None, "no local process"
        return engine.process

    @property
    def is_local(self) -> bool:
        return self.engine.is_local

    @property
    def uses_shm(self) -> bool:
        return self._uses_shm

    def _start(self, config: EngineConfig, model_dir: str, timeout_s: float,
               shm_info: bytes | None, addresses: tuple[str, str] | None) -> EngineCoreReady:
        res = self._res
        start = time.monotonic()
        if res.engine is None:
            res.engine = place_engine(config, timeout_s)
        engine = res.engine
        if addresses is not None:
            input_addr, output_addr = addresses
        elif engine.host is None:
            res.ipc_dir = make_ipc_dir()
            input_addr, output_addr = ipc_address(res.ipc_dir, "input"), ipc_address(res.ipc_dir, "output")
        else:
            input_addr = output_addr = tcp_address(engine.host)
        res.ctx = zmq.Context()
        res.inputs = QueueSender(res.ctx, input_addr, MsgpackEncoder(), bind=True)
        res.outputs = QueueReceiver(res.ctx, output_addr, MsgpackDecoder(EngineCoreEvent), bind=True)
        self._uses_shm = shm_info is not None and engine.is_local
        engine.start(config, model_dir, res.inputs.address, res.outputs.address,
                     shm_info if self._uses_shm else None)
        # multiprocessing's exit handler joins non-daemon children: stop P1 before it runs
        # (atexit runs the latest registration first)
        atexit.register(self._finalizer)
        ready = self._wait_for_ready(timeout_s - (time.monotonic() - start))
        engine.on_ready(ready.pid)
        return ready

    def _wait_for_ready(self, timeout_s: float) -> EngineCoreReady:
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            event = self._outputs.recv(min(remaining, _LIVENESS_POLL_S))
            if isinstance(event, EngineCoreReady):
                return event
            if event is None and not self.engine.is_alive():
                event = self._outputs.recv(_LAST_WORDS_S)
                if event is None:
                    raise RuntimeError(f"the engine core process exited while starting "
                                       f"({self.engine.describe_exit()}); see its log above")
            if isinstance(event, EngineCoreFailed):
                raise RuntimeError(f"the engine core failed to start: {event.message}")
        raise RuntimeError(f"the engine core did not start within {timeout_s:g} s (startup_timeout_s)")

    @property
    def _outputs(self) -> QueueReceiver[EngineCoreEvent]:
        if self._res.outputs is None:
            raise EngineDeadError("the engine core client is shut down")
        return self._res.outputs

    # ---- requests --------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request; P1 answers a bad one with an output carrying `error`."""
        self._send(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Ask P1 to stop these requests and free their blocks; unknown ids are ignored."""
        self._send(AbortRequests(list(request_ids)))

    def reset_caches(self, ask: ResetCaches) -> None:
        """Ask P1 to reset its caches; the answer comes in `EngineCoreOutputs.resets`."""
        self._send(ask)

    def _send(self, msg: EngineCoreInput) -> None:
        self._raise_if_dead()
        assert self._res.inputs is not None
        while True:
            try:
                self._res.inputs.send(msg, timeout_s=_LIVENESS_POLL_S)
                return
            except TimeoutError:  # no peer: P1 not connected yet, or gone
                self._raise_if_dead()

    # ---- outputs ---------------------------------------------------------------------------

    def get_output(self, timeout_s: float | None = None) -> EngineCoreOutputs | None:
        """P1's next outputs; None after `timeout_s` (None: wait until some come or P1 dies)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = _LIVENESS_POLL_S if deadline is None else min(_LIVENESS_POLL_S, deadline - time.monotonic())
            event = self._outputs.recv(max(wait, 0.0))
            if event is not None:
                if (outputs := self._accept(event)) is not None:
                    return outputs
                continue
            self._raise_if_dead()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    async def get_output_async(self) -> EngineCoreOutputs:
        """P1's next outputs, awaited without blocking the event loop; EngineDeadError if P1 dies."""
        while True:
            event = await self._outputs.recv_async(_LIVENESS_POLL_S)
            if event is not None:
                if (outputs := self._accept(event)) is not None:
                    return outputs
                continue
            self._raise_if_dead()

    def _accept(self, event: EngineCoreEvent) -> EngineCoreOutputs | None:
        if isinstance(event, EngineCoreOutputs):
            return event
        if isinstance(event, EngineCoreFailed):
            self._dead_reason = event.message
            raise EngineDeadError(event.message)
        logger.warning("ignoring an unexpected %s from the engine core", type(event).__name__)
        return None

    # ---- life cycle ------------------------------------------------------------------------

    def is_alive(self) -> bool:
        return self._finalizer.alive and self._dead_reason is None and self.engine.is_alive()

    def _raise_if_dead(self) -> None:
        if not self._finalizer.alive:
            raise EngineDeadError("the engine core client is shut down")
        if self._dead_reason is None and not self.engine.is_alive():
            self._dead_reason = f"the engine core process exited unexpectedly ({self.engine.describe_exit()})"
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    def shutdown(self) -> None:
        """Stop P1 and release the sockets and their files.

        Stop P1 (SIGTERM, then SIGKILL after a grace period; under Ray also its actor and
        placement group), close the sockets and remove the socket files and their directory.
        Safe to call more than once."""
        atexit.unregister(self._finalizer)
        self._finalizer()

    def __enter__(self) -> EngineCoreClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
