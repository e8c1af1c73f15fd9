"""The CPU decode attention kernel against the time its bytes take to read, measured in the same run.

For each cache dtype (float32, bfloat16, float16), batch and context, one layer's decode attention
by our C kernel (`models/attention/cpu_kernels.py`, the split count the backend picks) over
shuffled blocks (a cache after hours of traffic), on 2 MiB pages as the engine allocates it,
against the read floor: the same blocks read once in the same order with the same prefetch and
nothing computed (`benchmarks/read_blocks.c`). Shapes: `decode_step.py`'s model (8 query heads,
4 KV heads of 128, blocks of 16). Each call reads a fresh layer's cache (enough layers that the
caches outgrow the last-level cache, as a decode step's weights evict them between layers), so
both read from memory. Prints per configuration the MB a call reads, the kernel's and the
floor's microseconds per call, the kernel's GB/s and the ratio kernel / floor (1.0: the kernel
reads as fast as the bytes can be read; the target is <= 1.2).

Run: `python benchmarks/decode_attention.py [--batches 1,8] [--contexts 512,4096]
[--dtypes float32,bfloat16,float16] [--q-dtype float32] [--reps 8]`; set OMP_NUM_THREADS=1 for one
core's figures. `--q-dtype float32` measures float32 queries over each cache dtype (the entries
`--kv-cache-dtype` uses under a float32 model) against that cache's floor.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import time
from collections.abc import Callable
from pathlib import Path

import mmserve  # noqa: F401  (first: sets OMP_WAIT_POLICY before torch loads, as the engine's processes have it)
import torch

from mmserve.malloc_tuning import zeros_on_huge_pages
from mmserve import native
from mmserve.models.attention import cpu_kernels
from mmserve.models.attention.torch_sdpa import kernel_splits

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 128, 16
CACHES_BYTES = 512 << 20  # all layers' caches together: past any last-level cache
READ_BLOCKS = Path(__file__).with_name("read_blocks.c")


Layers = list[tuple[torch.Tensor, torch.Tensor]]


def caches(batch: int, context: int, dtype: torch.dtype, g: torch.Generator) -> tuple[Layers, torch.Tensor]:
    """Layers' (K, V) caches holding `batch` requests' `context` keys each, and their tables [B, W]
    (distinct blocks in random order)."""
    blocks = batch * -(-context // BLOCK)
    layer_bytes = 2 * blocks * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    layers = max(2, -(-CACHES_BYTES // layer_bytes))
    shape = (blocks + 1, BLOCK, KV_HEADS, HEAD_DIM)
    kv = [(zeros_on_huge_pages(shape, dtype).uniform_(-1, 1, generator=g),
           zeros_on_huge_pages(shape, dtype).uniform_(-1, 1, generator=g)) for _ in range(layers)]
    return kv, torch.randperm(blocks + 1, generator=g)[:blocks].view(batch, -1).contiguous()


def per_call(fn: Callable[[torch.Tensor, torch.Tensor], None], layers: Layers, reps: int) -> float:
    """Seconds of one call of fn(k_cache, v_cache), the best over `reps` rounds of the layers."""
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        for k, v in layers:
            fn(k, v)
        best = min(best, (time.perf_counter() - start) / len(layers))
    return best


def measure(floor: ctypes.CDLL, batch: int, context: int, dtype: torch.dtype, q_dtype: torch.dtype | None,
            reps: int) -> None:
    """One configuration's row: the kernel's and the floor's time per call, and their ratio (q and
    out of `q_dtype`, or of the cache's dtype where it is None)."""
    g = torch.Generator().manual_seed(batch * context)
    layers, tables = caches(batch, context, dtype, g)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(q_dtype or dtype)
    out, lens, rows = torch.empty_like(q), torch.full((batch,), context), torch.arange(batch)
    splits = kernel_splits(batch, tables.shape[1])
    block_bytes = BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize

    def kernel(k: torch.Tensor, v: torch.Tensor) -> None:
        assert cpu_kernels.paged_decode(q, k, v, tables, lens, rows, out, HEAD_DIM**-0.5, splits)

    def read(k: torch.Tensor, v: torch.Tensor) -> None:
        floor.mmserve_read_blocks(k.data_ptr(), v.data_ptr(), tables.data_ptr(), lens.data_ptr(), batch,
                                  tables.shape[1], BLOCK, block_bytes)

    kernel_s, read_s = per_call(kernel, layers, reps), per_call(read, layers, reps)
    megabytes = 2 * batch * context * KV_HEADS * HEAD_DIM * dtype.itemsize / 1e6
    name = str(dtype).removeprefix("torch.") + ("" if q_dtype is None else f"/q{q_dtype.itemsize * 8}")
    print(f"{name:>13} {batch:5d} {context:5d} {megabytes:8.1f} {kernel_s * 1e6:10.1f} "
          f"{read_s * 1e6:9.1f} {megabytes / 1e3 / kernel_s:6.1f}   kernel / floor ratio {kernel_s / read_s:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--q-dtype", choices=["float32"], default=None,
                        help="queries' dtype (default: the cache's)")
    parser.add_argument("--reps", type=int, default=8)
    args = parser.parse_args()
    floor = native.build(READ_BLOCKS)
    if cpu_kernels.load() is None or floor is None:
        print("no C compiler here (or MMSERVE_CPU_KERNELS=0): nothing to measure")
        return
    floor.mmserve_read_blocks.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
    floor.mmserve_read_blocks.restype = ctypes.c_uint64
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads (target: kernel / floor <= 1.2)")
    print(f"{'dtype':>13} {'batch':>5} {'ctx':>5} {'MB/call':>8} {'kernel us':>10} {'floor us':>9} {'GB/s':>6}")
    q_dtype = None if args.q_dtype is None else getattr(torch, args.q_dtype)
    for name in args.dtypes.split(","):
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                measure(floor, batch, context, getattr(torch, name), q_dtype, args.reps)


if __name__ == "__main__":
    main()
