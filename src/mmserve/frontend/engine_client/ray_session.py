"""This process's connection to Ray, shared by every Ray rank it starts (`--data-parallel-backend ray`).

`join_ray` connects on first use: to `--ray-address` (else RAY_ADDRESS), or with neither to a small
local cluster it starts; a Ray already initialized here (a test's) is used as it is. `leave_ray`
after the last user shuts down a local cluster `join_ray` started, or disconnects from one it
joined (which keeps running); a Ray it did not initialize is left alone.

A local cluster is started on a thread of its own that lives until the cluster is shut down: Ray
starts its processes with PR_SET_PDEATHSIG, which fires when the *thread* that started them
exits, so a short-lived thread (e.g. one starting ranks in parallel) would take the cluster down.

Importing this module without Ray installed is an ImportError naming `pip install mmserve[ray]`.
"""

from __future__ import annotations

import os
import threading

try:
    import ray
except ImportError as e:  # ray is an optional extra
    raise ImportError("--data-parallel-backend ray needs Ray: pip install mmserve[ray]") from e

from mmserve.config import ParallelConfig

_OBJECT_STORE_BYTES = 128 << 20  # a local cluster's object store: only small control values cross it

_lock = threading.Lock()
_users = 0  # live users (RayEngineProcess handles) of this process
_owned: _LocalCluster | None = None  # the local cluster join_ray started
_connected = False  # join_ray connected to a running cluster


class _LocalCluster:
    """`ray.init` of a local cluster on the thread `mmserve-ray`, which waits until `shutdown`."""

    def __init__(self, num_cpus: int) -> None:
        self._done = threading.Event()
        started = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=_OBJECT_STORE_BYTES)
            except BaseException as e:  # handed to the constructor's caller
                errors.append(e)
                return
            finally:
                started.set()
            self._done.wait()

        self._thread = threading.Thread(target=run, name="mmserve-ray", daemon=True)
        self._thread.start()
        started.wait()
        if errors:
            raise errors[0]

    def shutdown(self) -> None:
        ray.shutdown()
        self._done.set()
        self._thread.join()


def join_ray(parallel: ParallelConfig) -> None:
    """Make sure this process is connected to Ray (see the module docstring); one more user."""
    global _users, _owned, _connected
    with _lock:
        if not ray.is_initialized():
            address = parallel.ray_address or os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address)
                _connected = True
            else:
                _owned = _LocalCluster(_local_cluster_cpus(parallel))
        _users += 1


def leave_ray() -> None:
    """One user fewer; after the last, stop the cluster `join_ray` started or leave the one it joined."""
    global _users, _owned, _connected
    with _lock:
        _users -= 1
        if _users > 0:
            return
        if _owned is not None:
            _owned.shutdown()
        elif _connected and ray.is_initialized():
            ray.shutdown()
        _owned, _connected = None, False


def _local_cluster_cpus(parallel: ParallelConfig) -> int:
    """Logical CPUs of a local cluster: this machine's cores, and at least every rank's CPU bundles."""
    return max(os.cpu_count() or 1, parallel.data_parallel_size * (1 + parallel.tensor_parallel_size))
