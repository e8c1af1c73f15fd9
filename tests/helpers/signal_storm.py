"""Run by tests/entrypoints/test_start_signals.py in a process of its own (a signal handler belongs
to the main thread of one process): SIGINT sent every fraction of a millisecond while event loops
are entered, run a start-like first step and closed, thousands of times. Prints a JSON count of
how the cycles ended; anything else the process prints is a defect.

    python signal_storm.py {start-signals | raising-handler} {uvloop | asyncio} SECONDS
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time

from mmserve.entrypoints.openai.start_signals import StartSignals


async def first_step(signals: StartSignals | None) -> None:
    """The server's start: plain Python (the engine cores' start), then its first await."""
    if signals is None:
        sum(range(3000))
    else:
        with signals.raising():
            sum(range(3000))
    await asyncio.sleep(0)


def main(handler: str, loop: str, seconds: float) -> dict[str, int]:
    factory = None
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    # Python's handler, as under a terminal (a pytest-xdist worker, and so its children, may ignore SIGINT);
    # by itself it is what the server had before StartSignals: KeyboardInterrupt wherever the signal lands
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signals = StartSignals()
    if handler == "start-signals":
        signals.install()
    inside = threading.Event()
    done = threading.Event()

    def fire() -> None:
        while not done.is_set():
            if inside.is_set():
                os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.0002)

    ended: dict[str, int] = {}
    threading.Thread(target=fire, daemon=True).start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        signals.pending = False  # a cycle is one server's start
        outcome = "ran"
        try:
            try:
                inside.set()
                with asyncio.Runner(loop_factory=factory) as runner:
                    runner.run(first_step(signals if handler == "start-signals" else None))
            except KeyboardInterrupt:
                outcome = "stopped"
            finally:
                inside.clear()
        except KeyboardInterrupt:
            outcome = "interrupted after the loop closed"
        except Exception as e:  # the loop left running: "Cannot close a running event loop"
            outcome = f"{type(e).__name__}: {e}"
        ended[outcome] = ended.get(outcome, 0) + 1
    done.set()
    time.sleep(0.01)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return ended


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], float(sys.argv[3]))), flush=True)
