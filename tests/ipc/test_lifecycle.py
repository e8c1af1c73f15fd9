"""What P0 says about its engine core's process: exit descriptions, and whether a pid still runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from mmserve.ipc.lifecycle import describe_exit, is_running


def test_describe_exit_names_the_signal():
    assert (describe_exit(-signal.SIGKILL), describe_exit(1)) == ("killed by SIGKILL", "exit code 1")


def test_a_zombie_does_not_run_and_a_reaped_pid_does_not_exist():
    assert is_running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while is_running(child.pid):  # exits, not reaped yet: a zombie
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert os.path.exists(f"/proc/{child.pid}") or sys.platform != "linux"
    child.wait()
    assert not is_running(child.pid)
