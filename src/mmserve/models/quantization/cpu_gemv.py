"""Quantized weights' CPU kernels in C, built per machine as the decode attention kernel is
(built by mmserve/native.py): decode GEMVs that dequantize in registers (int4 and int8 with group
scales and zeros, FP8 e4m3 per row or block) and the dequantized row tiles a prefill's matmul
reads (`csrc/quant_gemv.c`, AVX2 or plain C), and the GEMVs again with AVX-512 where the machine
has it (`csrc/quant_gemv512.c`, tried first; `WIDE` turns it off); and the GEMV of a quantized
checkpoint's 16-bit weights kept as stored (`csrc/half_gemv.c`: its LM head, base.linear). Each function returns None
(nothing done) where the kernels are off or cannot be built, or the tensors are not theirs (not
float32 CPU, not contiguous); callers then keep their PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch

from mmserve import native

SOURCE = Path(__file__).with_name("csrc") / "quant_gemv.c"
WIDE_SOURCE = SOURCE.with_name("quant_gemv512.c")
HALF_SOURCE = SOURCE.with_name("half_gemv.c")
WIDE = True  # use the AVX-512 GEMVs where they are built (tests turn it off to prove the others)
GEMV_MAX_ROWS = 256  # rows of x up to which a GEMV beats dequantized tiles (`benchmarks/quant_formats.py --rows`)
# the int8 GEMV's (no AVX-512 version): even with the tiles at 64 rows (7B shapes, one thread), and
# the compiled decode step's most rows (cpu_ops.MAX_ROWS), whose calls must be the Python step's
INT8_GEMV_MAX_ROWS = 64
_I64, _P, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "mmserve_int4_gemv_f32": [_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT],
    "mmserve_int4_dequant_rows": [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT],
    "mmserve_int8_gemv_f32": [_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT],
    "mmserve_int8_dequant_rows": [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT],
    "mmserve_fp8_gemv_f32": [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT],
    "mmserve_fp8_dequant_rows": [_P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT],
}


# `CpuGemv.kind`: which kernel signature (models/csrc/decode_layers.c's enum)
INT4, INT4_Q8, FP8, HALF, INT8, W8A8 = 1, 2, 3, 4, 5, 6


class CpuGemv(NamedTuple):
    """A layer's decode GEMV as one C call (`LinearMethod.cpu_gemv`): the kernel's address and the
    arguments the Python call would give it, for models/cpu_decoder.py's compiled step. `fallback`
    (or 0) is the kernel tried when `fn` refuses, as the functions below try them; `flag` is the
    int8 kernel's level, or 1 for a bfloat16 weight of `HALF`. `tensors` keeps the pointed-to
    tensors alive as long as the call is held; `max_rows`: the rows of x up to which this kernel is
    the one `apply` calls (the compiled step runs steps of at most its layers' least)."""

    kind: int
    fn: int
    fallback: int
    weight: int
    scales: int
    zeros: int
    N: int
    K: int
    group: int = 0
    block_out: int = 0
    block_in: int = 0
    flag: int = 0
    tensors: tuple[torch.Tensor, ...] = ()
    max_rows: int = INT8_GEMV_MAX_ROWS


def address(library: ctypes.CDLL | None, name: str) -> int:
    """The address of a loaded library's function (0 without the library)."""
    return 0 if library is None else int(ctypes.cast(getattr(library, name), ctypes.c_void_p).value or 0)


def int4_call(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> CpuGemv | None:
    """`int4_gemv`'s call for this weight (resident form), or None where the kernels are not its own."""
    library, wide = load(), _wide()
    if library is None or not ours(qweight, scales, zeros):
        return None
    exact = address(library, "mmserve_int4_gemv_f32")
    fn, fallback = (exact, 0) if wide is None else (address(wide, "mmserve_int4_gemv512"), exact)
    return CpuGemv(INT4, fn, fallback, qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), qweight.shape[0],
                   qweight.shape[1] * 8, group, tensors=(qweight, scales, zeros))


def int8_call(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> CpuGemv | None:
    """`int8_gemv`'s call for this weight (resident form), or None where the kernel is not its own."""
    library = load()
    if library is None or not ours(codes, scales, zeros):
        return None
    return CpuGemv(INT8, address(library, "mmserve_int8_gemv_f32"), 0, codes.data_ptr(), scales.data_ptr(),
                   zeros.data_ptr(), codes.shape[0], codes.shape[1], group, tensors=(codes, scales, zeros))


def fp8_call(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> CpuGemv | None:
    """`fp8_gemv`'s call for this weight, or None where the kernels are not its own."""
    library, wide = load(), _wide()
    if library is None or not ours(weight, scale):
        return None
    exact = address(library, "mmserve_fp8_gemv_f32")
    fn, fallback = (exact, 0) if wide is None else (address(wide, "mmserve_fp8_gemv512"), exact)
    bo, bi = block or (0, 0)
    return CpuGemv(FP8, fn, fallback, weight.data_ptr(), scale.data_ptr(), 0, weight.shape[0], weight.shape[1],
                   block_out=bo, block_in=bi, tensors=(weight, scale))


def half_call(weight: torch.Tensor) -> CpuGemv | None:
    """`half_gemv`'s call for a 16-bit weight, or None where the kernel is not its own."""
    library = load_half()
    if library is None or weight.dtype not in (torch.float16, torch.bfloat16) or not ours(weight):
        return None
    return CpuGemv(HALF, address(library, "mmserve_half_gemv"), 0, weight.data_ptr(), 0, 0, weight.shape[0],
                   weight.shape[1], flag=int(weight.dtype == torch.bfloat16), tensors=(weight,))


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot be had."""
    library = native.build(SOURCE)
    if library is not None:
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(library, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return library


@functools.cache
def load_wide() -> ctypes.CDLL | None:
    """The AVX-512 library, or None where it cannot be had or the machine lacks AVX-512."""
    library = native.build(WIDE_SOURCE)
    if library is None or not library.mmserve_q512_built():
        return None
    for name in ("mmserve_int4_gemv512", "mmserve_fp8_gemv512"):
        fn = getattr(library, name)
        fn.argtypes, fn.restype = _SIGNATURES[name.replace("512", "_f32")], ctypes.c_int
    return library


@functools.cache
def load_half() -> ctypes.CDLL | None:
    """The library of 16-bit weights' GEMV, or None where it cannot be had."""
    library = native.build(HALF_SOURCE)
    if library is not None:
        library.mmserve_half_gemv.argtypes = [_P, _P, _P, _I64, _I64, _I64, _INT, _INT]
        library.mmserve_half_gemv.restype = ctypes.c_int
    return library


def half_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [.., K] float32 @ W^T (+ bias) for a float16 or bfloat16 weight [N, K] held as the
    checkpoint stores it (float32 arithmetic), up to `GEMV_MAX_ROWS` rows of x; else None."""
    library, rows = load_half(), gemv_rows(x, bias, weight)
    if library is None or rows is None or weight.dtype not in (torch.float16, torch.bfloat16):
        return None
    N, K = weight.shape
    y = torch.empty(rows.shape[0], N)
    done = library.mmserve_half_gemv(rows.data_ptr(), weight.data_ptr(), y.data_ptr(), rows.shape[0], N, K,
                                     int(weight.dtype == torch.bfloat16), torch.get_num_threads())
    if done != 0:
        return None
    y = _shaped(y, x)
    return y if bias is None else y + bias


def _wide() -> ctypes.CDLL | None:
    return load_wide() if WIDE else None


def ours(*tensors: torch.Tensor | None) -> bool:
    """Every tensor given is a contiguous CPU tensor (a plain loop: this runs per GEMV call)."""
    for t in tensors:
        if t is not None and not (t.is_cpu and t.is_contiguous()):
            return False
    return True


def gemv_rows(x: torch.Tensor, bias: torch.Tensor | None, *weights: torch.Tensor) -> torch.Tensor | None:
    """x as float32 rows [M, K] for a GEMV, or None where the GEMV is not the kernel's to do."""
    if x.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        return None
    rows = _rows(x)
    return rows if rows.shape[0] <= GEMV_MAX_ROWS and ours(rows, bias, *weights) else None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()


def _shaped(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y [M, N] as x's leading dims [.., N]."""
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
              bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [.., K] float32 @ W^T (+ bias) for an int4 weight (int4.py's resident form), up to
    `GEMV_MAX_ROWS` rows of x; else None."""
    library, rows = load(), gemv_rows(x, bias, qweight, scales, zeros)
    if library is None or rows is None:
        return None
    N, K = qweight.shape[0], qweight.shape[1] * 8
    y = torch.empty(rows.shape[0], N)
    args = (rows.data_ptr(), qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), _ptr(bias), y.data_ptr(),
            rows.shape[0], N, K, group, torch.get_num_threads())
    wide = _wide()
    done = 1 if wide is None else wide.mmserve_int4_gemv512(*args)
    done = done and library.mmserve_int4_gemv_f32(*args)
    return _shaped(y, x) if done == 0 else None


def int4_rows(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, start: int,
              stop: int) -> torch.Tensor | None:
    """Rows [start, stop) of an int4 weight's W, float32, or None."""
    library = load()
    if library is None or not ours(qweight, scales, zeros):
        return None
    K = qweight.shape[1] * 8
    out = torch.empty(stop - start, K)
    done = library.mmserve_int4_dequant_rows(qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), out.data_ptr(),
                                             start, stop - start, K, group, torch.get_num_threads())
    return out if done == 0 else None


def int8_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
              bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [.., K] float32 @ W^T (+ bias) for an int8 weight (int8.py's resident form), up to
    `INT8_GEMV_MAX_ROWS` rows of x; else None."""
    library, rows = load(), gemv_rows(x, bias, codes, scales, zeros)
    if library is None or rows is None or rows.shape[0] > INT8_GEMV_MAX_ROWS:
        return None
    N, K = codes.shape
    y = torch.empty(rows.shape[0], N)
    done = library.mmserve_int8_gemv_f32(rows.data_ptr(), codes.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
                                         _ptr(bias), y.data_ptr(), rows.shape[0], N, K, group, torch.get_num_threads())
    return _shaped(y, x) if done == 0 else None


def int8_rows(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, start: int,
              stop: int) -> torch.Tensor | None:
    """Rows [start, stop) of an int8 weight's W, float32, or None."""
    library = load()
    if library is None or not ours(codes, scales, zeros):
        return None
    K = codes.shape[1]
    out = torch.empty(stop - start, K)
    done = library.mmserve_int8_dequant_rows(codes.data_ptr(), scales.data_ptr(), zeros.data_ptr(), out.data_ptr(),
                                             start, stop - start, K, group, torch.get_num_threads())
    return out if done == 0 else None


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
             bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [.., K] float32 @ W^T (+ bias) for an FP8 weight (fp8.py's resident form: `scale` [N]
    per row when `block` is None, else per block), up to `GEMV_MAX_ROWS` rows; else None."""
    library, rows = load(), gemv_rows(x, bias, weight, scale)
    if library is None or rows is None:
        return None
    N, K = weight.shape
    bo, bi = block or (0, 0)
    y = torch.empty(rows.shape[0], N)
    args = (rows.data_ptr(), weight.data_ptr(), scale.data_ptr(), _ptr(bias), y.data_ptr(), rows.shape[0], N, K,
            bo, bi, torch.get_num_threads())
    wide = _wide()
    done = 1 if wide is None else wide.mmserve_fp8_gemv512(*args)
    done = done and library.mmserve_fp8_gemv_f32(*args)
    return _shaped(y, x) if done == 0 else None


def fp8_rows(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, start: int,
             stop: int) -> torch.Tensor | None:
    """Rows [start, stop) of an FP8 weight's W, float32, or None."""
    library = load()
    if library is None or not ours(weight, scale):
        return None
    K = weight.shape[1]
    bo, bi = block or (0, 0)
    out = torch.empty(stop - start, K)
    done = library.mmserve_fp8_dequant_rows(weight.data_ptr(), scale.data_ptr(), out.data_ptr(), start,
                                            stop - start, K, bo, bi, torch.get_num_threads())
    return out if done == 0 else None
