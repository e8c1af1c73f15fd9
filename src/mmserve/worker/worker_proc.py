"""A tensor-parallel worker process: one rank's model runner, fed by P1's shared-memory broadcast.

`run_worker` is the process's main (spawned by `MultiprocExecutor` in P1):

1. join the torch.distributed group (gloo on CPU, nccl on CUDA, each rank on its GPU) through a
   file store in P1's private directory, with `COLLECTIVE_TIMEOUT_S` on every collective;
2. load this rank's shard of the model and say `WorkerReady` on the result queue;
3. loop on the broadcast: `InitializeKVCache` (every rank answers `WorkerDone`), `ExecuteModel`
   (every rank runs the step and samples the same tokens; rank 0 alone sends them back),
   `ShutdownWorker` (exit 0).

Any error is sent as `WorkerFailed` and the process exits 1. A rank never waits on P1 blindly:
every `_PARENT_CHECK_S` without a message it checks that P1 lives; an orphaned rank removes
the broadcast segment and P1's socket directory (P1 died without cleaning up) and exits 1.
SIGINT is ignored (Ctrl-C reaches the whole process group; P1 decides); SIGTERM kills.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch
import zmq

from mmserve.config import EngineConfig
from mmserve import log_levels
from mmserve.gc_tuning import pause_collection
from mmserve.serving_process import ServingProcess
from mmserve.ipc.worker_messages import (ExecuteModel, InitializeKVCache, SchedulerOutput, ShmBroadcastInfo,
                                         ShutdownWorker, WorkerDone, WorkerFailed, WorkerInput, WorkerReady,
                                         WorkerStepOutput)
from mmserve.ipc.queues import QueueSender, ipc_path
from mmserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from mmserve.ipc.shm_broadcast import ShmBroadcastReader
from mmserve.ipc.items import ShmStoreInfo
from mmserve.transport.shm_items import ShmItemReader
from mmserve.ipc.shm_segment import unlink_segment

if TYPE_CHECKING:
    from mmserve.worker.model_runner import ModelRunner
    from mmserve.worker.step_inputs import LaunchedStep

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0  # a collective waiting this long for a peer fails the rank
_PARENT_CHECK_S = 1.0
_LINGER_MS = 2000  # how long exit waits for a WorkerFailed to leave


@dataclass(frozen=True)
class WorkerArgs:
    """What a rank is spawned with. `broadcast` and `shm_store` are msgpack-encoded
    (`ShmBroadcastInfo`, and the `ShmStoreInfo` of the multimodal object store, if any)."""

    rank: int
    world_size: int
    config: EngineConfig
    model_dir: str
    broadcast: bytes
    result_address: str
    dist_store_path: str
    parent_pid: int
    shm_store: bytes | None = None
    log_level: int = logging.WARNING  # the engine core's (`log_levels.current()`)


def run_worker(args: WorkerArgs) -> None:
    pause_collection()  # until the worker serves (`ServingProcess.serve`)
    log_levels.adopt(args.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    results: QueueSender = QueueSender(ctx, args.result_address, MsgpackEncoder(), bind=False, linger_ms=_LINGER_MS)
    code = 1
    try:
        code = _serve(args, ctx, results)
    except Exception as e:
        logger.exception("tensor-parallel rank %d failed", args.rank)
        with contextlib.suppress(Exception):
            results.send(WorkerFailed(args.rank, f"{type(e).__name__}: {e}"), timeout_s=1.0)
    finally:
        results.close()
        ctx.term()
    sys.exit(code)


def _serve(args: WorkerArgs, ctx: zmq.Context, results: QueueSender) -> int:
    from mmserve.models.parallel import TensorParallel
    from mmserve.worker.model_runner import ModelRunner

    dp = args.config.parallel
    process = ServingProcess(f"worker_dp{dp.data_parallel_rank}_tp{args.rank}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // (args.world_size * dp.data_parallel_size)))
    _init_distributed(args)
    runner = ModelRunner(args.config, args.model_dir, TensorParallel(args.rank, args.world_size))
    info = msgspec.msgpack.decode(args.broadcast, type=ShmBroadcastInfo)
    reader: ShmBroadcastReader[WorkerInput] = ShmBroadcastReader(info, args.rank, MsgpackDecoder(WorkerInput), ctx)
    items = RankItems(args.shm_store)
    process.serve()
    try:
        results.send(WorkerReady(args.rank, runner.kv_cache_bytes_per_block(), runner.available_kv_cache_bytes(),
                                 runner.dtype_name, runner.model.weight_bytes))
        in_flight: LaunchedStep | None = None  # --async-scheduling: the step launched by the last ExecuteModel
        while True:
            msg = reader.dequeue(timeout_s=_PARENT_CHECK_S)
            if msg is None:
                if os.getppid() != args.parent_pid:
                    logger.warning("rank %d: the engine core died; exiting", args.rank)
                    _remove_orphaned(info, args.result_address)
                    return 1
            elif isinstance(msg, ExecuteModel) and msg.overlap:
                in_flight = _step_overlapped(runner, items.resolve(msg.scheduler_output), in_flight, args.rank,
                                             results)
            elif isinstance(msg, ExecuteModel):
                output = runner.execute_model(items.resolve(msg.scheduler_output))
                if args.rank == 0:
                    results.send(WorkerStepOutput(args.rank, output))
            elif isinstance(msg, InitializeKVCache):
                runner.initialize_kv_cache(msg.num_blocks)
                results.send(WorkerDone(args.rank))
            elif isinstance(msg, ShutdownWorker):
                return 0
    finally:
        items.close()
        reader.close()


def _step_overlapped(runner: ModelRunner, so: SchedulerOutput, in_flight: LaunchedStep | None, rank: int,
                     results: QueueSender) -> LaunchedStep | None:
    """--async-scheduling on one rank: prepare and launch `so` (its forward reads the tokens in
    flight on the device), collect the step before (rank 0 sends its output, which the engine core
    waits for), sample `so`; the step now in flight (None when `so` schedules no token)."""
    launched = runner.launch(runner.prepare(so), in_flight)
    if in_flight is not None:
        output = runner.collect(in_flight)
        if rank == 0:
            results.send(WorkerStepOutput(rank, output))
    runner.sample(launched)
    return launched


def _init_distributed(args: WorkerArgs) -> None:
    import torch.distributed as dist

    from mmserve.worker.device import rank_device

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank runs on this host
    device = rank_device(args.config, args.rank)
    if device.type == "cuda":  # nccl binds each rank to its GPU: the device is set before the group forms
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"  # collectives run where the tensors live
    dist.init_process_group(backend, init_method=f"file://{args.dist_store_path}", rank=args.rank,
                            world_size=args.world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _remove_orphaned(info: ShmBroadcastInfo, result_address: str) -> None:
    """What a SIGKILLed P1 left: its broadcast segment and its socket directory."""
    unlink_segment(info.name)
    shutil.rmtree(os.path.dirname(ipc_path(result_address)), ignore_errors=True)


class RankItems:
    """Gives the items of each `NewRequestData` their tensors on this rank.

    --mm-cache-type lru (and items the store did not take): items arrive with `data`, once per
    request in its `NewRequestData`; nothing to do. --mm-cache-type shm: P1's executor strips
    `data` from items that have a `shm_handle`, and each rank maps them itself from the object
    store (`ShmItemReader`: read-only, zero-copy views), holding the leases until the request is
    finished (`finished_request_ids`); P1 holds its own lease for the request's whole life, so a
    handle it sends is live when a rank reads it.
    """

    def __init__(self, shm_store: bytes | None) -> None:
        self._reader = (None if shm_store is None
                        else ShmItemReader(msgspec.msgpack.decode(shm_store, type=ShmStoreInfo)))

    def resolve(self, so: SchedulerOutput) -> SchedulerOutput:
        if self._reader is None:
            return so
        for rid in so.finished_request_ids:
            self._reader.release(rid)
        for new in so.new_requests:
            if self._reader.attach(new.request_id, new.mm_items):
                raise RuntimeError(f"request {new.request_id}: a multimodal item's shared-memory handle is not live")
        return so

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
