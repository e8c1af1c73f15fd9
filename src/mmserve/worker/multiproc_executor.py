"""The tensor-parallel executor: N worker processes, one per rank, driven from P1.

Channels (all per instance, in a private directory / shared-memory segment named by pid):
- P1 -> every rank: `WorkerInput`s through one `ShmBroadcast` (one writer, N readers; an
  oversized message falls back to a per-rank ZMQ socket). A step's message is its
  `SchedulerOutput`: multimodal items ride only in `NewRequestData`, once per request.
- ranks -> P1: one ZMQ PULL queue of `WorkerEvent`s. Rank 0 returns each step's tokens; every
  rank says `WorkerReady` / `WorkerDone` / `WorkerFailed`.

Failure. P1 never waits blindly: while it waits for a free slot or a reply it checks every
worker process (`_POLL_S`), a rank's own error comes back as `WorkerFailed`, ranks bound every
collective (worker_proc.COLLECTIVE_TIMEOUT_S), and a step that takes longer than
`_STEP_TIMEOUT_S` fails. The first failure shuts the executor down (workers stopped, segment
unlinked, sockets removed) and raises `WorkerFailedError`; every later call raises it again.

Invariant: after `shutdown()` (idempotent; also run when the executor is garbage collected and
at interpreter exit) no worker process, shared-memory segment or socket file of it is left.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq

from mmserve import log_levels
from mmserve.config import EngineConfig
from mmserve.ipc.lifecycle import describe_exit
from mmserve.ipc.worker_messages import (ExecuteModel, InitializeKVCache, ModelRunnerOutput, SchedulerOutput,
                                         ShutdownWorker, WorkerDone, WorkerEvent, WorkerFailed, WorkerInput,
                                         WorkerReady, WorkerStepOutput)
from mmserve.ipc.private_dirs import make_ipc_dir, remove_private_dir
from mmserve.ipc.queues import QueueReceiver, ipc_address
from mmserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from mmserve.ipc.shm_broadcast import ShmBroadcast
from mmserve.models.hf_config import load_model_config
from mmserve.models.parallel import TensorParallel
from mmserve.models.registry import check_shardable
from mmserve.worker.worker_proc import WorkerArgs, run_worker

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # longest wait between checks that every worker lives
_STARTUP_TIMEOUT_S = 300.0
_STEP_TIMEOUT_S = 600.0
_EXIT_GRACE_S = 2.0  # how long workers get to leave after ShutdownWorker / SIGTERM
_LAST_WORDS_S = 0.2  # on a failure: how long to wait for a dying worker's exit status and errors


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died or failed; the executor is shut down."""


@dataclass
class _Resources:
    """What an executor owns; `release()` frees all of it and may run more than once."""

    ipc_dir: str
    ctx: zmq.Context | None = None
    results: QueueReceiver[WorkerEvent] | None = None
    broadcast: ShmBroadcast[Any] | None = None
    procs: list[BaseProcess] = field(default_factory=list)

    def release(self) -> None:
        if self.broadcast is not None and not self.broadcast.closed:
            try:  # live ranks waiting on the ring leave at once; one stuck in a collective gets SIGTERM
                self.broadcast.enqueue(ShutdownWorker(), timeout_s=_POLL_S)
            except TimeoutError:
                pass
        _stop_processes(self.procs)
        if self.broadcast is not None:
            self.broadcast.close()
        if self.results is not None:
            self.results.close()
            self.results = None
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
            self.ctx = None
        remove_private_dir(self.ipc_dir)


def _stop_processes(procs: list[BaseProcess]) -> None:
    """Give the workers `_EXIT_GRACE_S` to leave, then SIGTERM, then SIGKILL; reaps all."""
    started = [p for p in procs if p.pid is not None]
    _join_all(started, _EXIT_GRACE_S)
    for p in started:
        if p.is_alive():
            p.terminate()  # e.g. a rank still waiting in a collective for a dead peer
    _join_all(started, _EXIT_GRACE_S)
    for p in started:
        if p.is_alive():
            logger.warning("tensor-parallel worker pid %d ignored SIGTERM; killing it", p.pid)
            p.kill()
        p.join()


def _join_all(procs: list[BaseProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


class MultiprocExecutor:
    """The model sharded over `config.parallel.tensor_parallel_size` worker processes.

    `shm_store`: the msgpack-encoded `ShmStoreInfo` of the multimodal object store. With it,
    items that have a `shm_handle` cross to the workers as the handle alone and each rank maps
    them from the store (worker_proc.RankItems); without it they carry their tensors.
    """

    def __init__(self, config: EngineConfig, model_dir: str, shm_store: bytes | None = None) -> None:
        self.tp_size = config.parallel.tensor_parallel_size
        check_shardable(load_model_config(model_dir), TensorParallel(0, self.tp_size))  # before any process starts
        self._items_by_handle = shm_store is not None
        self._failed: str | None = None
        self._res = _Resources(make_ipc_dir())
        self._available_bytes: int | None = None
        self._finalizer = weakref.finalize(self, self._res.release)  # also runs at exit
        try:
            self._bytes_per_block = self._start(config, model_dir, shm_store)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig, model_dir: str, shm_store: bytes | None) -> int:
        res = self._res
        res.ctx = zmq.Context()
        result_address = ipc_address(res.ipc_dir, "results")
        res.results = QueueReceiver(res.ctx, result_address, MsgpackDecoder(WorkerEvent), bind=True)
        res.broadcast = ShmBroadcast(self.tp_size, MsgpackEncoder(), res.ctx, res.ipc_dir)
        spawn = multiprocessing.get_context("spawn")
        info = msgspec.msgpack.encode(res.broadcast.info)
        for rank in range(self.tp_size):
            args = WorkerArgs(rank, self.tp_size, config, model_dir, info, result_address,
                              os.path.join(res.ipc_dir, "dist-store"), os.getpid(), shm_store,
                              log_levels.current())
            proc = spawn.Process(target=run_worker, args=(args,), name=f"mmserve-tp-rank-{rank}", daemon=True)
            proc.start()
            res.procs.append(proc)
        ready = self._collect(WorkerReady, range(self.tp_size), _STARTUP_TIMEOUT_S, "start")
        logger.info("%d tensor-parallel workers ready (pids %s)", self.tp_size, [p.pid for p in res.procs])
        profiled = [r.available_kv_cache_bytes for r in ready if r.available_kv_cache_bytes is not None]
        self._available_bytes = min(profiled) if profiled else None  # every rank holds as many blocks
        self.dtype = ready[0].dtype
        self.weight_bytes = sum(r.weight_bytes for r in ready)
        return ready[0].kv_cache_bytes_per_block

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._res.procs if p.pid is not None]

    @property
    def broadcast(self) -> ShmBroadcast[Any]:
        """The step broadcast (its counters: messages, bytes, overflows, time)."""
        self.check_health()
        assert self._res.broadcast is not None
        return self._res.broadcast

    # ---- the executor interface ------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        """One block's bytes on one rank (its KV heads); every rank holds that many blocks."""
        return self._bytes_per_block

    def available_kv_cache_bytes(self) -> int | None:
        """On CUDA, the smallest rank's KV budget after profiling; None on CPU."""
        return self._available_bytes

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._send(InitializeKVCache(num_blocks))
        self._collect(WorkerDone, range(self.tp_size), _STARTUP_TIMEOUT_S, "allocate the KV cache")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._items_by_handle:
            scheduler_output = items_by_handle(scheduler_output)
        self._send(ExecuteModel(scheduler_output))
        return self._collect(WorkerStepOutput, [0], _STEP_TIMEOUT_S, "run a step")[0].output

    # a step in four calls, for --async-scheduling (`engine/core.py: EngineCore._step_overlapped`): each
    # rank prepares and launches a step, collects the one before and samples the new one on one message

    def prepare(self, scheduler_output: SchedulerOutput) -> SchedulerOutput | None:
        """Send the step; it is launched (every rank's step in flight) when it schedules a token."""
        if self._items_by_handle:
            scheduler_output = items_by_handle(scheduler_output)
        self._send(ExecuteModel(scheduler_output, overlap=True))
        return scheduler_output if scheduler_output.num_scheduled_tokens else None

    def launch(self, prepared: SchedulerOutput | None, previous: SchedulerOutput | None) -> SchedulerOutput | None:
        return prepared  # each rank launches on the message `prepare` sent

    def collect(self, launched: SchedulerOutput) -> ModelRunnerOutput:
        """The output of the step before, which rank 0 sends once it has read its tokens."""
        return self._collect(WorkerStepOutput, [0], _STEP_TIMEOUT_S, "run a step")[0].output

    def sample(self, launched: SchedulerOutput) -> None:
        pass  # each rank samples once it has collected the step before

    def check_health(self) -> None:
        """WorkerFailedError if the executor failed or a worker process is gone."""
        if self._failed is not None:
            raise WorkerFailedError(self._failed)
        if not self._finalizer.alive:
            raise WorkerFailedError("the tensor-parallel executor is shut down")
        if any(not p.is_alive() for p in self._res.procs):
            self._fail("a tensor-parallel worker process exited")

    def shutdown(self) -> None:
        self._finalizer()

    # ---- internals -------------------------------------------------------------------------

    def _send(self, msg: WorkerInput) -> None:
        self.check_health()
        assert self._res.broadcast is not None
        try:
            self._res.broadcast.enqueue(msg, timeout_s=_STEP_TIMEOUT_S, on_wait=self.check_health)
        except TimeoutError as e:
            self._fail(f"tensor-parallel workers stopped reading the step broadcast: {e}")

    def _collect(self, kind: type, ranks: Sequence[int], timeout_s: float, what: str) -> list[Any]:
        """One `kind` event from each of `ranks` (in rank order), watching the workers meanwhile."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        assert self._res.results is not None
        while len(got) < len(ranks):
            event = self._res.results.recv(_POLL_S)
            if isinstance(event, WorkerFailed):
                self._fail(f"tensor-parallel rank {event.rank} failed: {event.message}")
            elif event is not None and isinstance(event, kind):
                got[event.rank] = event
            elif event is None:
                self.check_health()
                if time.monotonic() > deadline:
                    self._fail(f"tensor-parallel workers did not {what} within {timeout_s:g} s")
        return [got[r] for r in ranks]

    def _fail(self, fallback: str) -> None:
        """Record the failure, stop everything and raise WorkerFailedError."""
        message = self._failure_reason(fallback)
        self._failed = message
        logger.error("%s; stopping every worker", message)
        self.shutdown()
        raise WorkerFailedError(message)

    def _failure_reason(self, fallback: str) -> str:
        """Best first: a worker killed by a signal (its peers' collective errors follow from it),
        an error a rank reported (`fallback`, or one still queued), another dead worker, `fallback`."""
        reported = fallback if fallback.startswith("tensor-parallel rank") else None
        deadline = time.monotonic() + _LAST_WORDS_S  # let the dead be reaped and last words arrive
        while time.monotonic() < deadline and not self._exited(killed_only=True):
            event = self._res.results.recv(0.01) if self._res.results is not None else None
            if reported is None and isinstance(event, WorkerFailed):
                reported = f"tensor-parallel rank {event.rank} failed: {event.message}"
        killed, exited = self._exited(killed_only=True), self._exited(killed_only=False)
        return (killed and killed[0]) or reported or (exited and exited[0]) or fallback

    def _exited(self, killed_only: bool) -> list[str]:
        """A description of each worker that exited (only those killed by a signal)."""
        return [f"tensor-parallel worker rank {rank} (pid {p.pid}) died ({describe_exit(p.exitcode)})"
                for rank, p in enumerate(self._res.procs)
                if p.exitcode is not None and (p.exitcode < 0 or not killed_only)]


def items_by_handle(so: SchedulerOutput) -> SchedulerOutput:
    """The step's message with items that have a `shm_handle` sent as the handle alone."""
    if not any(i.shm_handle is not None and i.data is not None for n in so.new_requests for i in n.mm_items):
        return so
    new = [msgspec.structs.replace(n, mm_items=[msgspec.structs.replace(i, data=None) if i.shm_handle is not None
                                                else i for i in n.mm_items]) for n in so.new_requests]
    return msgspec.structs.replace(so, new_requests=new)
