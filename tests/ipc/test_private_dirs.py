"""Private temp directories: the owner lock, and removal of those a killed process left behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmserve.ipc import private_dirs
from mmserve.ipc.private_dirs import OWNER_FILE, make_ipc_dir, make_private_dir, remove_private_dir, remove_stale_dirs

OLD = time.time() - 3600  # past the grace age


@pytest.fixture
def tmp(monkeypatch) -> Iterator[Path]:
    """A temp directory of this test's own (short, for socket paths): the sweep sees only what the
    test put there."""
    root = tempfile.mkdtemp(prefix="pd-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", root)
    yield Path(root)
    shutil.rmtree(root, ignore_errors=True)


def _aged(path: Path | str) -> None:
    os.utime(path, (OLD, OLD))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_directory_of_a_sigkilled_owner_goes_when_the_next_is_made(tmp):
    env = {**os.environ, "TMPDIR": str(tmp)}
    code = ("import time; from mmserve.ipc.private_dirs import make_ipc_dir; "
            "print(make_ipc_dir(), flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        left = Path(child.stdout.readline().strip())
        assert left.parent == tmp and (left / OWNER_FILE).exists()
        _aged(left)
        assert remove_stale_dirs() == [] and left.exists()  # its owner lives: old or not, it stays
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert left.exists()  # a SIGKILL runs no cleanup
    mine = make_ipc_dir()
    assert not left.exists() and os.path.isdir(mine)
    remove_private_dir(mine)
    assert not os.path.exists(mine) and mine not in private_dirs._owned


def test_the_lock_not_the_pid_says_the_owner_lives(tmp):
    mine = Path(make_private_dir())
    _aged(mine)
    # a dead owner whose pid is live again (pids wrap): the name says this process, the lock says gone
    reused = tmp / f"mmserve-{os.getpid()}-reused"
    reused.mkdir()
    (reused / OWNER_FILE).touch()
    (reused / "input.sock").touch()
    _aged(reused)
    assert remove_stale_dirs() == [str(reused)]
    assert mine.exists() and not reused.exists()
    remove_private_dir(str(mine))


def test_young_foreign_and_live_older_directories_are_kept(tmp):
    young = tmp / f"mmserve-{_dead_pid()}-young"  # its creator may not hold the lock yet
    young.mkdir()
    (young / OWNER_FILE).touch()
    legacy_live = tmp / f"mmserve-{os.getpid()}-legacy"  # no .owner: an older mmserve's; its pid runs
    legacy_live.mkdir()
    legacy_dead = tmp / f"mmserve-metrics-{_dead_pid()}-legacy"
    legacy_dead.mkdir()
    other = tmp / "mmserve-not-a-pid"
    other.mkdir()
    for path in (legacy_live, legacy_dead, other):
        _aged(path)
    assert remove_stale_dirs() == [str(legacy_dead)]
    assert young.exists() and legacy_live.exists() and other.exists()


def test_a_kind_names_the_directory_and_removal_is_idempotent(tmp):
    path = make_private_dir("metrics")
    assert os.path.basename(path).startswith(f"mmserve-metrics-{os.getpid()}-")
    assert oct(os.stat(path).st_mode & 0o777) == "0o700"
    remove_private_dir(path)
    remove_private_dir(path)
    assert not os.path.exists(path)
