"""An API server's view of its launcher's engine cores (`AttachedEngineProcess`): a restart that
begins after the launcher died must see the launcher gone, not wait out `startup_timeout_s`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# The "API server": waits until its launcher has died (it is re-parented), then, as a rank restart
# does, makes a fresh AttachedEngineProcess with the pid the launcher handed down and reports
# whether the launcher's engine core could still be starting.
SERVER = textwrap.dedent("""
    import os, sys, time
    from mmserve.frontend.engine_client.attached_engine import AttachedEngineProcess
    launcher, out = int(sys.argv[1]), sys.argv[2]
    deadline = time.monotonic() + 30
    while os.getppid() == launcher and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(out, "w") as f:
        f.write(str(AttachedEngineProcess(launcher).is_alive()))
""")

# The "launcher": starts the server with its own pid, then exits at once.
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys
    subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]])
""")


def test_a_restart_after_the_launcher_died_sees_it_dead(tmp_path: Path) -> None:
    out = tmp_path / "alive"
    subprocess.run([sys.executable, "-c", LAUNCHER, SERVER, str(out)], check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    deadline = time.monotonic() + 60
    while not out.exists() or not out.read_text():
        assert time.monotonic() < deadline, "the server stand-in never reported"
        time.sleep(0.05)
    assert out.read_text() == "False"
