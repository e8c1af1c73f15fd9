"""What each Triton kernel asks of a GPU, read without one: every kernel compiled for `sm_90` (H100,
H200) at the shipped models' shapes by Triton's compiler and `ptxas` (tests/helpers/gpu_compile.py),
each binary's warps, pipeline stages, shared memory against the block's limit, registers, and its
stack frame (registers spilled to local memory). `--sass` adds instruction counts from the
disassembly: wide loads (`LDG.E.128`, `LDGSTS...128`: 16 bytes a thread), tensor-core matmuls
(`HMMA`, `HGMMA`), local loads and stores (`LDL`, `STL`: the spills' traffic).

Then Qwen2.5-VL-7B's own eager steps on the `meta` device (`_model_launches.py`): decode at batch 1
and 64, a 1,000-token prefill, the tower on a 1024x768 image, every Triton launch the model code
makes compiled for the same target, and the kernels each decoder layer or tower block launches.

Read this before spending device time: a kernel the compiler refuses fails its first launch, one
past the shared-memory limit too, and one with a stack frame pays local-memory traffic in its loop.
The targets printed last: every kernel compiles, fits, and spills nothing; every step compiles.

Run: `python benchmarks/kernel_resources.py [--arch 90|80] [--sass] [--json FILE]` (CPU, ~40 s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before triton: the kernels must be compiled, not interpreted
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # helpers.gpu_compile

from _model_launches import StepLaunches, step_launches  # noqa: E402
from helpers.gpu_compile import SHARED_LIMIT, Compiled, Failure, as_dict, compile_cases  # noqa: E402


def table(results: list[Compiled | Failure], arch: int) -> list[str]:
    """One line per compiled kernel (failures in full after them), the summary last."""
    limit = SHARED_LIMIT[arch]
    lines = [f"{'case':42s} {'kernel':24s} warps stages shared KiB  regs stack  sass"]
    for r in results:
        if isinstance(r, Compiled):
            sass = " ".join(f"{k}={v}" for k, v in sorted(r.sass.items()))
            lines.append(f"{r.case:42s} {r.kernel:24s} {r.num_warps:5d} {r.num_stages:6d} {r.shared / 1024:10.1f} "
                         f"{r.registers:5d} {r.stack:5d}  {sass}")
    compiled = [r for r in results if isinstance(r, Compiled)]
    failed = [r for r in results if isinstance(r, Failure)]
    for r in failed:
        lines.append(f"FAILED {r.case}:\n{r.error}")
    spilling = [r for r in compiled if r.stack]
    too_big = [r for r in compiled if r.shared > limit]
    lines.append(f"sm_{arch}: {len(compiled)} kernels compiled, {len(failed)} cases refused, "
                 f"{len(too_big)} past the {limit // 1024} KiB of shared memory a block may have, "
                 f"{len(spilling)} spilling registers (target: 0, 0, 0)")
    return lines


def step_table(steps: list[StepLaunches], arch: int) -> list[str]:
    """One line per step: kernels a layer (block), split into Triton launches, GEMMs and the rest."""
    lines = [f"{'eager, bfloat16':44s} layers  kernels a layer  (Triton, GEMM, other)  Triton launches"]
    for s in steps:
        triton, other = sum(s.triton.values()), sum(s.other.values())
        kinds = " ".join(f"{k.strip('_')}={v}" for k, v in sorted(s.triton.items()))
        split = f"({triton / s.layers:.1f}, {s.gemms / s.layers:.1f}, {other / s.layers:.1f})"
        lines.append(f"{s.step:44s} {s.layers:6d} {s.per_layer:16.1f}  {split}  {kinds}"
                     + (f"\n  FAILED: {s.error}" if s.error else ""))
        if other:
            lines.append(f"  other: {dict(sorted(s.other.items()))}")
    failed = sum(bool(s.error) for s in steps)
    lines.append(f"sm_{arch}: {len(steps) - failed} of {len(steps)} steps compiled whole, none reading back to "
                 f"the host (target: all)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT))
    parser.add_argument("--sass", action="store_true", help="count loads, matmuls and spills in the disassembly")
    parser.add_argument("--json", help="also write every result to this file")
    args = parser.parse_args()
    results = compile_cases(args.arch, args.sass)
    print("\n".join(table(results, args.arch)))
    steps = step_launches(args.arch)
    print("\n".join(step_table(steps, args.arch)))
    if args.json:
        report = {"kernels": [as_dict(r) for r in results],
                  "steps": [asdict(s) | {"per_layer": s.per_layer} for s in steps]}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if any(isinstance(r, Failure) for r in results) or any(s.error for s in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
