"""The package's import layering (issue: the codebase carries its own map): `ipc/` is the bottom
for the types that travel between processes and imports no other mmserve layer; P0's server
modules do not pull in the engine core or the model code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "mmserve"


def mmserve_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mmserve."):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("mmserve.")}
    return names


def test_ipc_imports_only_ipc_and_config():
    allowed = ("mmserve.ipc.", "mmserve.config", "mmserve.sampling_params")  # the last two: plain data
    bad = {f"{p.name}: {m}" for p in (SRC / "ipc").glob("*.py") for m in mmserve_imports(p)
           if not m.startswith(allowed)}
    assert not bad, sorted(bad)


def test_the_frontends_request_path_does_not_import_the_engine_core():
    code = ("import sys, mmserve.frontend.async_llm, mmserve.transport.item_transport; "
            "print(sorted(m for m in sys.modules if m.startswith(('mmserve.engine.core', 'mmserve.models.llava', "
            "'mmserve.models.qwen_vl'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # P1's target (`engine_process.py: _run_engine_core`) imports the engine core in P1 only
    assert out.strip() == "[]", out
