"""The small ops between a decoder layer's GEMMs as our C kernels (`csrc/layer_ops.c`), for decode.

Built per machine by mmserve/native.py and called by ctypes: RMSNorm (alone, or after the
residual add in the same pass), Qwen3's q and k norms in one call, and the rotary of q and k in
one call, each single-threaded (no OpenMP region) into new tensors (inputs are only read), and
SiLU(gate) * up. Only float32 CPU tensors of at most `MAX_ROWS` tokens and `MAX_ELEMENTS` values,
the last dimension contiguous: there PyTorch's per-op dispatch costs more than the arithmetic. Each
function returns None where the input is not the kernels' or the library cannot be had (no
compiler, `MMSERVE_CPU_KERNELS=0`); the caller then runs the PyTorch ops (models/layers.py:
`LayerOps`), as `CpuLayerOps`, the torch backend's set, does.

Each result equals the PyTorch path's bit for bit: products and sums rounded where PyTorch rounds
them, and a norm's sum of squares added in the order of PyTorch's sum kernel (SumKernel.cpp's
cascade over its Vectorized<float> lanes), whose lane count depends on the build and the CPU.
`load` therefore runs each kernel once against the PyTorch ops on fixed inputs, for each lane
count in `LANE_CANDIDATES`, and keeps the library only with a count that matches on all of them
(else the PyTorch path stays, logged once). SiLU(gate) * up takes Sleef's exp over each row's
vector loop, as PyTorch's does, and the C library's expf over the row's tail, as PyTorch's scalar
loop does: where that loop ends depends on PyTorch's vector width for its activations (16 floats
with AVX-512, unlike its sum's 8), checked the same way (`SILU_LANE_CANDIDATES`); without a match
SiLU stays PyTorch's and the other ops are still used.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from mmserve import native
from mmserve.models.layers import LayerOps

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "layer_ops.c"
MAX_ROWS = 64  # tokens up to which the C ops run (decode batches; a prefill keeps PyTorch's threads)
MAX_ELEMENTS = 1 << 18  # values per tensor up to which one thread beats PyTorch's
MAX_NORM_WIDTH = 16384  # a norm's rows narrower (csrc's MAX_D): PyTorch's cascade steps by 16, one thread a row
# floats in PyTorch's Vectorized<float>, most likely first: 8 for AVX2 and for AVX-512 (SumKernel.cpp
# registers with REGISTER_DISPATCH, which leaves the AVX-512 slot to the AVX2 kernel) and for x86's
# generic build; 16 and 4 for other builds (128-bit NEON vectors)
LANE_CANDIDATES = (8, 16, 4)
# PyTorch's Vectorized<float> in its activation kernels (Activation.cpp registers for AVX-512 too)
SILU_LANE_CANDIDATES = (16, 8, 4)
_I64, _P, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_F32, _CPU = torch.float32, torch.device("cpu")
_SIGNATURES = {
    "mmserve_rms_norm_f32": [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F, _I64],
    "mmserve_qk_norm_f32": [_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F, _I64],
    "mmserve_rotary_f32": [_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64],
    "mmserve_silu_mul_f32": [_P, _P, _P, _I64, _I64, _I64, _I64, _I64],
}


class Kernels(NamedTuple):
    """The loaded library, the lane count its norms sum with and the one its SiLU's vector loop
    steps by (PyTorch's on this machine; None: SiLU stays PyTorch's)."""

    library: ctypes.CDLL
    lanes: int
    silu_lanes: int | None = None


@functools.cache
def load() -> Kernels | None:
    """The compiled library with its checked lane count, or None where either cannot be had."""
    library = native.build(SOURCE)
    if library is None:
        return None
    for name, argtypes in _SIGNATURES.items():
        getattr(library, name).argtypes = argtypes
        getattr(library, name).restype = ctypes.c_int
    silu_lanes = next((n for n in SILU_LANE_CANDIDATES if silu_agrees(Kernels(library, 1, n))), None)
    if silu_lanes is None:
        logger.warning("the C SiLU differs from PyTorch's on this machine (torch %s, %s); PyTorch's is used",
                       torch.__version__, torch.backends.cpu.get_cpu_capability())
    for lanes in LANE_CANDIDATES:
        if agrees(Kernels(library, lanes)):
            return Kernels(library, lanes, silu_lanes)
    logger.warning("the C layer ops differ from PyTorch's on this machine (torch %s, %s); PyTorch's are used",
                   torch.__version__, torch.backends.cpu.get_cpu_capability())
    return None


def _ours(rows: int, *tensors: torch.Tensor) -> Kernels | None:
    """The kernels when `rows` tokens of these tensors are theirs (float32 CPU, the last dimension
    contiguous, small enough for one thread), else None. Checked on every call, so only with the
    cheapest of tensor attributes."""
    if rows > MAX_ROWS:
        return None
    for t in tensors:
        if t.dtype is not _F32 or not t.is_cpu or t.stride(-1) != 1 or t.numel() > MAX_ELEMENTS:
            return None
    return load()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x: [T, D] or [T, heads, D] -> RMSNorm(x) * weight, or None."""
    if x.dim() not in (2, 3) or weight.shape != x.shape[-1:] or x.shape[-1] >= MAX_NORM_WIDTH:
        return None
    kernels = _ours(x.shape[0], x, weight)
    return None if kernels is None else _rms_norm(kernels, x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x, residual: [T, D] -> (RMSNorm(residual + x) * weight, residual + x), or None."""
    if x.dim() != 2 or x.shape != residual.shape or weight.shape != x.shape[-1:] or x.shape[-1] >= MAX_NORM_WIDTH:
        return None
    kernels = _ours(x.shape[0], x, residual, weight)
    return None if kernels is None else _add_rms_norm(kernels, x, residual, weight, eps)


def qk_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q: [T, H, Dh], k: [T, Hkv, Dh] -> each row RMSNorm'ed over Dh times its weight [Dh], or None."""
    if q.dim() != 3 or k.dim() != 3:
        return None
    T, _, Dh = q.shape
    if (k.shape[0] != T or k.shape[2] != Dh or q_weight.shape != (Dh,) or k_weight.shape != (Dh,)
            or Dh >= MAX_NORM_WIDTH):
        return None
    kernels = _ours(T, q, k, q_weight, k_weight)
    return None if kernels is None else _qk_norm(kernels, q, k, q_weight, k_weight, eps)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q: [T, H, Dh], k: [T, Hkv, Dh] rotated by cos, sin: [T, 1, Dh] (rotate-half layout), or None."""
    if q.dim() != 3 or k.dim() != 3:
        return None
    T, _, Dh = q.shape
    if (k.shape[0] != T or k.shape[2] != Dh or cos.shape != (T, 1, Dh) or sin.shape != cos.shape or Dh % 2
            or sin.stride(0) != cos.stride(0)):
        return None
    kernels = _ours(T, q, k, cos, sin)
    return None if kernels is None else _rotary(kernels, q, k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """gate, up: [T, I] -> SiLU(gate) * up [T, I], or None."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.shape[0] > MAX_ROWS:
        return None
    for t in (gate, up):  # any size: PyTorch's threads would split rows where its tails differ from one thread's
        if t.dtype is not _F32 or not t.is_cpu or t.stride(-1) != 1:
            return None
    kernels = load()
    return None if kernels is None or kernels.silu_lanes is None else _silu_mul(kernels, gate, up)


def _new(*shape: int) -> torch.Tensor:
    """An output: float32 CPU memory whatever torch's default dtype and device."""
    return torch.empty(shape, dtype=_F32, device=_CPU)


# The calls themselves, on inputs already found to be the kernels' (the checks above): each returns
# new tensors, or None where the library refused them.

def _rms_norm(kernels: Kernels, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    T, D = x.shape[0], x.shape[-1]
    heads, stride_h = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    out = _new(*x.shape)
    done = kernels.library.mmserve_rms_norm_f32(x.data_ptr(), None, None, weight.data_ptr(), out.data_ptr(), T,
                                                heads, D, x.stride(0), stride_h, 0, eps, kernels.lanes)
    return out if done == 0 else None


def _add_rms_norm(kernels: Kernels, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    T, D = x.shape
    out, total = _new(T, D), _new(T, D)
    done = kernels.library.mmserve_rms_norm_f32(x.data_ptr(), residual.data_ptr(), total.data_ptr(),
                                                weight.data_ptr(), out.data_ptr(), T, 1, D, x.stride(0), 0,
                                                residual.stride(0), eps, kernels.lanes)
    return (out, total) if done == 0 else None


def _qk_norm(kernels: Kernels, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    (T, H, Dh), Hkv = q.shape, k.shape[1]
    q_out, k_out = _new(T, H, Dh), _new(T, Hkv, Dh)
    done = kernels.library.mmserve_qk_norm_f32(q.data_ptr(), k.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(),
                                               q_out.data_ptr(), k_out.data_ptr(), T, H, Hkv, Dh, q.stride(0),
                                               q.stride(1), k.stride(0), k.stride(1), eps, kernels.lanes)
    return (q_out, k_out) if done == 0 else None


def _rotary(kernels: Kernels, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    (T, H, Dh), Hkv = q.shape, k.shape[1]
    q_out, k_out = _new(T, H, Dh), _new(T, Hkv, Dh)
    done = kernels.library.mmserve_rotary_f32(q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                              q_out.data_ptr(), k_out.data_ptr(), T, H, Hkv, Dh, q.stride(0),
                                              q.stride(1), k.stride(0), k.stride(1), cos.stride(0))
    return (q_out, k_out) if done == 0 else None


def _silu_mul(kernels: Kernels, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    T, inner = gate.shape
    out = _new(T, inner)
    done = kernels.library.mmserve_silu_mul_f32(gate.data_ptr(), up.data_ptr(), out.data_ptr(), T, inner,
                                                gate.stride(0), up.stride(0), kernels.silu_lanes)
    return out if done == 0 else None


# norm widths the check covers: below one vector, a tail, leftover items, one and two cascade levels
_CHECK_WIDTHS = (5, 20, 128, 333, 1030, 4099, 9000)


def agrees(kernels: Kernels) -> bool:
    """Whether each kernel, summing with `kernels.lanes` lanes, equals the PyTorch path bit for bit
    on fixed random inputs (norm widths `_CHECK_WIDTHS`, 3 rows each; q / k of 128-wide heads)."""
    reference, gen = LayerOps(), torch.Generator().manual_seed(0)
    for D in _CHECK_WIDTHS:
        x, residual, weight = (torch.randn(3, D, generator=gen), torch.randn(3, D, generator=gen),
                               torch.randn(D, generator=gen))
        if not _equal(_add_rms_norm(kernels, x, residual, weight, 1e-6),
                      reference.add_rms_norm(x, residual, weight, 1e-6)):
            return False
    q, k, _ = torch.randn(3, 14, 128, generator=gen).split([8, 4, 2], dim=1)  # views of one projection
    q_weight, k_weight = torch.randn(2, 128, generator=gen)
    cos, sin = torch.randn(2, 3, 1, 128, generator=gen)  # any values: the kernel reads each half's own
    return (_equal(_qk_norm(kernels, q, k, q_weight, k_weight, 1e-6),
                   reference.qk_norm(q, k, q_weight, k_weight, 1e-6))
            and _equal(_rotary(kernels, q, k, cos, sin), reference.rotary(q, k, cos, sin)))


# SiLU widths the check covers: below one vector pair, a tail after 8-float pairs but not 16-float
# ones (48), after either (77), none (3072); values up to +-120 (past exp's limits)
_SILU_WIDTHS = (5, 48, 77, 3072)


def silu_agrees(kernels: Kernels) -> bool:
    """Whether SiLU(gate) * up, its vector loop stepping by `kernels.silu_lanes`, equals PyTorch's
    bit for bit on fixed random inputs (views of one [3, 2I] projection, as gate/up are)."""
    gen = torch.Generator().manual_seed(0)
    for inner in _SILU_WIDTHS:
        gate_up = torch.randn(3, 2 * inner, generator=gen) * 40
        gate, up = gate_up[:, :inner], gate_up[:, inner:]
        got = _silu_mul(kernels, gate, up)
        if got is None or not torch.equal(got, LayerOps().silu_mul(gate, up)):
            return False
    return True


def _equal(got: tuple[torch.Tensor, ...] | None, want: tuple[torch.Tensor, ...]) -> bool:
    return got is not None and all(torch.equal(g, w) for g, w in zip(got, want))


class CpuLayerOps(LayerOps):
    """`LayerOps` with these C kernels for decode-sized float32 CPU inputs, each equal to
    `LayerOps`' result bit for bit, and PyTorch's ops elsewhere: the torch backend's set
    (models/attention/torch_sdpa.py). Inputs are only read, as in `LayerOps`."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps) if out is None else out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        out = add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps) if out is None else out

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        out = qk_norm(q, k, q_weight, k_weight, eps)
        return super().qk_norm(q, k, q_weight, k_weight, eps) if out is None else out

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = rotary(q, k, cos, sin)
        return super().rotary(q, k, cos, sin) if out is None else out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = silu_mul(gate, up)
        return super().silu_mul(gate, up) if out is None else out


CPU_OPS = CpuLayerOps()
