"""Private temporary directories (ipc:// socket files, metrics files) and their removal after a crash.

Names. `mmserve-<pid>-<random>` under the temp directory (`mmserve-<kind>-<pid>-<random>` for
another kind, e.g. metrics), mode 0700, one per instance.

Owner. The creating process holds an OFD lock on the first byte of `<dir>/.owner` for the
directory's life and removes the directory with `remove_private_dir`. The kernel drops the lock
when that process dies, whatever killed it, so `remove_stale_dirs` (run by every
`make_private_dir`) removes the directories of this user whose owner lock nobody holds. The lock,
not the pid, says whether the owner lives: pids wrap and are reused. A directory younger than
`_INIT_GRACE_S` is left alone (its creator may be between `mkdtemp` and its lock); one without an
`.owner` file (left by an older mmserve) goes once its pid is dead and the grace has passed.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
import time

from mmserve.ipc.lifecycle import is_running
from mmserve.ipc.shm_segment import lock_held, try_lock

OWNER_FILE = ".owner"
_INIT_GRACE_S = 60.0
_NAME_RE = re.compile(r"mmserve-(?:[a-z]+-)?(\d+)-[A-Za-z0-9_]+")
_MAX_IPC_PATH = 100  # sun_path holds 107 bytes on Linux, 103 on macOS
_owned: dict[str, tuple[int, int]] = {}  # path -> (fd of its .owner file, pid of the process that removes it)


def make_private_dir(kind: str | None = None) -> str:
    """A fresh private directory owned by this process (stale ones of dead owners are removed first)."""
    remove_stale_dirs()
    prefix = f"mmserve-{kind}-{os.getpid()}-" if kind else f"mmserve-{os.getpid()}-"
    path = tempfile.mkdtemp(prefix=prefix)
    fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try_lock(fd, fcntl.F_WRLCK, 0)  # a fresh file: nobody else can hold it
    _owned[path] = (fd, os.getpid())
    return path


def make_ipc_dir() -> str:
    """A private directory for one instance's socket files, short enough for ipc:// paths."""
    path = make_private_dir()
    if len(path) > _MAX_IPC_PATH - 20:
        remove_private_dir(path)
        raise RuntimeError(f"temp dir {path!r} is too long for ipc:// socket paths; set TMPDIR to a short path")
    return path


def remove_private_dir(path: str) -> None:
    """Remove `path` and, if this process owns it, drop its owner lock (idempotent)."""
    shutil.rmtree(path, ignore_errors=True)
    owned = _owned.get(path)
    if owned is not None and owned[1] == os.getpid():
        del _owned[path]
        os.close(owned[0])


def remove_stale_dirs(root: str | None = None) -> list[str]:
    """Remove this user's mmserve directories under `root` (the temp directory) whose owner is gone."""
    root = tempfile.gettempdir() if root is None else root
    removed: list[str] = []
    for name in os.listdir(root):
        match = _NAME_RE.fullmatch(name)
        path = os.path.join(root, name)
        if match is not None and _owner_gone(path, int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _owner_gone(path: str, pid: int) -> bool:
    try:
        stat = os.lstat(path)
        if stat.st_uid != os.getuid() or not os.path.isdir(path) or os.path.islink(path):
            return False
        if time.time() - stat.st_mtime < _INIT_GRACE_S:
            return False
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY)
    except FileNotFoundError:  # gone already, or an older mmserve's directory: its pid decides
        return os.path.isdir(path) and not is_running(pid)
    except OSError:
        return False
    try:
        return not lock_held(fd, 0)
    finally:
        os.close(fd)
