"""Tile sizes, warps and pipeline stages of the prefill attention kernels, per head size and dtype.

Not timed when chosen (no GPU at hand): each comes from what published Hopper kernels use for the
same head size, written beside it, with warps enough that `ptxas` spills no register at the
shipped models' shapes (`benchmarks/kernel_resources.py` compiles them for sm_90 without a GPU).
`benchmarks/attention_sweep.py` times each beside its neighbours on a GPU.
`tl.arange` (and `tl.dot`, at least 16) need powers of two: the paged kernel runs a head of 80 or
96 in 128 lanes (the rest masked), as a head of 128; the tower's variable-length kernel holds it in
two parts (`head_parts`: 80 = 64 + 16, 96 = 64 + 32).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

NOMINAL_ARCH = 90  # an H100's compute capability: the tiles chosen off CUDA (the interpreter, gpu_compile)


@dataclass(frozen=True)
class TileConfig:
    """One launch's shape: BLOCK_M query rows per program, BLOCK_N keys per tile."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Half precision (bf16 / fp16), padded head <= 64: FlashAttention-2's forward tile for head 64 is
# 128 x 128 with 4 warps; Triton's fused-attention tutorial searches BLOCK_M {64, 128} x BLOCK_N
# {32, 64} x stages {3, 4, 7}, 8 warps only for 128 x 128 tiles: 128 x 64 keeps 4 warps, 4 stages.
HALF_SMALL_HEAD = TileConfig(block_m=128, block_n=64, num_warps=4, num_stages=4)
# Half precision, padded head 128 (heads 72, 80, 96, 128): FlashAttention-2's forward tile for heads
# 96 and 128 is 128 x 64; 3 stages of K and V tiles (3 x 2 x 64 x 128 x 2 B = 96 KiB) plus Q
# (32 KiB) fit the 228 KiB of shared memory of an H100 SM, as in the tutorial's search. 8 warps, as
# the tutorial takes for 128-row tiles: with 4, a thread's share of the 128 x 128 float32
# accumulator and Q tile passes 255 registers and spills (compiled for sm_90: 424 bytes a thread
# at head 128, none with 8 warps at 181 registers).
HALF_LARGE_HEAD = TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
# Ampere and Ada (sm_80 to sm_89): `mma.sync` keeps the accumulator and the operands in registers
# where Hopper's `wgmma` reads one from shared memory, and 128 x 64 tiles spill 32-40 bytes a thread
# at head 128 even with 8 warps (compiled for sm_80); 128 x 32 spill nothing, nor, at heads <= 64,
# 128 x 64 with 8 warps. Shared memory stays under sm_86's 99 KiB.
AMPERE_SMALL_HEAD = TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
AMPERE_LARGE_HEAD = TileConfig(block_m=128, block_n=32, num_warps=8, num_stages=3)
# float32: values take twice the bytes and `tl.dot` runs in IEEE precision (no tensor cores):
# 64-row tiles of 16 keys, 2 stages, 8 warps: the largest tile that spills nothing at head 128
# under both Triton 3.6 and 3.9 (64 x 32 spills 376 bytes a thread under 3.6; 4 warps spill).
SINGLE = TileConfig(block_m=64, block_n=16, num_warps=8, num_stages=2)


def head_parts(head_dim: int) -> tuple[int, int]:
    """(D0, D1): a head's lanes as two power-of-two parts of at least 16 (`tl.dot`'s least), D0 the
    largest power of two <= head_dim and D1 the rest padded, when that is fewer lanes than one part
    padded to a power of two (80: 64 + 16 = 80, not 128); else (that one part, 0)."""
    whole = max(16, triton.next_power_of_2(head_dim))
    first = max(16, whole // 2 if whole > head_dim else whole)
    rest = head_dim - first
    if rest <= 0:
        return whole, 0
    second = max(16, triton.next_power_of_2(rest))
    return (first, second) if first + second < whole else (whole, 0)


def base_tiles(head_dim: int, itemsize: int, arch: int = NOMINAL_ARCH) -> TileConfig:
    """The tiles for heads of `head_dim` in a dtype of `itemsize` bytes on a GPU of compute
    capability `arch` (`device_arch`), before `prefill_tiles` fits them to a launch's rows and keys
    (`benchmarks/attention_sweep.py` replaces it to time other tiles)."""
    small = triton.next_power_of_2(head_dim) <= 64
    if itemsize >= 4:
        return SINGLE
    if arch < 90:
        return AMPERE_SMALL_HEAD if small else AMPERE_LARGE_HEAD
    return HALF_SMALL_HEAD if small else HALF_LARGE_HEAD


def prefill_tiles(head_dim: int, itemsize: int, rows: int, keys: int, arch: int = NOMINAL_ARCH) -> TileConfig:
    """`base_tiles` for a launch whose programs have at most `rows` query rows and `keys` keys:
    never larger than those (Qwen2.5-VL's 64-patch windows take 64-row tiles, a CLIP image of 17
    rows 32), nor than 16 (`tl.dot`'s least)."""
    tiles = base_tiles(head_dim, itemsize, arch)
    return replace(tiles, block_m=min(tiles.block_m, max(16, triton.next_power_of_2(rows))),
                   block_n=min(tiles.block_n, max(16, triton.next_power_of_2(keys))))


def kv_stages(stages: int, query_itemsize: int, cache_itemsize: int) -> int:
    """`stages` of a loop over K/V tiles, or 1 where they are loaded narrower than the query (a
    16-bit cache under a float32 model) and widened in the loop: pipelined, each tile is held in
    both widths and registers spill (compiled for sm_90 at head 128: 192 to 5,584 bytes a thread,
    none with one stage)."""
    return 1 if cache_itemsize < query_itemsize else stages


def device_arch(device: torch.device) -> int:
    """`device`'s compute capability as major * 10 + minor; NOMINAL_ARCH off CUDA."""
    if device.type != "cuda":
        return NOMINAL_ARCH
    return _cuda_arch(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor
