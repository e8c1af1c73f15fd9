"""mmserve's shared-memory segments as one test run sees them, whatever else runs on the machine.

A segment's name holds its writer's pid (`mmserve_<pid>_<hex>`, ipc/shm_segment.py). Ours are
those whose writer is this process or one of its descendants, or has exited (a segment it left
behind is a leak, whoever made it); a live writer outside this process tree is another run's.
"""

from __future__ import annotations

import os
import re

_NAME = re.compile(r"mmserve_(\d+)_")


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process now running."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # it exited meanwhile
    return parents


def _ours(pid: int, parents: dict[int, int], me: int) -> bool:
    if pid not in parents:
        return True  # exited
    while pid in parents and pid != me:
        pid = parents[pid]
    return pid == me


def shm_listing() -> set[str]:
    """The mmserve segments under /dev/shm of this test run (see the module docstring)."""
    parents, me = _parents(), os.getpid()
    names = [n for n in os.listdir("/dev/shm") if n.startswith("mmserve")]
    return {n for n in names if (m := _NAME.match(n)) is None or _ours(int(m.group(1)), parents, me)}
