"""P1's entry point: the engine core in its own process, driven by messages from P0.

`run_engine_core` connects to the sockets P0 bound (an input and an output per API server:
`transport/api_server_channels.py`), builds the `EngineCore`, says `EngineCoreReady` to every API server (or
`EngineCoreFailed` and exits 1), then runs the busy loop:

- idle: block on the input socket (and the signal wake-up fd) for up to `_IDLE_POLL_MS`;
- drain every pending input without blocking: a request's items sent by hash alone are restored
  from its API server's IPC receiver cache (hashes it lacks go back in `resend`, and the request
  waits for that server to send it again in full); requests are added (a ValueError comes back
  as an error output with finish_reason "abort"); aborts free their requests at once;
- with work: `step()` once and send each API server the `EngineCoreOutputs` of its requests
  if it has some or the stats changed since its last send (error outputs ride along with the
  next send);
- every turn: exit if the parent died (`os.getppid()` changed: we were re-parented); an
  orphaned P1 removes the socket files its dead parent left. Not under Ray: there P1 is an actor
  whose parent is not P0, and Ray kills it when its owner (P0) dies. Fail (below) if the
  model can no longer run, e.g. a tensor-parallel worker died, even while idle.

SIGTERM / SIGINT end the loop after the current step; the process closes its sockets and
exits 0. Any other error in the loop is sent as `EngineCoreFailed` and the process exits 1.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from mmserve.errors import CLIENT, INTERNAL, ClientError
from mmserve.config import EngineConfig
from mmserve.transport.api_server_channels import ApiServerChannels
from mmserve.malloc_tuning import HeapReserve
from mmserve.serving_process import ServingProcess
from mmserve.ipc.messages import (AbortRequests, CachesReset, EngineCoreFailed, EngineCoreInput, EngineCoreOutput,
                                  EngineCoreReady, EngineCoreRequest, FinishReason, ResetCaches,
                                  SchedulerStats)
from mmserve.ipc.queues import QueueReceiver, QueueSender, ipc_path
from mmserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from mmserve.ipc.items import ShmStoreInfo
from mmserve.transport.shm_items import ShmItemReader

if TYPE_CHECKING:
    from mmserve.engine.core import EngineCore

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000  # how long an idle P1 waits before checking that its parent lives
_HEAP_PAD_BYTES = 64 << 20  # the heap reserve kept populated for items the IPC receiver keeps
_LINGER_MS = 2000  # how long exit waits for unsent messages (e.g. EngineCoreFailed) to leave


def run_engine_core(config: EngineConfig, model_dir: str, input_addr: str | Sequence[str],
                    output_addr: str | Sequence[str], shm_info: bytes | None = None,
                    stats_addr: str | None = None) -> None:
    """P1's main: serve the engine core on `input_addr` (PULL) / `output_addr` (PUSH), one address
    each or one per API server (in server index order), until told to stop; `stats_addr` also
    gets the stats (the data-parallel coordinator). Exit code 0 after SIGTERM / SIGINT, 1 after a
    startup or fatal error."""
    parallel = config.parallel
    # before any other thread starts: ZMQ's I/O thread must allocate in the reserve's heap
    process = ServingProcess(f"engine_dp{parallel.data_parallel_rank}",
                             min(_HEAP_PAD_BYTES, config.multimodal.ipc_cache_bytes))
    if parallel.data_parallel_size > 1 and parallel.tensor_parallel_size == 1:  # ranks share the cores
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel.data_parallel_size))
    input_addrs = [input_addr] if isinstance(input_addr, str) else list(input_addr)
    output_addrs = [output_addr] if isinstance(output_addr, str) else list(output_addr)
    ctx = zmq.Context()
    inputs: QueueReceiver[EngineCoreInput] = QueueReceiver(
        ctx, input_addrs[0], MsgpackDecoder(EngineCoreInput), bind=False)
    for address in input_addrs[1:]:
        inputs.connect(address)
    encoder = MsgpackEncoder()
    channels = ApiServerChannels(
        [QueueSender(ctx, a, encoder, bind=False, linger_ms=_LINGER_MS) for a in output_addrs],
        config.ipc_cache_bytes_per_server, parallel.data_parallel_rank,
        QueueSender(ctx, stats_addr, encoder, bind=False) if stats_addr is not None else None)
    exit_code = 0
    try:
        exit_code = _serve(config, model_dir, inputs, channels, shm_info, input_addrs + output_addrs, process)
    finally:
        inputs.close()
        channels.close()
        ctx.term()
    if exit_code:
        sys.exit(exit_code)


def _serve(config: EngineConfig, model_dir: str, inputs: QueueReceiver[EngineCoreInput],
           channels: ApiServerChannels, shm_info: bytes | None, addresses: list[str],
           process: ServingProcess | None = None) -> int:
    from mmserve.engine.core import EngineCore  # torch and the model load here, in P1 only

    parent_pid = _parent_pid(config)
    shm = None
    try:
        core = EngineCore(config, model_dir, shm_store=shm_info)
    except Exception as e:
        logger.exception("engine core failed to start")
        channels.broadcast(EngineCoreFailed(f"{type(e).__name__}: {e}"))
        return 1
    try:
        shm = ShmItemReader(msgspec.msgpack.decode(shm_info, type=ShmStoreInfo)) if shm_info else None
        proc = EngineCoreProc(core, inputs, channels, parent_pid, shm, process.reserve if process else None)
        if process is not None:
            process.serve()  # before the ready message: a full collection would stall every step
        proc.run(EngineCoreReady(core.max_model_len, core.kv_cache.pool.num_blocks, os.getpid(), core.executor.dtype,
                                 config.parallel.engine_restarts))
        if proc.orphaned:
            _remove_socket_files(*addresses)
        return 0
    except Exception as e:
        logger.exception("engine core failed")
        channels.broadcast(EngineCoreFailed(f"engine core failed: {type(e).__name__}: {e}"), timeout_s=1.0)
        return 1
    finally:
        core.shutdown()
        if shm is not None:
            shm.close()


def _parent_pid(config: EngineConfig) -> int | None:
    """P0's pid, whose death P1 watches for; None under Ray, where the actor's parent is not P0
    and Ray itself kills the actor with its owner (fate sharing)."""
    if config.parallel.data_parallel_backend == "ray":
        return None
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None and parent.pid is not None else os.getppid()


def _remove_socket_files(*addresses: str) -> None:
    """Best effort, for an orphaned P1 only: normally P0 owns and removes these files."""
    for address in addresses:
        path = ipc_path(address)
        with contextlib.suppress(OSError):
            os.remove(path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))  # only once empty


class EngineCoreProc:
    """The busy loop around one `EngineCore`; `run()` returns when asked to stop.

    Each API server's view of P1's state equals the stats of the last `EngineCoreOutputs` it got,
    so a send is due whenever the stats differ (`ApiServerChannels`). With IPC receiver caches
    each server's rides along as layer "ipc_receiver" (P0 compares its key digest with the
    sender's). Without them (`--mm-cache-type shm`, or a 0 GiB IPC cache) P1 keeps no item
    between requests: neither one sent inline nor a view of shared memory it released.
    """

    def __init__(self, core: EngineCore, inputs: QueueReceiver[EngineCoreInput], channels: ApiServerChannels,
                 parent_pid: int | None, shm: ShmItemReader | None = None,
                 reserve: HeapReserve | None = None) -> None:
        self.core = core
        self.reserve = reserve if reserve is not None else HeapReserve(0)
        self.channels = channels
        self.shm = shm
        self._resend: dict[str, list[str]] = {}  # requests to ask P0 for again, with missing hashes
        self.inputs = inputs
        self.parent_pid = parent_pid
        self._stop = False
        self.orphaned = False  # the parent died: nobody else will remove the socket files
        self._pending: list[EngineCoreOutput] = []  # error outputs not sent yet
        self._resets: list[tuple[int, CachesReset]] = []  # cache resets done, not answered yet
        self._wakeup_r, self._wakeup_w = socket.socketpair()  # signal.set_wakeup_fd writes here
        self._old_wakeup_fd = -1
        self._poller = zmq.Poller()
        self._poller.register(inputs.socket, zmq.POLLIN)
        self._poller.register(self._wakeup_r.fileno(), zmq.POLLIN)

    def run(self, ready: EngineCoreReady) -> None:
        """Take over SIGTERM / SIGINT, send `ready`, then serve until stopped."""
        old_handlers = self._install_signal_handlers()
        logger.info("engine core serving (pid %d)", os.getpid())
        try:
            self.channels.broadcast(ready)
            while not self._stop:
                if not self.core.has_unfinished_requests():
                    self._wait_for_input()
                self._drain_inputs()
                if self._stop:
                    break
                if self.core.has_unfinished_requests():
                    step_outputs = self.core.step()
                    self._send(step_outputs.outputs, step_outputs.stats)
                else:
                    self._send([], self.core.stats())
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    logger.warning("engine core's parent process died; exiting")
                    self._stop = self.orphaned = True
                self.core.check_health()
        finally:
            self._restore_signal_handlers(old_handlers)
        logger.info("engine core stopping")

    def _wait_for_input(self) -> None:
        """Block until an input or a signal arrives, or `_IDLE_POLL_MS` passes; before that,
        populate the heap reserve one chunk at a time while nothing has arrived."""
        while self.reserve.pending() and not self._poller.poll(0):
            self.reserve.refill()
        events = dict(self._poller.poll(_IDLE_POLL_MS))
        if self._wakeup_r.fileno() in events:
            self._wakeup_r.recv(4096)

    def _drain_inputs(self) -> None:
        while (msg := self.inputs.recv_nowait()) is not None:
            if isinstance(msg, EngineCoreRequest):
                self._add_request(msg)
            elif isinstance(msg, AbortRequests):
                self.core.abort_requests(msg.request_ids)
                for request_id in msg.request_ids:
                    self._release(request_id)
                    self.channels.forget(request_id)
            elif isinstance(msg, ResetCaches):
                self._reset_caches(msg)

    def _reset_caches(self, ask: ResetCaches) -> None:
        """Reset the caches `ask` names; the answer goes with the asking server's next outputs."""
        try:
            self.channels.check_client(ask.client_index)
        except ValueError:
            logger.error("ignoring a cache reset from unknown API server %d", ask.client_index)
            return
        if ask.mm:
            self.channels.start_epoch(ask.client_index, ask.ipc_epoch)
            self.channels.items_reset_by(ask.client_index)
        self._resets.append((ask.client_index, self.core.reset_caches(ask)))

    def _add_request(self, request: EngineCoreRequest) -> None:
        """Restore the request's items (shm handles, IPC cache) and admit it; items P1 lacks go
        back in `resend`, a bad request comes back as an error output."""
        try:
            self.channels.register(request)
            missing = self.shm.attach(request.request_id, request.mm_items) if self.shm is not None else []
            if not missing and not request.bypass_caches:  # a shadow's items come whole, past the IPC cache
                missing = self.channels.restore(request)
            if missing:
                self._release(request.request_id)
                self._resend[request.request_id] = missing
                return
            self.core.add_request(request)
        except ValueError as e:
            self._release(request.request_id)
            kind = CLIENT if isinstance(e, ClientError) else INTERNAL
            self._pending.append(EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT,
                                                  error=str(e), error_kind=kind))

    def _release(self, request_id: str) -> None:
        if self.shm is not None:
            self.shm.release(request_id)

    def _send(self, step_outputs: list[EngineCoreOutput], stats: SchedulerStats | None) -> None:
        for out in step_outputs:
            if out.finish_reason is not None and not out.siblings_running:
                self._release(out.request_id)
        if self._pending:
            step_outputs = self._pending + step_outputs
            self._pending = []
        self.channels.send(step_outputs, stats, self._resend, self._resets)
        self._resend, self._resets = {}, []

    def _install_signal_handlers(self) -> dict[int, Any]:
        """SIGTERM / SIGINT set `_stop`; the wake-up fd interrupts an idle poll at once."""
        self._wakeup_w.setblocking(False)
        self._old_wakeup_fd = signal.set_wakeup_fd(self._wakeup_w.fileno(), warn_on_full_buffer=False)
        old: dict[int, Any] = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            old[sig] = signal.signal(sig, self._on_signal)
        return old

    def _restore_signal_handlers(self, old: dict[int, Any]) -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._old_wakeup_fd)
        self._wakeup_r.close()
        self._wakeup_w.close()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop = True
