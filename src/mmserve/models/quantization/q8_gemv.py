"""The opt-in int8-activation GEMV for int4 weights on the CPU (`--cpu-activation-quant int8`):
a step's rows of x quantized to int8 per block of the weight's group and multiplied by the int4
codes in integers, as llama.cpp multiplies Q4_0 weights by Q8_0 activations. Faster than the
exact GEMV (cpu_gemv.int4_gemv, float32 x) and not exact: x is rounded to 8 bits.

The kernel is `csrc/int4_q8_gemv.c` (its docstring states the quantization and the formula),
built per machine by mmserve/native.py; `LEVEL` caps the path it takes (2: AVX-512
VNNI, 1: AVX2, 0: plain C; tests lower it to prove the others give the same integers). It reads
int4.py's resident form with W's rows interleaved by 16 (`interleave`, done once when the layer is
packed: the same bytes), so that one vector lane holds one row's sums; `deinterleave` gives rows
back in the resident form (a prefill's tiles, `dequantize`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from mmserve import native
from mmserve.models.quantization import cpu_gemv

SOURCE = Path(__file__).with_name("csrc") / "int4_q8_gemv.c"
LANES = 16  # rows of W interleaved
LEVEL = 2  # the widest path used, where built: 2 AVX-512 VNNI, 1 AVX2, 0 plain C
_I64, _P, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot be had."""
    library = native.build(SOURCE)
    if library is not None:
        library.mmserve_int4_q8_gemv.argtypes = [_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT, _INT]
        library.mmserve_int4_q8_gemv.restype = ctypes.c_int
        library.mmserve_q8_level.restype = ctypes.c_int
    return library


def built_level() -> int | None:
    """The widest path the library was built with here (see `LEVEL`), or None without it."""
    library = load()
    return None if library is None else int(library.mmserve_q8_level())


def can_interleave(qweight: torch.Tensor, group: int) -> bool:
    """Whether the kernel takes this int4 weight (resident form, [N, K / 8]): rows a multiple of
    16, groups of a multiple of 128 columns, on the CPU, the library built."""
    return (qweight.device.type == "cpu" and qweight.dim() == 2 and qweight.shape[0] > 0
            and qweight.shape[0] % LANES == 0 and group % 128 == 0 and load() is not None)


def interleave(qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4.py's resident tensors ([N, K / 8], [N, G], [N, G]) with W's rows interleaved by 16:
    [N / 16, K / 8, 16], [N / 16, G, 16], [N / 16, G, 16] (element [b, j, r] = row 16b + r's j)."""
    return tuple(t.reshape(t.shape[0] // LANES, LANES, t.shape[1]).transpose(1, 2).contiguous()
                 for t in (qweight, scales, zeros))  # type: ignore[return-value]


def deinterleave(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, start: int = 0,
                 stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [start, stop) (multiples of 16) of interleaved tensors, back in the resident form."""
    first, last = start // LANES, None if stop is None else -(-stop // LANES)
    return tuple(t[first:last].transpose(1, 2).reshape(-1, t.shape[1]).contiguous()
                 for t in (qweight, scales, zeros))  # type: ignore[return-value]


def int4_q8_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [.., K] float32 @ W^T (+ bias) with x quantized to int8 per group of columns, for an int4
    weight interleaved (`interleave`), up to `cpu_gemv.GEMV_MAX_ROWS` rows of x; else None."""
    library, rows = load(), cpu_gemv.gemv_rows(x, bias, qweight, scales, zeros)
    if library is None or rows is None:
        return None
    N, K = qweight.shape[0] * LANES, qweight.shape[1] * 8
    y = torch.empty(rows.shape[0], N)
    done = library.mmserve_int4_q8_gemv(rows.data_ptr(), qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
                                        None if bias is None else bias.data_ptr(), y.data_ptr(), rows.shape[0], N,
                                        K, group, LEVEL, torch.get_num_threads())
    return y.reshape(*x.shape[:-1], N) if done == 0 else None


def int4_q8_call(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group: int) -> cpu_gemv.CpuGemv | None:
    """`int4_q8_gemv`'s call for an interleaved weight, or None where the kernel is not its own."""
    library = load()
    if library is None or not cpu_gemv.ours(qweight, scales, zeros):
        return None
    return cpu_gemv.CpuGemv(cpu_gemv.INT4_Q8, cpu_gemv.address(library, "mmserve_int4_q8_gemv"), 0, qweight.data_ptr(),
                            scales.data_ptr(), zeros.data_ptr(), qweight.shape[0] * LANES, qweight.shape[1] * 8,
                            group, flag=LEVEL, tensors=(qweight, scales, zeros))
