"""`--launch`: a `mmserve serve` started for the benchmark on a free loopback port, and stopped after.

The server runs in its own session (process group), with its output in a temporary log file
that is shown if it fails to start. `stop()` sends SIGTERM (the server then stops its engine
core and exits), waits, and then kills whatever is left of the group, so nothing outlives the
benchmark, however it ends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import IO

STOP_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`mmserve serve MODEL *server_args --host 127.0.0.1 --port P`; a context manager.

    The host and port come last, so they win over any given in `server_args`.
    """

    def __init__(self, model: str, server_args: list[str], timeout_s: float = 300.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "mmserve.cli", "serve", model, *server_args,
                        "--host", "127.0.0.1", "--port", str(self.port)]
        self.timeout_s = timeout_s
        # append mode: the server's writes always land at the end, whatever offset log_tail() reads from
        self.log: IO[str] = tempfile.TemporaryFile("a+", prefix="mmserve-bench-server-")
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> LaunchedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait until /health answers 200; RuntimeError (with its log) if it does not.

        However the wait ends early (an error, Ctrl-C), the server is stopped before this returns.
        """
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, stdin=subprocess.DEVNULL)
        try:
            self._wait_healthy(self.proc)
        except BaseException:
            self.stop(quiet=True)
            raise

    def _wait_healthy(self, proc: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the launched server exited with code {proc.returncode}:\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(0.2)
        raise RuntimeError(f"the launched server was not healthy after {self.timeout_s:.0f} s:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self, quiet: bool = False) -> int | None:
        """SIGTERM, wait up to `STOP_TIMEOUT_S`, then SIGKILL the whole group; the server's exit code.

        Unless `quiet`, a non-zero exit is reported on stderr with the end of the server's log.
        Safe to call twice.
        """
        if self.proc is None or self.log.closed:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        try:  # the engine core and anything else the server left in its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = self.proc.wait()
        if code != 0 and not quiet:  # e.g. ENGINE_DEAD_EXIT_CODE: the numbers measured may not mean much
            print(f"mmserve bench: the launched server exited with code {code}:\n{self.log_tail()}",
                  file=sys.stderr)
        self.log.close()
        return code

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines the server printed."""
        if self.log.closed:
            return ""
        self.log.flush()
        self.log.seek(0)
        return "".join(self.log.readlines()[-lines:])
