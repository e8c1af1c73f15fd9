"""What P0 and the tensor-parallel executor say about a child process that ended."""

from __future__ import annotations

import signal


def describe_exit(exitcode: int | None) -> str:
    """"killed by SIGKILL" for a negative exit code (a signal), else "exit code N"."""
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"
