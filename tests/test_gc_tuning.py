"""The serving processes' start-up heap is frozen (`gc_tuning.py`): no full collection re-traverses
it, neither during start-up nor while serving, and garbage made while serving is still freed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from helpers.server_process import ServerProcess

PROBE = Path(__file__).resolve().parent / "gc_probe"


def run_python(code: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env={**os.environ, **env}, check=True)
    return out.stdout


def test_freezing_keeps_the_heap_out_of_collections_and_frees_later_garbage():
    out = run_python("""
        import gc, weakref
        from mmserve.gc_tuning import freeze_startup_heap, pause_collection
        pause_collection()
        assert not gc.isenabled()
        startup = [[i] for i in range(50_000)]  # objects that live as long as the process
        frozen = freeze_startup_heap()
        assert gc.isenabled()
        class Node: pass
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made while serving
        freed = []
        weakref.finalize(a, freed.append, True)
        del a, b
        gc.collect()
        print(frozen, len(gc.get_objects()), freed)
    """)
    frozen, tracked, freed = out.split(maxsplit=2)
    assert int(frozen) > 50_000
    assert int(tracked) < 5_000  # what a full collection still looks at
    assert freed.strip() == "[True]"


def test_the_debugging_knob_leaves_collection_as_it_is():
    out = run_python("""
        import gc
        from mmserve.gc_tuning import freeze_startup_heap, pause_collection
        pause_collection()
        enabled = gc.isenabled()
        print(enabled, freeze_startup_heap(), gc.get_freeze_count())
    """, MMSERVE_GC_FREEZE="0")
    assert out.split() == ["True", "0", "0"]


def probe_lines(directory: Path) -> dict[str, list[tuple[int, int]]]:
    """(generation, objects frozen then) of each collection, by process (`gc_probe`)."""
    by_process: dict[str, list[tuple[int, int]]] = {}
    for log in directory.glob("*.log"):
        for line in log.read_text().splitlines():
            _, generation, _, frozen, process = line.split()
            by_process.setdefault(process, []).append((int(generation), int(frozen)))
    return by_process


@pytest.mark.slow
def test_the_api_server_and_the_engine_core_never_fully_collect_their_start_up_heap(tmp_path):
    path = os.pathsep.join([str(PROBE), os.environ.get("PYTHONPATH", "")])
    server = ServerProcess("builtin:tiny-llava", env={"PYTHONPATH": path, "MMSERVE_GC_PROBE_DIR": str(tmp_path)})
    try:
        with httpx.Client(timeout=60) as client:
            for i in range(8):
                r = client.post(server.base_url + "/v1/chat/completions", json={
                    "model": "builtin:tiny-llava", "max_tokens": 8, "temperature": 0.0,
                    "messages": [{"role": "user", "content": f"Request {i}: say something."}]})
                assert r.status_code == 200, r.text
    finally:
        server.stop()
    collections = probe_lines(tmp_path)
    for process in ("cli.py_serve", "mmserve-engine-dp0"):  # P0, P1
        seen = collections.get(process, [])
        # start-up ran no full collection (paused), and serving runs with the start-up heap frozen
        assert not [c for c in seen if c == (2, 0)], (process, seen)
        assert any(frozen > 10_000 for _, frozen in seen), (process, sorted(collections))
