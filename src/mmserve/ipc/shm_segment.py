"""One shared-memory segment's life: create, attach, byte locks, unlink, and clean up after crashes.

Names. `mmserve_<writer pid>_<uuid4 hex>` under /dev/shm (mode 0600), unique per instance, so
two servers run side by side and a reader attaches by name alone.

Space. `create_segment` checks the free space of /dev/shm first and then reserves the whole
segment with `posix_fallocate`, so a full /dev/shm is a ShmSpaceError at startup that names
`--mm-shm-cache-gb` (Docker's default /dev/shm is 64 MB), never a SIGBUS later.

Locks. Byte-range OFD locks (`F_OFD_SETLK`): they belong to an open file description, so two
opens of the segment conflict even inside one process, and the kernel drops them when the
holder closes the file or dies, whatever killed it. Locks on bytes past EOF are allowed.

Owner and crash recovery. The writer holds an exclusive lock on `OWNER_BYTE` for its life and
unlinks its segment on `unlink_segment`, at exit, and on SIGTERM (its handler unlinks, then runs
the previous handler; the default one re-kills the process so the exit status stays "killed by
SIGTERM"). After a SIGKILL, `remove_stale_segments` (run by every new writer) unlinks the segments
whose owner lock nobody holds (the lock, not the pid, says the writer lives: it holds across pid
namespaces and pid reuse) and whose writer pid is dead or that are older than `_INIT_GRACE_S`
(so a writer between create and lock, microseconds, is not taken for dead). A forked child
never unlinks its parent's segments.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import mmap
import os
import re
import signal
import struct
import threading
import time
import uuid
from typing import Any

from mmserve.ipc.lifecycle import is_running

SHM_DIR = "/dev/shm"
OWNER_BYTE = 1 << 62  # locked by the writer for its life; past EOF, so never a chunk's byte
_INIT_GRACE_S = 60.0
_NAME_RE = re.compile(r"mmserve_(\d+)_[0-9a-f]{32}")
_FLOCK = "hhqqi4x"  # struct flock: type, whence, start, len, pid (0 for OFD locks)
_owned: dict[str, int] = {}  # segment name -> pid of the writer that must unlink it
_hooks_installed = False
_prev_sigterm: Any = None


class ShmSpaceError(RuntimeError):
    """/dev/shm cannot hold the segment, or does not exist."""


def create_segment(size: int) -> tuple[str, int, mmap.mmap]:
    """A new segment of `size` bytes owned by this process: its name, fd and writable mapping."""
    check_shm_space(size)
    name = f"mmserve_{os.getpid()}_{uuid.uuid4().hex}"
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    _register(name)
    try:
        try_lock(fd, fcntl.F_WRLCK, OWNER_BYTE)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise ShmSpaceError(_space_message(size, _free_bytes())) from e
            raise
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # no page faults on first writes
        return name, fd, mmap.mmap(fd, size, flags=flags)
    except BaseException:
        os.close(fd)
        unlink_segment(name)
        raise


def open_segment(name: str, writable: bool = False) -> tuple[int, mmap.mmap]:
    """A reader's fd and read-only mapping of the segment `name` (read-write when `writable`,
    for protocols whose readers write acknowledgements, e.g. ipc/shm_broadcast.py)."""
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"not an mmserve shared-memory segment name: {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR if writable else os.O_RDONLY)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if writable else 0)  # a writer: no page faults
    try:
        return fd, mmap.mmap(fd, os.fstat(fd).st_size, flags=flags, prot=prot)
    except BaseException:
        os.close(fd)
        raise


def unlink_segment(name: str) -> None:
    """Remove the name (mappings stay valid until unmapped); a missing one is ignored."""
    _owned.pop(name, None)
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def check_shm_space(nbytes: int) -> None:
    """Raise ShmSpaceError, naming the flag to lower, unless /dev/shm has `nbytes` free."""
    if not os.path.isdir(SHM_DIR):
        raise ShmSpaceError(f"{SHM_DIR} does not exist: the shared-memory store needs Linux; "
                            "use --mm-cache-type lru")
    free = _free_bytes()
    if nbytes > free:
        raise ShmSpaceError(_space_message(nbytes, free))


def remove_stale_segments() -> list[str]:
    """Unlink the segments of writers that are gone (e.g. killed with SIGKILL); their names."""
    removed: list[str] = []
    if not os.path.isdir(SHM_DIR):
        return removed
    for name in os.listdir(SHM_DIR):
        match = _NAME_RE.fullmatch(name)
        if match is None or not _owner_gone(os.path.join(SHM_DIR, name), int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:  # gone already, or another user's
            pass
    return removed


def try_lock(fd: int, kind: int, offset: int) -> bool:
    """Set (F_RDLCK / F_WRLCK) or drop (F_UNLCK) an OFD lock on one byte; False if another open
    file holds a conflicting lock (never waits)."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, offset, 1, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def lock_held(fd: int, offset: int) -> bool:
    """True if another open file holds any lock on that byte."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
    return struct.unpack(_FLOCK, answer)[0] != fcntl.F_UNLCK


def _free_bytes() -> int:
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize


def _space_message(nbytes: int, free: int) -> str:
    return (f"the shared-memory store needs {nbytes / 2**20:.0f} MiB but {SHM_DIR} has "
            f"{free / 2**20:.0f} MiB free: lower --mm-shm-cache-gb (to at most {free * 0.9 / 2**30:.2f}), "
            f"enlarge {SHM_DIR} (docker run --shm-size=...), or use --mm-cache-type lru")


def _owner_gone(path: str, pid: int) -> bool:
    """No writer holds the owner lock, and its pid is dead or the segment is past the grace age."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # gone already, or another user's
        return False
    try:
        if lock_held(fd, OWNER_BYTE):  # the writer lives (even one in another pid namespace)
            return False
        return not is_running(pid) or time.time() - os.fstat(fd).st_mtime > _INIT_GRACE_S
    finally:
        os.close(fd)


def _register(name: str) -> None:
    """Unlink `name` at exit and on SIGTERM unless unlinked before."""
    global _hooks_installed, _prev_sigterm
    if not _hooks_installed:
        _hooks_installed = True
        atexit.register(_unlink_owned)
        if threading.current_thread() is threading.main_thread():
            _prev_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    _owned[name] = os.getpid()


def _unlink_owned() -> None:
    for name, pid in list(_owned.items()):
        if pid == os.getpid():  # not in a forked child
            unlink_segment(name)


def _on_sigterm(signum: int, frame: Any) -> None:
    _unlink_owned()
    if callable(_prev_sigterm):
        _prev_sigterm(signum, frame)
    elif _prev_sigterm != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def unmap_segment(buf: memoryview, mapping: Any) -> None:
    """Release this process's view and mapping of a segment; while views made from `buf` (tensors)
    still live, the mapping stays until the last of them is gone."""
    try:
        buf.release()
        mapping.close()
    except BufferError:
        pass
