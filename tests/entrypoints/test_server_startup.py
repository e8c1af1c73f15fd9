"""What a server loads at start-up (issue 41): no Triton and no xgrammar in the API server or the
engine core until a request asks for a structure, and a clean Ctrl-C prints nothing alarming
(Triton's nanobind extension printed ~60 `nanobind: leaked` lines at every exit) — also while the
server is still starting."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers.server_process import ServerProcess, child_pids
from helpers.tiny_models import make_checkpoint

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

HEAVY = ("libtriton", "xgrammar")


def loaded(pid: int) -> set[str]:
    """Which of the heavy extensions `pid` has mapped."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {name for name in HEAVY if name in maps}


def test_heavy_imports_wait_for_a_structured_request_and_ctrl_c_is_quiet(tmp_path):
    server = ServerProcess(make_checkpoint(tmp_path), "--served-model-name", "m", "--max-model-len", "256")
    try:
        api_server, engines = server.proc.pid, child_pids(server.proc.pid)
        assert engines and loaded(api_server) == set() and all(loaded(p) == set() for p in engines)
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        body = {"model": "m", "messages": [{"role": "user", "content": "Answer."}], "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert "xgrammar" in loaded(api_server)  # imported by the first request that asked for it
    finally:
        code = server.stop(signal.SIGINT)
    output = server.output()
    assert code == 0, output
    assert "nanobind" not in output and "Traceback" not in output, output[-3000:]


def test_the_engine_cores_start_up_lines_reach_the_servers_output(tmp_path):
    """The engine core is a spawned process: it logs at the server's --log-level (its KV blocks, the
    model's resident weight bytes), not at logging's unconfigured default, which dropped them."""
    server = ServerProcess(make_checkpoint(tmp_path), "--max-model-len", "256")
    code = server.stop(signal.SIGINT)
    output = server.output()
    assert code == 0, output
    assert "engine core ready" in output and "MiB resident" in output, output[-3000:]


def terminal_serve(path: str) -> subprocess.Popen[str]:
    """`mmserve serve path` as from a terminal: its own process group, SIGINT at its default (a
    pytest-xdist worker ignores it, and so would a child of its; an ignored signal stays ignored
    through exec)."""
    serve = [sys.executable, "-m", "mmserve.cli", "serve", path, "--port", "0", "--max-model-len", "256"]
    cmd = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
           "os.execv(sys.argv[1], sys.argv[1:])", *serve]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_ctrl_c_while_the_engine_core_starts_is_a_quiet_stop(tmp_path):
    """Ctrl-C reaches the terminal's whole process group. Pressed once the engine core process exists
    but before the server serves, the start stops: exit 0, no traceback from either process, no
    "error" (the API server used to take the engine core's exit for a failure), nothing left."""
    proc = terminal_serve(make_checkpoint(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while not child_pids(proc.pid) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        engines = child_pids(proc.pid)
        assert engines, "the server spawned no engine core"
        time.sleep(0.5)  # both mid-start: the engine core importing or loading, the server importing
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C does
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output
        assert "Traceback" not in output and "error" not in output.lower(), output[-3000:]
        time.sleep(0.5)
    finally:  # a failure leaves no server behind (its own session: one group to kill)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not any(Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
                   for pid in engines)


@pytest.mark.parametrize("pause", [0.05, 0.15, 0.25, 0.35])
def test_a_second_ctrl_c_while_the_server_stops_is_quiet_too(tmp_path, pause):
    """SIGINT to the server, then to its whole group (`timeout` after a `pkill`, or an impatient
    Ctrl-C): exit 0 and no traceback. It used to be uvicorn's force exit cancelling the lifespan task
    (a CancelledError traceback), or a KeyboardInterrupt during the exit (killed by SIGINT, -2): 8
    of 12 such stops, this pause for one in four."""
    proc = terminal_serve(make_checkpoint(tmp_path))
    try:
        output = ""
        for line in proc.stdout:  # type: ignore[union-attr]
            output += line
            if line.startswith("mmserve: serving"):
                break
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(pause)
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        output += rest
        assert proc.returncode == 0, output[-3000:]
        assert "Traceback" not in output and "ERROR" not in output, output[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("servers", ["1", "2"])
def test_a_port_in_use_is_one_line_before_anything_loads(tmp_path, servers):
    """The listening socket is bound first (`listen.py`): a port another process holds is refused at
    once with one line, by one API server and by the launcher alike (which set SO_REUSEPORT, so a
    second launcher would have shared the port with the first)."""
    import socket

    path = make_checkpoint(tmp_path)
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as a launcher's socket was
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        serve = [sys.executable, "-m", "mmserve.cli", "serve", path, "--port", str(port), "--api-server-count",
                 servers, "--max-model-len", "256"]
        done = subprocess.run(serve, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"mmserve: error: cannot listen on 127.0.0.1:{port}: Address already in use (is another server " \
           "running on it?)" in done.stderr
    assert "Traceback" not in done.stderr and "engine core" not in done.stderr  # refused before any started
