"""LocalEngineProcess from several threads at once: P0's output loop asks `is_alive()`, a thread
retiring a dead rank joins it, a test or shutdown joins and stops it, and multiprocessing polls
every child whenever P0 starts another. Each must see the same, true exit."""

from __future__ import annotations

import multiprocessing
import threading
import time

from mmserve.frontend.engine_client.engine_process import LocalEngineProcess


def spawn(seconds: float, code: int) -> multiprocessing.process.BaseProcess:
    """A child that sleeps `seconds` and exits with `code` (its target a builtin: a spawned child
    could not import this test module by name)."""
    script = f"import sys, time; time.sleep({seconds}); sys.exit({code})"
    return multiprocessing.get_context("spawn").Process(target=exec, args=(script,))


def started(seconds: float, code: int = 3) -> LocalEngineProcess:
    engine = LocalEngineProcess()
    engine.process = spawn(seconds, code)
    engine.process.start()
    return engine


def join_and_describe(engine: LocalEngineProcess, seen: list[str]) -> None:
    engine.join(10)
    seen.append(engine.describe_exit())


def test_threads_joining_one_process_all_see_its_exit():
    for _ in range(3):
        engine = started(0.3)
        seen: list[str] = []
        threads = [threading.Thread(target=join_and_describe, args=(engine, seen)) for _ in range(8)]
        for t in threads:
            t.start()
        while engine.is_alive():  # the output loop's question, meanwhile
            time.sleep(0.001)
        for t in threads:
            t.join()
        assert seen == ["exit code 3"] * 8
        assert not engine.is_alive() and engine.process is not None and engine.process.exitcode == 3


def test_a_child_started_meanwhile_does_not_hide_the_exit():
    """Process.start() polls (and so may reap) every other child of this process."""
    engine = started(0.2, code=5)
    others = []
    while engine.is_alive():
        other = spawn(0.0, 0)
        other.start()
        others.append(other)
    engine.join(10)
    assert engine.describe_exit() == "exit code 5"
    for other in others:
        other.join()


def test_stop_ends_a_running_process_and_reaps_it():
    engine = started(60)
    assert engine.is_alive() and engine.describe_exit() == "exit code None"
    engine.stop()
    assert not engine.is_alive() and engine.describe_exit() == "killed by SIGTERM"
    engine.stop()  # idempotent
