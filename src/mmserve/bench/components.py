"""`mmserve bench components` (and `python -m benchmarks`): every script in benchmarks/, one subprocess each.

A component benchmark is a `benchmarks/<name>.py` script (not starting with `_`) that prints its
result against a baseline measured in the same run: its target and the ratio. Each runs as
`python <script>` from the repository root with its output passed through; the lines naming a
target or a ratio are gathered into a summary at the end. The exit code is 1 if any script failed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

_SUMMARY_LINE = re.compile(r"target|ratio", re.IGNORECASE)


def find_benchmarks_dir(given: str | Path | None = None) -> Path:
    """`given`, else ./benchmarks, else the repository's benchmarks/ (beside src/); ValueError if none."""
    if given is not None:
        candidates = [Path(given)]
    else:
        candidates = [Path.cwd() / "benchmarks", Path(__file__).resolve().parents[3] / "benchmarks"]
    for folder in candidates:
        if folder.is_dir():
            return folder.resolve()
    raise ValueError(f"no benchmarks folder at {', '.join(map(str, candidates))}; give one with --dir")


def discover(folder: Path) -> dict[str, Path]:
    """Benchmark name (the script's stem) -> script, in name order."""
    return {p.stem: p for p in sorted(folder.glob("*.py")) if not p.name.startswith("_")}


@dataclass
class ComponentResult:
    """One script's exit code, wall time and the lines it printed about targets and ratios."""

    name: str
    returncode: int
    seconds: float
    summary: list[str] = field(default_factory=list)


def run_one(name: str, script: Path, timeout_s: float | None = None) -> ComponentResult:
    """Run one script, echoing its output as it comes; the repository's src/ goes on PYTHONPATH.

    The script runs in its own process group, killed whole when the script ends (whatever it left
    running), when `timeout_s` passes (its exit code is then negative) or when this is interrupted.
    """
    root = script.parent.parent
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if (root / "src" / "mmserve").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"), env.get("PYTHONPATH")]))
    print(f"===== {name} ({script.name}) =====", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(script)], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    watchdog = threading.Timer(timeout_s or 0.0, _kill_group, [proc])
    if timeout_s:
        watchdog.start()
    try:
        summary = _echo(proc)
        code = proc.wait()
    finally:
        watchdog.cancel()
        _kill_group(proc)
    return ComponentResult(name, code, time.perf_counter() - start, summary)


def _echo(proc: subprocess.Popen[str]) -> list[str]:
    """Pass the output through as it comes; return the lines naming a target or a ratio."""
    summary = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if _SUMMARY_LINE.search(line):
            summary.append(line.rstrip())
    return summary


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_components(folder: str | Path | None, only: list[str] | None, list_only: bool = False,
                   timeout_s: float | None = None) -> int:
    """Run the chosen benchmarks (all when `only` is None) and print a summary; 1 if any failed."""
    scripts = discover(find_benchmarks_dir(folder))
    unknown = sorted(set(only or ()) - set(scripts))
    if unknown:
        raise ValueError(f"no benchmark named {', '.join(unknown)}; found: {', '.join(scripts) or 'none'}")
    chosen = {name: path for name, path in scripts.items() if only is None or name in only}
    if list_only:
        print("\n".join(chosen))
        return 0
    results = [run_one(name, path, timeout_s) for name, path in chosen.items()]
    print(format_summary(results))
    return 0 if all(r.returncode == 0 for r in results) else 1


def format_summary(results: list[ComponentResult]) -> str:
    lines = ["===== summary ====="]
    for r in results:
        killed = ", killed" if r.returncode < 0 else ""
        status = "ok" if r.returncode == 0 else f"FAILED (exit {r.returncode}{killed})"
        lines.append(f"{r.name}: {status}, {r.seconds:.1f} s")
        lines += [f"    {line}" for line in r.summary]
    return "\n".join(lines)
