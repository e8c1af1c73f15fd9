"""Our C files (`csrc/` folders beside the modules that call them), compiled on first use for this
machine and loaded by ctypes.

Each file is built by the C compiler (`$CC`, else `cc`) with `-O3 -march=native -ffast-math
-fopenmp` (a file that defines MMSERVE_NO_FAST_MATH: without -ffast-math) into a cache folder
(`$MMSERVE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/mmserve/kernels` or `~/.cache/mmserve/kernels`)
under a name made of the source, the compiler's version, the flags and this CPU's feature flags,
so that each machine builds its own once (an atomic rename makes concurrent builds safe; a build
removes the folder's older ones of that file). It links OpenMP by
soname after torch has loaded, so it shares torch's runtime and thread pool. Without a compiler, or
with `MMSERVE_CPU_KERNELS=0`, `build` returns None and the caller keeps its Python path; the first
failure is logged.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
IEEE_MARK = "#define MMSERVE_NO_FAST_MATH"  # a source whose float arithmetic must be IEEE's, in order
# linked apart from the compile so that -ffast-math's start-up file (which sets flush-to-zero for
# the whole process) is not linked into the library
LINK_FLAGS = ("-shared", "-fopenmp")


def compile_flags(text: str) -> tuple[str, ...]:
    """The flags a source is compiled with: COMPILE_FLAGS, without -ffast-math where it says
    `IEEE_MARK` (its divisions and the order of its products are a definition it must equal)."""
    return (*COMPILE_FLAGS, "-fno-fast-math") if IEEE_MARK in text else COMPILE_FLAGS


def enabled() -> bool:
    """Whether the C kernels may be used (`MMSERVE_CPU_KERNELS=0` turns them off)."""
    return os.environ.get("MMSERVE_CPU_KERNELS", "1") != "0"


def _compiler() -> str:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler ({compiler!r} not found)")
    return compiler


def library_path(source: Path) -> Path:
    """The library of one C file's path (any of ours: `build` names them by the file's stem),
    compiled into the cache folder when not there yet."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what the source may include
    flags = compile_flags(source.read_text())
    key = hashlib.sha256("\0".join([source.read_text(), *headers, version, *flags, *LINK_FLAGS,
                                     _cpu_flags()]).encode()).hexdigest()[:16]
    folder = _cache_folder()
    target = folder / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        obj, lib = Path(scratch) / "kernel.o", Path(scratch) / "kernel.so"
        for command in ([compiler, *flags, "-c", str(source), "-o", str(obj)],
                        [compiler, *LINK_FLAGS, str(obj), "-o", str(lib), "-lm"]):
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode:
                raise OSError(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, target)
    for stale in folder.glob(f"{source.stem}-*.so"):  # other sources' or machines' builds (a mapped one stays valid)
        if stale != target:
            stale.unlink(missing_ok=True)
    logger.info("built the CPU kernels of %s into %s", source.name, target)
    return target


def build(source: Path) -> ctypes.CDLL | None:
    """One of our C files, built here once and loaded; None where the kernels are off or cannot be
    built (the failure logged)."""
    if not enabled() or platform.system() != "Linux":
        return None
    try:
        return ctypes.CDLL(str(library_path(source)))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("our C kernels of %s unavailable (%s); their caller does without", source.name, exc)
        return None


def _cache_folder() -> Path:
    if os.environ.get("MMSERVE_KERNEL_CACHE"):
        return Path(os.environ["MMSERVE_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mmserve" / "kernels"


def _cpu_flags() -> str:
    """This CPU's feature flags (-march=native code runs only where they all are)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
