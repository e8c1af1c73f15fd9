"""Every Triton kernel of the engine compiled for a CUDA GPU on a machine without one: the real
launch wrappers run on `meta` tensors at the shipped models' shapes, each launch compiles for the
target (`sm_90`: H100 / H200) with Triton's own compiler and `ptxas` (both in the `triton` wheel)
and launches nothing; `cuobjdump` then reads each binary's resources.

What this catches that the interpreter cannot: a kernel the compiler refuses (a global that is not
a `tl.constexpr`, a shape it cannot lay out), shared memory past what one block may take (a launch
failure on the GPU), and registers spilled to local memory (a stack frame: slow loads and stores in
the inner loop). It checks nothing numeric: the interpreted tests do that.

Must run in a process whose `triton` was imported without `TRITON_INTERPRET` (under it every
`@triton.jit` is an interpreted function): tests run it in a subprocess. Shapes: each case's name
says the model (Qwen2.5-VL-7B: 28 query / 4 KV heads of 128, hidden 3584, MLP 18944, tower heads
of 80; Qwen3-VL-8B: 32 / 8, tower heads of 72; LLaVA-1.5-7B: 32 / 32, CLIP heads of 64).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

# the most shared memory one block may have (opt-in), per compute capability: CUDA's tables
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
SASS_COUNTED = r"LDG\.E[.\w]*|LDGSTS[.\w]*|HMMA[.\w]*|HGMMA[.\w]*|QGMMA[.\w]*|LDL[.\w]*|STL[.\w]*"
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
META = torch.device("meta")


@dataclass
class Compiled:
    """One kernel as a case compiled it: the compiler's metadata and the binary's resource usage."""

    case: str
    kernel: str
    num_warps: int
    num_stages: int
    shared: int  # bytes of shared memory per block (static + what the pipeline allocates)
    registers: int  # per thread
    stack: int  # bytes of stack frame per thread: registers spilled to local memory
    sass: dict[str, int] = field(default_factory=dict)  # instruction counts (`SASS_COUNTED`), when asked


@dataclass
class Failure:
    """A case the compiler refused: its message, whole exception chain."""

    case: str
    error: str


@contextmanager
def compiling_for(arch: int) -> Iterator[list[tuple[str, Any]]]:
    """Within: each `kernel[grid](...)` launch compiles for `sm_{arch}` and returns without
    launching; yields the list of (kernel name, CompiledKernel) the launches append to."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compiling for a GPU needs a process without TRITON_INTERPRET=1")
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    seen: list[tuple[str, Any]] = []
    run = JITFunction.run

    def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        seen.append((self.fn.__name__, kernel))
        return kernel

    from mmserve.models.attention import tuning

    previous = driver._active  # None until something asks for a driver (none exists on a CPU machine)
    nominal, tuning.NOMINAL_ARCH = tuning.NOMINAL_ARCH, arch  # the wrappers pick this GPU's tiles
    driver.set_active(_compile_only_driver(arch))
    JITFunction.run = compile_only
    try:
        yield seen
    finally:
        JITFunction.run = run
        driver._active = previous
        tuning.NOMINAL_ARCH = nominal


def _compile_only_driver(arch: int) -> Any:
    """A Triton driver reporting `sm_{arch}` as its target, with no device behind it."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class CompileOnly(DriverBase):
        def is_active(self) -> bool:
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self) -> torch.device:
            return META

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_device_interface(self) -> Any:
            return torch.cuda

        def get_benchmarker(self) -> Any:
            raise RuntimeError("nothing runs: kernels are only compiled")

    return CompileOnly()


def compile_cases(arch: int = 90, sass: bool = False,
                  cases: list[tuple[str, Callable[[], object]]] | None = None) -> list[Compiled | Failure]:
    """Each case's kernels compiled for `sm_{arch}` (`cases()` by default), or why it failed."""
    out: list[Compiled | Failure] = []
    with compiling_for(arch) as seen:
        for name, launch in cases if cases is not None else engine_cases():
            seen.clear()
            try:
                launch()
            except Exception as exc:  # the compiler's refusal is the finding
                out.append(Failure(name, _chain(exc)))
                continue
            out.extend(_resources(name, kernel_name, kernel, sass) for kernel_name, kernel in seen)
    return out


def _chain(exc: BaseException) -> str:
    parts: list[str] = []
    cause: BaseException | None = exc
    while cause is not None and len(parts) < 4:
        parts.append(f"{type(cause).__name__}: {str(cause).strip()[-800:]}")
        cause = cause.__cause__ or cause.__context__
    return "\n".join(parts)


def _resources(case: str, name: str, kernel: Any, sass: bool) -> Compiled:
    usage = _cuobjdump(kernel.asm["cubin"], "-res-usage")
    fields = dict(item.split(":", 1) for item in usage.strip().splitlines()[-1].split() if ":" in item)
    counts = {}
    if sass:
        counts = dict(Counter(re.findall(rf"\b({SASS_COUNTED})\b", _cuobjdump(kernel.asm["cubin"], "-sass"))))
    meta = kernel.metadata
    return Compiled(case, name, meta.num_warps, meta.num_stages, meta.shared, int(fields["REG"]),
                    int(fields["STACK"]), counts)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def as_dict(result: Compiled | Failure) -> dict[str, Any]:
    return {"failed": isinstance(result, Failure), **asdict(result)}


def engine_cases() -> list[tuple[str, Callable[[], object]]]:
    """(name, launch) for every kernel family at the shapes the shipped models run."""
    from helpers.gpu_compile_cases import attention_cases, layer_cases, quantized_cases

    return attention_cases() + layer_cases() + quantized_cases()
