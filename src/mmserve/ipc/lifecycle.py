"""What P0 and the tensor-parallel executor say about a child process that ended."""

from __future__ import annotations

import os
import signal


def describe_exit(exitcode: int | None) -> str:
    """"killed by SIGKILL" for a negative exit code (a signal), else "exit code N"."""
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def is_running(pid: int) -> bool:
    """Whether process `pid` of this machine exists and is not a zombie waiting to be reaped
    (Linux: from /proc; elsewhere any existing pid counts as running)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
