"""Our C kernels for the CPU (`csrc/`), compiled on first use for this machine and called by ctypes.

`paged_decode` is paged decode attention that reads K/V where they lie: each decoding request's
blocks through its block table, with an online softmax, on OpenMP threads; float32, bfloat16 or
float16, or float32 queries over a 16-bit cache (16-bit values widened as they are read, summed in
float32). The library is built by the C compiler (`$CC`, else `cc`) with `-O3 -march=native
-ffast-math -fopenmp` into a cache folder (`$MMSERVE_KERNEL_CACHE`, else
`$XDG_CACHE_HOME/mmserve/kernels` or `~/.cache/mmserve/kernels`) under a name made of the source,
the compiler's version, the flags and this CPU's feature flags, so that each machine builds its own
once (an atomic rename makes concurrent builds safe; a build removes the folder's older ones). It
links OpenMP by soname after torch has loaded, so it shares torch's runtime and thread pool.
Without a compiler, or with `MMSERVE_CPU_KERNELS=0`, `load` returns None and the caller keeps its
PyTorch path (padded copies); the first failure is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
# linked apart from the compile so that -ffast-math's start-up file (which sets flush-to-zero for
# the whole process) is not linked into the library
LINK_FLAGS = ("-shared", "-fopenmp")
_I64 = ctypes.c_int64
_P = ctypes.c_void_p
# the kernel of each (q's and out's dtype, the KV cache's): one dtype throughout, or float32 q and out
# over a 16-bit cache (`--kv-cache-dtype` of a float32 model)
ENTRY_POINTS = {(torch.float32, torch.float32): "mmserve_paged_decode_f32",
                (torch.bfloat16, torch.bfloat16): "mmserve_paged_decode_bf16",
                (torch.float16, torch.float16): "mmserve_paged_decode_f16",
                (torch.float32, torch.bfloat16): "mmserve_paged_decode_f32_bf16kv",
                (torch.float32, torch.float16): "mmserve_paged_decode_f32_f16kv"}


def enabled() -> bool:
    """Whether the C kernels may be used (`MMSERVE_CPU_KERNELS=0` turns them off)."""
    return os.environ.get("MMSERVE_CPU_KERNELS", "1") != "0"


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library (built here once per machine), or None where it cannot be had."""
    if not enabled() or platform.system() != "Linux":
        return None
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU attention kernels unavailable (%s); decode attention uses PyTorch's kernels", exc)
        return None
    for name in ENTRY_POINTS.values():
        fn = getattr(library, name)
        fn.argtypes = [_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _I64,
                       ctypes.c_int]
        fn.restype = ctypes.c_int
    return library


def _compiler() -> str:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler ({compiler!r} not found)")
    return compiler


def _build(source: Path = SOURCE) -> Path:
    """The library of one C file's path (any of ours: `build` names them by the file's stem),
    compiled into the cache folder when not there yet."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what the source may include
    key = hashlib.sha256("\0".join([source.read_text(), *headers, version, *COMPILE_FLAGS, *LINK_FLAGS,
                                     _cpu_flags()]).encode()).hexdigest()[:16]
    folder = _cache_folder()
    target = folder / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        obj, lib = Path(scratch) / "kernel.o", Path(scratch) / "kernel.so"
        for command in ([compiler, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
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
    """Another of our C files (e.g. models/quantization/csrc/), built and loaded as this module
    builds its own; None where the kernels are off or cannot be built (the first failure logged)."""
    if not enabled() or platform.system() != "Linux":
        return None
    try:
        return ctypes.CDLL(str(_build(source)))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernels of %s unavailable (%s); the PyTorch path is used", source.name, exc)
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


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 seq_lens: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, scale: float,
                 splits: int) -> bool:
    """Write into `out` [T, H, Dh] the attention of each decoding request's query row `rows[b]`
    of `q` [T, H, Dh] over its `seq_lens[b]` keys in `k_cache`, `v_cache` [N, S, Hkv, Dh]
    through `tables` [B, W] (int64); each context in `splits` parts across threads. q, out and
    the cache of one dtype: float32, bfloat16 or float16, or float32 q and out over a bfloat16 or
    float16 cache (summed in float32 either way); other rows of `out` are left alone. False (and
    nothing written) when the kernel is not loaded or the shapes or dtypes are not its own."""
    library = load()
    entry = ENTRY_POINTS.get((q.dtype, k_cache.dtype))
    if library is None or entry is None or not (q.dtype == out.dtype and v_cache.dtype == k_cache.dtype):
        return False
    for t in (q, k_cache, v_cache, tables, seq_lens, rows, out):
        if not t.is_contiguous() or t.device.type != "cpu":
            return False
    N, S, Hkv, Dh = k_cache.shape
    B, W = tables.shape
    done = getattr(library, entry)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), seq_lens.data_ptr(),
        rows.data_ptr(), out.data_ptr(), B, W, q.shape[1], Hkv, Dh, S, scale, splits, torch.get_num_threads())
    return done == 0
