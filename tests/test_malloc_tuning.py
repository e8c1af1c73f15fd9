"""The serving processes' malloc settings: applied on glibc, skipped when asked."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = "from mmserve.malloc_tuning import retain_freed_memory; print(retain_freed_memory())"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("env, expected", [({}, "True"), ({"MMSERVE_MALLOC": "default"}, "False")])
def test_retain_freed_memory_sets_glibc_thresholds_unless_told_not_to(env, expected):
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", **env}).stdout.strip()
    assert out == expected


def test_the_serving_processes_apply_it():
    """P0 (each API server), P1 and every tensor-parallel worker call it at start."""
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "mmserve"
    for path in ("entrypoints/openai/api_server.py", "engine/core_proc.py", "worker/worker_proc.py"):
        assert "retain_freed_memory()" in (src / path).read_text(), path
