"""A probe for the garbage collector of every Python process started with this folder first on
PYTHONPATH and MMSERVE_GC_PROBE_DIR set (tests/test_gc_tuning.py, benchmarks/gc_pause.py): each
collection appends a line to `<dir>/<pid>.log`:
`<unix time> <generation> <milliseconds> <objects frozen then> <process>`, where <process> is
the multiprocessing name of a spawned child (`mmserve-engine-dp0`) or the main script and its first
argument joined by `_` (`cli.py_serve`).
"""

from __future__ import annotations

import gc
import os
import sys
import time

_DIR = os.environ.get("MMSERVE_GC_PROBE_DIR")


def _process() -> str:
    mp = sys.modules.get("multiprocessing")
    name = mp.current_process().name if mp is not None else "MainProcess"
    if name != "MainProcess":
        return name
    return "_".join(os.path.basename(a) for a in sys.argv[:2]) or "?"


def _install(directory: str) -> None:
    path = os.path.join(directory, f"{os.getpid()}.log")
    started: list[float] = []

    def probe(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
            return
        ms = (time.perf_counter() - started[0]) * 1e3
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{time.time():.3f} {info['generation']} {ms:.3f} {gc.get_freeze_count()} {_process()}\n")

    gc.callbacks.append(probe)


if _DIR:
    _install(_DIR)
