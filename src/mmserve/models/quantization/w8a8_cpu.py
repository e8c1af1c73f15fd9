"""W8A8's decode GEMV on the CPU: `csrc/w8a8_gemv.c` (its docstring states the arithmetic), the
same numbers as w8a8.py's torch path bit for bit, at a decode step's few rows of x (`MAX_ROWS`),
where it is faster than oneDNN's int8 GEMM.

It reads W8A8's resident form plus two tensors made at load (`gemv_tensors`): each row's sum of
codes (AVX-512 VNNI multiplies x's codes offset by 128) and the row scales followed by the static
input scale, as the compiled decode step passes one scales pointer (models/cpu_decoder.py, kind
`cpu_gemv.W8A8`). `LEVEL` caps the path taken (2: AVX-512 VNNI, 1: AVX2, 0: plain C, each where
built; tests lower it to prove the others give the same numbers).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from mmserve import native
from mmserve.models.quantization import cpu_gemv

SOURCE = Path(__file__).with_name("csrc") / "w8a8_gemv.c"
LEVEL = 2
# rows of x up to which it beats oneDNN's int8 GEMM (7B shapes, one thread: 2x at 2-4 rows, 1.3x
# at 8, 0.9x at 12, 0.4x at 64): past them `apply` multiplies by torch, and the compiled step stops
MAX_ROWS = 8
_I64, _P, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot be had."""
    library = native.build(SOURCE)
    if library is not None:
        entry = library.mmserve_w8a8_gemv_level
        entry.argtypes, entry.restype = [_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT, _INT], ctypes.c_int
    return library


def gemv_tensors(weight: torch.Tensor, scale: torch.Tensor,
                 input_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """`wsum` int32 [N] (each row's sum of codes) and `gemv_scales` float32 [N + 1] (the row scales,
    then the static input scale or 0) for a CPU layer; nothing for a GPU's."""
    if not weight.is_cpu:
        return {}
    fixed = torch.zeros(1) if input_scale is None else input_scale.reshape(1).float()
    return {"wsum": weight.sum(dim=1, dtype=torch.int32), "gemv_scales": torch.cat([scale.float(), fixed])}


def w8a8_gemv(x: torch.Tensor, weight: torch.Tensor, gemv_scales: torch.Tensor, wsum: torch.Tensor, static: bool,
              bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [.., K] float32 @ W^T (+ bias), x quantized per row (or by the static scale) as w8a8.py
    quantizes it, up to `MAX_ROWS` rows of x; else None."""
    library, rows = load(), cpu_gemv.gemv_rows(x, bias, weight, gemv_scales, wsum)
    if library is None or rows is None or rows.shape[0] > MAX_ROWS:
        return None
    N, K = weight.shape
    y = torch.empty(rows.shape[0], N)
    done = library.mmserve_w8a8_gemv_level(rows.data_ptr(), weight.data_ptr(), gemv_scales.data_ptr(),
                                           wsum.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                                           rows.shape[0], N, K, int(static), LEVEL, torch.get_num_threads())
    return y.reshape(*x.shape[:-1], N) if done == 0 else None


def w8a8_call(weight: torch.Tensor, gemv_scales: torch.Tensor, wsum: torch.Tensor,
              static: bool) -> cpu_gemv.CpuGemv | None:
    """`w8a8_gemv`'s call for the compiled decode step (`group` carries `static`), or None."""
    library = load()
    if library is None or not cpu_gemv.ours(weight, gemv_scales, wsum):
        return None
    return cpu_gemv.CpuGemv(cpu_gemv.W8A8, cpu_gemv.address(library, "mmserve_w8a8_gemv"), 0, weight.data_ptr(),
                            gemv_scales.data_ptr(), wsum.data_ptr(), weight.shape[0], weight.shape[1], int(static),
                            tensors=(weight, gemv_scales, wsum), max_rows=MAX_ROWS)
