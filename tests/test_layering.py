"""The package's import layering: each folder is one process's part or one shared layer.

- `ipc/` (the types and channels that travel between processes) is the bottom: it imports no other
  mmserve layer; `item_store/` (the shared-memory item store) sits on it alone.
- P1 and its workers (`engine/`, `worker/`, `models/`) never load P0's code (`frontend/`,
  `entrypoints/`) or the launcher's (`launcher/`); P0's `frontend/` never imports the server or the
  launcher; nothing but the launcher (and `cli.py`'s hand-over to it) imports `launcher/`.
- `transport/` (how items cross between P0 and P1, both halves) sits under both: it imports neither
  `frontend/` nor `engine/`, nor the server or the launcher.
- Every circle of imports between modules is one that docs/ARCHITECTURE.md justifies ("Import
  circles"); none runs at import time.
- P0's request path does not pull in the engine core or the model code; outside `engine_client/`
  (which starts P1, or runs it in-process offline) `frontend/` imports nothing of `engine/` but the
  block hash (`engine/block_hash.py`: the prefix keys the DP router routes by).
"""

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


def imports_of(folder: str) -> dict[str, set[str]]:
    return {str(p.relative_to(SRC)): mmserve_imports(p) for p in (SRC / folder).rglob("*.py")}


def offending(folder: str, allowed: tuple[str, ...] = (), banned: tuple[str, ...] = ()) -> list[str]:
    return sorted(f"{path}: {m}" for path, names in imports_of(folder).items() for m in names
                  if (allowed and not m.startswith(allowed)) or (banned and m.startswith(banned)))


def module_name(path: Path) -> str:
    name = ".".join(("mmserve", *path.relative_to(SRC).with_suffix("").parts))
    return name.removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """Module -> the mmserve modules it imports anywhere in its text (a name imported from a
    package counts as its submodule when there is one)."""
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mmserve"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                targets |= subs or {node.module}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("mmserve.")}
        graph[name] = {t for t in targets if t in modules and t not in (name, "mmserve")}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = {stack.pop()}
                while node not in component:
                    component.add(stack.pop())
                if len(component) > 1:
                    circles.append(frozenset(component))
    return circles


def loaded_by(*modules: str) -> list[str]:
    """The mmserve modules that importing `modules` loads (in a fresh interpreter)."""
    code = f"import sys, {', '.join(modules)}; print(sorted(m for m in sys.modules if m.startswith('mmserve.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return eval(out)  # a list of module names


def test_ipc_imports_only_ipc_and_config():
    allowed = ("mmserve.ipc.", "mmserve.config", "mmserve.sampling_params")  # the last two: plain data
    bad = offending("ipc", allowed=allowed)
    assert not bad, bad


def test_the_item_store_sits_on_ipc_alone():
    bad = offending("item_store", allowed=("mmserve.item_store.", "mmserve.ipc."))
    assert not bad, bad


def test_p1_and_its_workers_do_not_import_p0_or_the_launcher():
    p0 = ("mmserve.frontend", "mmserve.entrypoints", "mmserve.launcher")
    bad = [*offending("engine", banned=p0), *offending("worker", banned=p0), *offending("models", banned=p0)]
    assert not bad, bad
    loaded = loaded_by("mmserve.engine.core_proc", "mmserve.worker.worker_proc")
    assert not [m for m in loaded if m.startswith(p0)], loaded


def test_p0s_frontend_does_not_import_the_server_or_the_launcher():
    bad = offending("frontend", banned=("mmserve.entrypoints", "mmserve.launcher"))
    assert not bad, bad


def test_transport_sits_under_the_frontend_and_the_engine():
    bad = offending("transport", banned=("mmserve.frontend", "mmserve.engine", "mmserve.entrypoints",
                                         "mmserve.launcher"))
    assert not bad, bad


def test_p0s_request_path_imports_nothing_of_the_engine_but_the_block_hash():
    bad = sorted(f"{path}: {m}" for path, names in imports_of("frontend").items()
                 if not path.startswith("frontend/engine_client/")
                 for m in names if m.startswith("mmserve.engine.") and m != "mmserve.engine.block_hash")
    assert not bad, bad


def test_only_the_launcher_and_the_clis_hand_over_import_the_launcher():
    users = {path for folder in ("frontend", "engine", "worker", "models", "multimodal", "transport", "ipc",
                                 "item_store", "entrypoints")
             for path, names in imports_of(folder).items() if any(m.startswith("mmserve.launcher") for m in names)}
    assert not users, users  # `cli.py: run_server` hands --api-server-count > 1 over


def test_the_frontends_request_path_does_not_import_the_engine_core():
    loaded = loaded_by("mmserve.frontend.async_llm", "mmserve.transport.item_transport")
    # P1's target (`engine_process.py: _run_engine_core`) imports the engine core in P1 only
    assert not [m for m in loaded if m.startswith(("mmserve.engine.core", "mmserve.models.llava",
                                                   "mmserve.models.qwen_vl", "mmserve.models.internvl"))], loaded


JUSTIFIED_CIRCLES = [  # docs/ARCHITECTURE.md, "Import circles": one line each on why it stays
    {"entrypoints.openai.protocol", "entrypoints.openai.sampling_extras"},
    {"entrypoints.openai.tool_parsers", "entrypoints.openai.tool_parsers.hermes"},
    {"frontend.engine_client.engine_process", "frontend.engine_client.ray_engine"},
    {"models.builtin", "models.builtin_qwen_vl"},
    {"models.hf_config", "models.qwen_config"},
    {"models.hf_config", "models.internvl_config", "models.qwen_config"},
    {"multimodal.http_fetch", "multimodal.media"},
    {"worker.memory", "worker.model_runner"},
]


def test_every_import_circle_is_one_the_architecture_justifies():
    justified = {frozenset(f"mmserve.{m}" for m in circle) for circle in JUSTIFIED_CIRCLES}
    new = [sorted(c) for c in import_circles(import_graph()) if c not in justified]
    assert not new, new
