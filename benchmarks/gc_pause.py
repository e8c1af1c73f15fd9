"""Garbage-collection pauses of the serving processes, start-up heap frozen or not (`gc_tuning.py`).

Two figures, each against its baseline in the same run:
1. in this process, with an engine's and a server's heap (an offline `LLM` on the built-in model and
   the server's modules): the time of one full collection unfrozen, then after `freeze_startup_heap`;
2. through servers (one with `MMSERVE_GC_FREEZE=0`, one as shipped, started in turn): every
   collection the API server (P0) and the engine core (P1) run, recorded by `tests/gc_probe`,
   split at the moment the server answered /health: full collections during start-up, and during
   `mmserve bench serve` (random-mm, all requests at once, sent twice), their count, total and
   longest pause. Target: no full collection of the start-up heap in either process; the
   serving-time pauses at a small fraction of the unfrozen ones.

Run: `PYTHONPATH=src:tests .venv/bin/python benchmarks/gc_pause.py [--num-prompts N] [--runs R]`.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mmserve  # noqa: F401  (first: sets OMP_WAIT_POLICY before torch loads, as the server's processes have it)

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))
PROCESSES = {"cli.py_serve": "API server (P0)", "mmserve-engine-dp0": "engine core (P1)"}


def full_collection_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - start) * 1e3


def in_process() -> None:
    from mmserve import LLM
    from mmserve.gc_tuning import freeze_startup_heap

    llm = LLM(model="builtin:tiny-llava")
    import mmserve.entrypoints.openai.api_server  # noqa: F401  (P0's modules too)

    unfrozen = statistics.median(full_collection_ms() for _ in range(3))
    objects = len(gc.get_objects())
    freeze_startup_heap()
    frozen = statistics.median(full_collection_ms() for _ in range(3))
    print(f"one full collection of a serving heap ({objects} objects): unfrozen {unfrozen:.1f} ms, "
          f"frozen {frozen:.2f} ms (ratio {frozen / unfrozen:.4f})")
    llm.shutdown()


Pauses = dict[str, dict[str, list[float]]]  # process -> phase ("start-up", "serving") -> ms of each full collection


def through_server(freeze: bool, num_prompts: int) -> tuple[float, Pauses]:
    """Seconds until /health, and per process the pauses of its full collections by phase."""
    from helpers.server_process import ServerProcess

    with tempfile.TemporaryDirectory() as probe_dir:
        env = {"PYTHONPATH": os.pathsep.join([str(TESTS / "gc_probe"), os.environ.get("PYTHONPATH", "")]),
               "MMSERVE_GC_PROBE_DIR": probe_dir, **({} if freeze else {"MMSERVE_GC_FREEZE": "0"})}
        start = time.time()
        server = ServerProcess("builtin:tiny-llava", env=env)
        healthy = time.time()
        try:
            bench = [sys.executable, "-m", "mmserve.cli", "bench", "serve", "--base-url", server.base_url,
                     "--num-prompts", str(num_prompts), "--repeat", "2"]
            subprocess.run(bench, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "MMSERVE_GC_PROBE_DIR": ""})
        finally:
            server.stop()
        pauses: Pauses = {process: {"start-up": [], "serving": []} for process in PROCESSES}
        for log in Path(probe_dir).glob("*.log"):
            for line in log.read_text().splitlines():
                at, generation, ms, _, process = line.split()
                if process in PROCESSES and generation == "2":
                    phase = "start-up" if float(at) < healthy else "serving"
                    pauses[process][phase].append(float(ms))
        return healthy - start, pauses


def describe(ms: list[float]) -> str:
    return f"{len(ms)} full, {sum(ms):.0f} ms in all, longest {max(ms, default=0):.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=300, help="requests per bench run (sent at once, twice)")
    parser.add_argument("--runs", type=int, default=1, help="server pairs (unfrozen, frozen)")
    args = parser.parse_args()
    in_process()
    for run in range(args.runs):
        results = {name: through_server(freeze, args.num_prompts) for name, freeze in (("unfrozen", False),
                                                                                        ("frozen", True))}
        for name, (start_s, pauses) in results.items():
            print(f"run {run}, {name}: /health after {start_s:.2f} s")
            for process, label in PROCESSES.items():
                seen = pauses[process]
                print(f"  {label}: start-up {describe(seen['start-up'])}; serving {describe(seen['serving'])}")
        serving = {name: sum(sum(p[proc]["serving"]) for proc in PROCESSES) for name, (_, p) in results.items()}
        ratio = serving["frozen"] / serving["unfrozen"] if serving["unfrozen"] else float("nan")
        print(f"run {run}: full-collection pauses while serving, P0 + P1: frozen / unfrozen {ratio:.3f}")


if __name__ == "__main__":
    main()
