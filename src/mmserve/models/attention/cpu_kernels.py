"""Our paged decode attention on the CPU (`csrc/paged_decode.c`), built by `mmserve/native.py`.

`paged_decode` is paged decode attention that reads K/V where they lie: each decoding request's
blocks through its block table, with an online softmax, on OpenMP threads; float32, bfloat16 or
float16, or float32 queries over a 16-bit cache (16-bit values widened as they are read, summed in
float32). Without a compiler, or with `MMSERVE_CPU_KERNELS=0`, `load` returns None and the caller
keeps its PyTorch path (padded copies); the first failure is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import subprocess
from pathlib import Path

import torch

from mmserve import native

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
_I64 = ctypes.c_int64
_P = ctypes.c_void_p
# the kernel of each (q's and out's dtype, the KV cache's): one dtype throughout, or float32 q and out
# over a 16-bit cache (`--kv-cache-dtype` of a float32 model)
ENTRY_POINTS = {(torch.float32, torch.float32): "mmserve_paged_decode_f32",
                (torch.bfloat16, torch.bfloat16): "mmserve_paged_decode_bf16",
                (torch.float16, torch.float16): "mmserve_paged_decode_f16",
                (torch.float32, torch.bfloat16): "mmserve_paged_decode_f32_bf16kv",
                (torch.float32, torch.float16): "mmserve_paged_decode_f32_f16kv"}


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library (built here once per machine), or None where it cannot be had."""
    if not native.enabled() or platform.system() != "Linux":
        return None
    try:
        library = ctypes.CDLL(str(native.library_path(SOURCE)))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU attention kernels unavailable (%s); decode attention uses PyTorch's kernels", exc)
        return None
    for name in ENTRY_POINTS.values():
        fn = getattr(library, name)
        fn.argtypes = [_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _I64,
                       ctypes.c_int]
        fn.restype = ctypes.c_int
    return library


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
