"""Where an engine core (P1) runs, seen from P0: one interface, one backend per `--data-parallel-backend`.

`place_engine(config)` decides where P1 will run (for Ray: reserves its placement group), so P0
knows `is_local` and the `host` to bind its sockets on before it starts P1 with `start`. From then
on P0 tells it P1's pid once ready (`on_ready`), asks `is_alive()` (cheap, every 0.5 s),
`describe_exit()` once it died, and `stop()`s it.

- mp (`LocalEngineProcess`): a spawned child process of P0; sockets are ipc:// files.
- ray (`frontend/engine_client/ray_engine.py: RayEngineProcess`): an actor in the rank's placement group, maybe
  on another node; sockets are tcp:// on this node's IP. Ray is imported only then.
- attached (`frontend/engine_client/attached_engine.py`): with `--api-server-count` > 1 the launcher starts
  the engine cores (as mp processes of its own) and each API server attaches to them.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Sequence
from multiprocessing import connection as mp_connection
from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from mmserve import log_levels
from mmserve.config import EngineConfig
from mmserve.gc_tuning import pause_collection
from mmserve.ipc.lifecycle import describe_exit

logger = logging.getLogger(__name__)

TERM_GRACE_S = 5.0  # how long P1 may take to finish its step after SIGTERM before it is killed


class EngineProcess(Protocol):
    """One engine core started by P0.

    `start` is called at most once; `stop` any number of times (also before `start`, or after P1
    died) and releases everything the handle holds.
    """

    @property
    def is_local(self) -> bool:
        """Whether P1 runs on this machine, so it can map this machine's /dev/shm."""
        ...

    @property
    def host(self) -> str | None:
        """The IP P0 binds its tcp:// sockets on for P1 to reach; None: ipc:// socket files."""
        ...

    def start(self, config: EngineConfig, model_dir: str, input_addr: str, output_addr: str,
              shm_info: bytes | None) -> None:
        """Run `run_engine_core(config, model_dir, input_addr, output_addr, shm_info)`; returns at once."""
        ...

    def on_ready(self, pid: int) -> None:
        """P1 said it is ready; `pid` is its process id on its own machine."""
        ...

    def is_alive(self) -> bool:
        """True from `start` until P1 ends; cheap enough to call every 0.5 s."""
        ...

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for P1 to end by itself (e.g. after a fatal error)."""
        ...

    def describe_exit(self) -> str:
        """How P1 ended: "exit code 1", "killed by SIGKILL", "its Ray actor died: ..."."""
        ...

    def stop(self) -> None:
        """SIGTERM (P1 finishes its step and exits 0), force after `TERM_GRACE_S`; returns once P1 is gone.

        Idempotent.
        """
        ...


def place_engine(config: EngineConfig, timeout_s: float) -> EngineProcess:
    """The `EngineProcess` for `config`'s rank under its data-parallel backend.

    The handle for `config`'s rank under `config.parallel.data_parallel_backend`; with Ray its
    placement group is reserved within `timeout_s` (RuntimeError if the cluster cannot fit it, an
    ImportError naming `pip install mmserve[ray]` without Ray)."""
    if config.parallel.data_parallel_backend == "ray":
        from mmserve.frontend.engine_client.ray_engine import RayEngineProcess

        return RayEngineProcess(config, timeout_s)
    return LocalEngineProcess()


class LocalEngineProcess:
    """P1 as a spawned child process of P0 (the mp backend); `process` once started."""

    is_local = True
    host = None

    def __init__(self) -> None:
        self.process: BaseProcess | None = None

    def start(self, config: EngineConfig, model_dir: str, input_addr: str | Sequence[str],
              output_addr: str | Sequence[str], shm_info: bytes | None, stats_addr: str | None = None) -> None:
        """Also (for the launcher of several API servers): an address per server, and the coordinator's
        `stats_addr`. A prestarted process (`prestart_engine_core`) is given the arguments, if there is one."""
        args = (config, model_dir, input_addr, output_addr, shm_info, stats_addr)
        if _PRESTARTED:
            self.process, writer = _PRESTARTED.pop()
            with writer:
                try:
                    writer.send((log_levels.current(), args))
                    return
                except OSError:  # it died on its imports: its exit is reported, as a spawned one's would be
                    return
        rank = config.parallel.data_parallel_rank
        self.process = multiprocessing.get_context("spawn").Process(
            target=_run_engine_core, args=(log_levels.current(), *args),
            name=f"mmserve-engine-dp{rank}", daemon=False)  # a daemon could not start tensor-parallel workers
        _start_deaf_to_ctrl_c(self.process)

    def on_ready(self, pid: int) -> None:
        pass

    def is_alive(self) -> bool:
        """Read from the process's sentinel: reaps nothing, so any thread may ask."""
        proc = self.process
        return proc is not None and proc.pid is not None and not _ended(proc, 0.0)

    def join(self, timeout_s: float) -> None:
        proc = self.process
        if proc is not None and proc.pid is not None and _ended(proc, timeout_s):
            _reap(proc)

    def describe_exit(self) -> str:
        proc = self.process
        ended = proc is not None and proc.pid is not None and _ended(proc, 0.0)
        return describe_exit(_reap(proc) if ended and proc is not None else None)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after `TERM_GRACE_S`; returns once the process is reaped."""
        proc = self.process
        if proc is None or proc.pid is None:
            return
        if not _ended(proc, 0.0):
            proc.terminate()
            if not _ended(proc, TERM_GRACE_S):
                logger.warning("engine core (pid %d) ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                _ended(proc, None)
        _reap(proc)


# Engine cores spawned before this process's own heavy imports, waiting for their arguments.
_PRESTARTED: list[tuple[BaseProcess, mp_connection.Connection]] = []


def prestart_engine_core() -> None:
    """Spawn the engine core now, before the API server imports its own modules: its imports (torch,
    the model code, ~2 s) then run beside the server's instead of after them, and the server is
    up that much sooner. The next `LocalEngineProcess.start` sends it its arguments; unused, it
    exits once `discard_prestarted` (or this process's end) closes its pipe."""
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_prestarted_engine_core, args=(reader,), name="mmserve-engine-dp0", daemon=False)
    _start_deaf_to_ctrl_c(process)
    reader.close()
    _PRESTARTED.append((process, writer))


def discard_prestarted() -> None:
    """Let unused prestarted engine cores exit, and reap them."""
    while _PRESTARTED:
        process, writer = _PRESTARTED.pop()
        writer.close()
        if not _ended(process, TERM_GRACE_S):
            process.kill()
        _reap(process)


def _start_deaf_to_ctrl_c(process: BaseProcess) -> None:
    """Start `process` with SIGINT blocked: the child is born with it blocked (a signal mask
    survives fork and exec), so a Ctrl-C during its interpreter's start prints no traceback there
    (its entry point ignores SIGINT, then unblocks it: `_deaf_to_ctrl_c`); here a Ctrl-C that came
    meanwhile is delivered as `start` returns, not lost. See `_run_engine_core`."""
    if threading.current_thread() is not threading.main_thread():
        process.start()
        return
    # multiprocessing starts its resource tracker at the first spawn with SIGINT blocked, then
    # *unblocks* it: inside our block below, that let a Ctrl-C reach this process mid-`start` and
    # the engine core be born hearing it (its imports' traceback). Started first, it is left alone.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _deaf_to_ctrl_c() -> None:
    """In an engine core process: SIGINT ignored, then unblocked (`_start_deaf_to_ctrl_c`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _prestarted_engine_core(reader: mp_connection.Connection) -> None:
    """A prestarted P1: the engine core's imports, then its arguments from P0 and `_run_engine_core`;
    it exits quietly if P0 closes the pipe first."""
    _deaf_to_ctrl_c()  # see _run_engine_core
    pause_collection()
    try:
        with reader:
            from mmserve.engine import core, core_proc  # noqa: F401  the heavy imports, beside P0's

            log_level, args = reader.recv()
    except EOFError:
        return
    _run_engine_core(log_level, *args)


def _run_engine_core(log_level: int, *args: Any) -> None:
    """P1's entry point: collection paused before the engine core's imports (torch, the model);
    mmserve's records logged at the parent's `log_level`. Ctrl-C reaches P0's whole process group:
    until P1 serves (and takes SIGINT as a stop) it is ignored here, and P0, which stops on it,
    stops P1 — a traceback from each process, or P0 restarting a rank it took for dead, is not what
    a user who pressed Ctrl-C while the model loads should see."""
    _deaf_to_ctrl_c()
    pause_collection()
    log_levels.adopt(log_level)
    from mmserve.engine.core_proc import run_engine_core

    run_engine_core(*args)


# One thread at a time reaps: of two threads in waitpid() on one child, the loser reads ECHILD,
# which multiprocessing takes for "still running" (its join() then returns at once and its
# is_alive() stays True for good). Liveness is read from the sentinel instead, which reaps nothing.
_REAP_LOCK = threading.Lock()
_REAP_WAIT_S = 2.0  # longest an ended process takes to be reapable, or recorded by a reaper outside the lock


def _ended(proc: BaseProcess, timeout_s: float | None) -> bool:
    """Whether `proc` has ended (waiting up to `timeout_s`; None: until it does)."""
    return bool(mp_connection.wait([proc.sentinel], timeout_s))


def _reap(proc: BaseProcess) -> int | None:
    """The exit code of `proc`, which has ended.

    The exit code of `proc`, which has ended; waits out a concurrent reaper (multiprocessing
    itself polls every child whenever this process starts another) until it records the code."""
    with _REAP_LOCK:
        deadline = time.monotonic() + _REAP_WAIT_S
        while (code := proc.exitcode) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return code
