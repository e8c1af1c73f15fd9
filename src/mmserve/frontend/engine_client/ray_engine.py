"""An engine core (P1) as a Ray actor: `--data-parallel-backend ray` (pip install mmserve[ray]).

Each rank gets its own placement group (STRICT_PACK, so one node): bundle 0 `{"CPU": 1}` for the
engine core, plus one bundle per tensor-parallel worker (`{"GPU": 1}` on CUDA, else `{"CPU": 1}`).
The actor runs in bundle 0 and serves `run_engine_core` on its main thread until stopped. The
tensor-parallel workers stay local child processes of the actor, spawned by P1's multiprocess
executor exactly as under mp: STRICT_PACK reserved their bundles on the actor's node.

Ray itself is joined or started by `frontend/engine_client/ray_session.py` (each handle is one user of it).
Every node that runs a rank must have mmserve importable.

Not yet: on CUDA with tensor_parallel_size > 1, handing the GPU ids of the rank's bundles to its
workers (Ray sets CUDA_VISIBLE_DEVICES only for the actor's own GPUs; with tp == 1 it holds one).

Liveness: a Ray actor is fate-shared with its owner, so P1 skips the parent-pid check under Ray
(its parent is not P0); the driver watches the actor's `serve` ObjectRef (a local
`ray.wait`), which fails with `RayActorError` once the actor dies however it died.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import time
import uuid
from collections.abc import Mapping
from typing import Any

from mmserve.frontend.engine_client.ray_session import join_ray, leave_ray  # first: names the extra without Ray

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mmserve.config import EngineConfig
from mmserve.engine.core_proc import run_engine_core
from mmserve.frontend.engine_client.engine_process import TERM_GRACE_S
from mmserve.ipc.lifecycle import describe_exit, is_running
from mmserve.models.hub import on_this_node

logger = logging.getLogger(__name__)

_GONE_POLL_S = 0.05
_GONE_WAIT_S = 10.0  # after ray.kill: how long to wait for the actor (and a local one's process) to go
_REMOTE_SIGNAL_S = 30.0  # a signal task on another node may first need a new worker process there


def rank_bundles(config: EngineConfig, extra: Mapping[str, float] | None = None) -> list[dict[str, float]]:
    """The placement group's bundles of one rank.

    The placement group of one rank: the engine core's bundle first (with `extra` resources,
    e.g. a custom resource naming a node), then one per tensor-parallel worker. With
    tensor_parallel_size 1 the model runs inside the engine core, whose bundle then holds the GPU
    (on CUDA)."""
    device = _bundle_device(config)
    tp = config.parallel.tensor_parallel_size
    engine: dict[str, float] = {"CPU": 1.0, **({"GPU": 1.0} if tp == 1 and device == "GPU" else {})}
    return [{**engine, **(extra or {})}] + [{device: 1.0} for _ in range(tp if tp > 1 else 0)]


def _bundle_device(config: EngineConfig) -> str:
    """"GPU" where the config names a CUDA device (the device layer, when it exists), else "CPU"."""
    device = getattr(config, "device", None)
    name = getattr(device, "device", device)
    return "GPU" if isinstance(name, str) and name.startswith("cuda") else "CPU"


@ray.remote(max_restarts=0)
class EngineCoreActor:
    """Hosts one engine core in a Ray worker process (its title: `mmserve::engine_dp<r>`)."""

    def pid(self) -> int:
        return os.getpid()

    def serve(self, config: EngineConfig, model_dir: str, input_addr: str, output_addr: str,
              shm_info: bytes | None) -> int:
        """Run the engine core until SIGTERM / SIGINT or a fatal error; its exit code.

        Runs on the actor's main thread (an actor without concurrency groups), where P1's signal
        handlers work.
        """
        if not os.path.isdir(model_dir):  # resolved on P0's node, not this one
            config = on_this_node(config)
            model_dir = config.model.checkpoint_dir
        try:
            run_engine_core(config, model_dir, input_addr, output_addr, shm_info)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
        return 0


@ray.remote(num_cpus=0)
def _send_signal(pid: int, signum: int) -> None:
    """Signal a process on the node this task runs on (scheduled into the rank's placement group)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


class RayEngineProcess:
    """One rank's engine core as a Ray actor in its own placement group (an `EngineProcess`).

    The constructor joins Ray and reserves the placement group (RuntimeError if it is not placed
    within `timeout_s`), so `is_local` (same Ray node as this driver) is known before `start`.
    `resources`: extra resources for the engine core's bundle (e.g. `{"node_b": 1}` to place it).
    """

    def __init__(self, config: EngineConfig, timeout_s: float, resources: Mapping[str, float] | None = None) -> None:
        self.rank = config.parallel.data_parallel_rank
        self.name = f"mmserve_engine_dp{self.rank}_{uuid.uuid4().hex[:8]}"  # actor and placement group
        self._actor: Any = None
        self._serving: Any = None  # ObjectRef of `serve`: its exit code, or RayActorError
        self._pid: Any = None  # ObjectRef of the actor's pid
        self._pg: Any = None
        self._exit: str | None = None  # how P1 ended, fixed by `stop()`
        self._bundles = rank_bundles(config, resources)
        join_ray(config.parallel)
        self._joined = True
        try:
            self._pg = placement_group(self._bundles, strategy="STRICT_PACK", name=self.name)
            self.node_id: str = self._wait_placed(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.placement_group_id: str = self._pg.id.hex()
        self.is_local = self.node_id == ray.get_runtime_context().get_node_id()
        self.host: str | None = ray.util.get_node_ip_address()

    def _wait_placed(self, timeout_s: float) -> str:
        if not self._pg.wait(timeout_s):
            raise RuntimeError(f"Ray could not place engine core rank {self.rank} (bundles {self._bundles}, "
                               f"STRICT_PACK) within {timeout_s:g} s; available: {ray.available_resources()}")
        return placement_group_table(self._pg)["bundles_to_node_id"][0]

    def start(self, config: EngineConfig, model_dir: str, input_addr: str, output_addr: str,
              shm_info: bytes | None) -> None:
        bundle = self._bundles[0]
        strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=0,
                                                    placement_group_capture_child_tasks=True)
        self._actor = EngineCoreActor.options(  # type: ignore[attr-defined]
            name=self.name, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=strategy).remote()
        self._pid = self._actor.pid.remote()  # runs before `serve`: actor calls run in order
        self._serving = self._actor.serve.remote(config, model_dir, input_addr, output_addr, shm_info)

    def on_ready(self, pid: int) -> None:
        pass  # the actor's own pid call answers where P1 runs

    def is_alive(self) -> bool:
        return (self._exit is None and self._serving is not None
                and not ray.wait([self._serving], timeout=0, fetch_local=False)[0])

    def join(self, timeout_s: float) -> None:
        if self.is_alive():
            ray.wait([self._serving], timeout=timeout_s, fetch_local=False)

    def describe_exit(self) -> str:
        if self._exit is not None:
            return self._exit
        if self._serving is None:
            return "never started"
        try:
            code = ray.get(self._serving, timeout=0)
        except ray.exceptions.GetTimeoutError:
            return "still running"
        except ray.exceptions.RayError as e:  # RayActorError; RayTaskError if `serve` could not even run
            return f"its Ray actor died: {_death_cause(e)}"
        return describe_exit(code)

    def stop(self) -> None:
        """Stop the actor and free its placement group; idempotent.

        SIGTERM the actor's process, `ray.kill` it after `TERM_GRACE_S` (at once if P1 already
        exited), remove the placement group, and leave Ray; `describe_exit` keeps how P1 ended
        (this handle makes no Ray call after). Idempotent."""
        if self._exit is None:
            self._exit = self._stop_in_ray() if ray.is_initialized() else "its Ray session ended"
        if self._joined:
            self._joined = False
            leave_ray()

    def _stop_in_ray(self) -> str:
        if self._actor is not None:
            self._stop_actor()
        if self._pg is not None:
            remove_placement_group(self._pg)
        self._actor = self._pg = None
        return self.describe_exit()

    def _stop_actor(self) -> None:
        pid = self._actor_pid()
        if self.is_alive() and pid is not None:
            self._signal(pid, signal.SIGTERM)
            ray.wait([self._serving], timeout=TERM_GRACE_S, fetch_local=False)
        if self.is_alive():
            logger.warning("engine core rank %d did not stop on SIGTERM; killing its Ray actor", self.rank)
        ray.kill(self._actor, no_restart=True)  # asynchronous: wait until Ray has it dead
        deadline = time.monotonic() + _GONE_WAIT_S
        while _named_actor_exists(self.name) and time.monotonic() < deadline:
            time.sleep(_GONE_POLL_S)
        if self.is_local and pid is not None:
            _wait_gone(pid, max(deadline - time.monotonic(), 0.0))

    def _actor_pid(self) -> int | None:
        """The actor's pid; None if its process never came up (or is gone) within the grace period."""
        try:
            return int(ray.get(self._pid, timeout=TERM_GRACE_S))
        except (ray.exceptions.RayError, ValueError):
            return None

    def _signal(self, pid: int, signum: int) -> None:
        if self.is_local:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
            return
        strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=0)
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(_send_signal.options(scheduling_strategy=strategy).remote(pid, signum), timeout=_REMOTE_SIGNAL_S)


def _death_cause(error: Exception) -> str:
    """The one-line cause of a Ray actor's death.

    The one-line cause in a `RayActorError` ("its worker process has died", "it was killed by
    `ray.kill`"), else the error's first line."""
    text = str(error)
    found = re.search(r"The actor is dead because (.+?)\.(?:\s|$)", text)
    if found:
        return found.group(1)
    return text.splitlines()[0] if text else type(error).__name__


def _named_actor_exists(name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:  # no live actor of that name
        return False
    return True


def _wait_gone(pid: int, timeout_s: float) -> None:
    """Wait until process `pid` of this machine has exited (a zombie not yet reaped counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_running(pid):
            return
        time.sleep(_GONE_POLL_S)
    logger.warning("the Ray actor process %d is still there after ray.kill", pid)
