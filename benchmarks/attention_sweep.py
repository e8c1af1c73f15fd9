"""The triton backend's attention launches, swept on one CUDA GPU: for each shape that matters, the
launch the backend picks and its neighbours, one knob changed at a time, against the hardware's
limit measured in the same run — so that `tuning.py`'s tiles and `decode_kernel.py`'s launch
are chosen by measurement (until now, by what published Hopper kernels use).

- Decode (Qwen2.5-VL-7B: 28 query heads, 4 KV heads of 128, bfloat16, blocks of 16, shuffled),
  batch 1, 8 and 64 at 2,048-key contexts: `tile_n`, `num_warps`, `num_stages` and the split
  count, as K/V bytes read per second against a device-to-device copy's bandwidth.
- The decoder's prefill (the same heads, one 1,000-token prompt) and the tower's attention
  (Qwen2.5-VL-7B's: 16 heads of 80, a 1024x768 image's full 4,070 rows and its 64-row windows):
  `block_m`, `block_n`, `num_warps`, `num_stages`, as attention FLOP/s against a bfloat16 matmul.

A launch the compiler refuses (shared memory, registers) prints why; one whose output differs from
the current launch's is marked WRONG and never named best. Each shape ends with its best launch
and its speed-up over the current one. Run: `python benchmarks/attention_sweep.py` on a
CUDA machine (without one it says so and exits 0); `--smoke` runs the script's own code at tiny
sizes on CPU under Triton's interpreter, one alternative per knob.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from attention_kernels import (BLOCK, HEAD_DIM, HEADS, KV_HEADS, L2_FLUSH_BYTES, TOWER_HEAD_DIM, TOWER_HEADS,
                               decode_inputs, device_limits, parse_args, replay_timed)

DECODE_KNOBS = {"tile_n": [32, 128], "num_warps": [2, 8], "num_stages": [2, 4]}
PREFILL_KNOBS = {"block_m": [64, 128], "block_n": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3, 4]}
SPLIT_FACTORS = (0.5, 2, 4)
TOLERANCE = 2e-2  # a launch's output against the current one's: 16-bit rounding, summed in another order


@dataclass(frozen=True)
class Sizes:
    device: torch.device
    dtype: torch.dtype
    batches: list[int]
    context: int
    prompt: int  # the decoder's prefill: tokens of one prompt
    frame_rows: int  # the tower: patches of one image
    window_rows: int
    reps: int
    alternatives: int  # values tried per knob


@contextlib.contextmanager
def replaced(module: Any, name: str, value: Any) -> Iterator[None]:
    """`module.name` is a function returning `value` inside the block."""
    saved = getattr(module, name)
    setattr(module, name, lambda *args, **kwargs: value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def neighbours(current: Any, knobs: dict[str, list[int]], alternatives: int) -> list[tuple[str, Any]]:
    """The current launch, then each knob's other values (the first `alternatives`), one at a time."""
    cases = [("current", current)]
    for name, values in knobs.items():
        others = [v for v in values if v != getattr(current, name)][:alternatives]
        cases += [(f"{name}={v}", replace(current, **{name: v})) for v in others]
    return cases


def sweep(title: str, cases: list[tuple[str, list[Callable[[], Any]]]], work: float, limit: float, unit: str,
          sizes: Sizes) -> None:
    """Time each case (its calls taken in turn, `replay_timed`; `work` units a call against `limit`
    units per second), its first call's output checked against the current launch's; print the
    table and the best correct case's speed-up over the first (the current launch)."""
    print(f"{title}:")
    results: list[tuple[str, float]] = []
    reference = None
    for label, calls in cases:
        try:
            out = calls[0]().float()
            seconds = replay_timed(calls, sizes.device, sizes.reps)
        except Exception as e:  # the compiler refuses a launch: say why, go on
            print(f"  {label:>16}  refused: {str(e).splitlines()[0][:100]}")
            continue
        reference = out if reference is None else reference
        error = (out - reference).abs().max().item()
        wrong = f"   WRONG: max error {error:.3g}" if error > TOLERANCE else ""
        if not wrong:
            results.append((label, seconds))
        print(f"  {label:>16} {seconds * 1e6:>10.1f} us {work / seconds / 1e9:>9.0f} {unit} "
              f"ratio {work / seconds / limit:5.2f}{wrong}", flush=True)
    if results and results[0][0].startswith("current"):
        best = min(results, key=lambda r: r[1])
        print(f"  best: {best[0]} ({results[0][1] / best[1]:.2f}x the current launch)")


def decode_sweep(sizes: Sizes, batch: int, bandwidth: float) -> None:
    """One batch's decode: the current launch, each knob's neighbours, then other split counts."""
    from mmserve.models.attention import decode_kernel

    flush = L2_FLUSH_BYTES if sizes.device.type == "cuda" else 0
    q, k_cache, v_cache, lens, tables = decode_inputs(batch, sizes.context, sizes.device, sizes.dtype, flush)
    splits = decode_kernel.decode_splits(batch, KV_HEADS, sizes.context, decode_kernel.sm_count(sizes.device))
    current = decode_kernel.decode_launch(q.dtype, k_cache.element_size())

    def run(launch: Any, n: int) -> list[Callable[[], object]]:
        def call(table: torch.Tensor) -> object:
            with replaced(decode_kernel, "decode_launch", launch):
                return decode_kernel.decode_attention(q, k_cache, v_cache, lens, table, 0.088, splits=n)
        return [functools.partial(call, t) for t in tables]

    cases = [(label, run(launch, splits)) for label, launch in neighbours(current, DECODE_KNOBS, sizes.alternatives)]
    others = sorted({max(1, int(splits * f)) for f in SPLIT_FACTORS} - {splits})[:sizes.alternatives + 1]
    cases += [(f"splits={n}", run(current, n)) for n in others]
    kv_bytes = 2 * batch * sizes.context * KV_HEADS * HEAD_DIM * k_cache.element_size()
    sweep(f"decode, batch {batch} at {sizes.context} keys (current: {current}, {splits} splits)", cases,
          kv_bytes, bandwidth, "GB/s", sizes)


def prefill_cases(sizes: Sizes, head_dim: int, rows: int, keys: int,
                  attend: Callable[[], object]) -> list[tuple[str, list[Callable[[], object]]]]:
    """`attend` under each neighbour of the current tiles, once per launch they fit to (a knob past
    the launch's rows or keys fits back to one already timed)."""
    from mmserve.models.attention import tuning

    arch = tuning.device_arch(sizes.device)
    itemsize = sizes.dtype.itemsize
    current = tuning.base_tiles(head_dim, itemsize, arch)
    cases, seen = [], set()
    for label, tiles in neighbours(current, PREFILL_KNOBS, sizes.alternatives):
        with replaced(tuning, "base_tiles", tiles):
            fitted = tuning.prefill_tiles(head_dim, itemsize, rows, keys, arch)
        if fitted in seen:
            continue
        seen.add(fitted)

        def call(tiles: Any = tiles) -> object:
            with replaced(tuning, "base_tiles", tiles):
                return attend()
        cases.append((label if label != "current" else f"current {fitted.block_m}x{fitted.block_n}", [call]))
    return cases


def prefill_sweep(sizes: Sizes, rate: float) -> None:
    from mmserve.models.attention.paged_kernel import paged_attention
    from mmserve.models.attention.triton_backend import TritonBackend

    t, device = sizes.prompt, sizes.device
    blocks = -(-t // BLOCK)
    k_cache, v_cache = (torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device).to(sizes.dtype) for _ in range(2))
    q = torch.randn(t, HEADS, HEAD_DIM, device=device).to(sizes.dtype)
    starts = torch.tensor([0, t], dtype=torch.int32, device=device)
    lens = torch.tensor([t], dtype=torch.int32, device=device)
    tables = torch.arange(blocks, dtype=torch.int32, device=device).view(1, -1)
    attend = functools.partial(paged_attention, q, k_cache, v_cache, starts, lens, tables, t, 0.088)
    rows = t * (HEADS // KV_HEADS)  # a program's rows are queries x the KV head's group
    sweep(f"decoder prefill, one {t}-token prompt", prefill_cases(sizes, HEAD_DIM, rows, blocks * BLOCK, attend),
          2 * t * t * HEADS * HEAD_DIM, rate, "GFLOP/s", sizes)  # causal: half of 4 x T^2 x H x Dh

    backend = TritonBackend(device)
    q, k, v = (torch.randn(sizes.frame_rows, TOWER_HEADS, TOWER_HEAD_DIM, device=device).to(sizes.dtype)
               for _ in range(3))
    windows = [*range(0, sizes.frame_rows, sizes.window_rows), sizes.frame_rows]
    for name, cu in (("full", [0, sizes.frame_rows]), (f"{len(windows) - 1} windows", windows)):
        segments = backend.segments(cu, device)
        longest = max(hi - lo for lo, hi in zip(cu[:-1], cu[1:]))
        flops = sum(4 * (hi - lo) ** 2 * TOWER_HEADS * TOWER_HEAD_DIM for lo, hi in zip(cu[:-1], cu[1:]))
        attend = functools.partial(segments.attend, q, k, v, TOWER_HEAD_DIM**-0.5)
        sweep(f"tower, {sizes.frame_rows} rows, {name}", prefill_cases(sizes, TOWER_HEAD_DIM, longest, longest, attend),
              flops, rate, "GFLOP/s", sizes)


def main() -> None:
    args = parse_args(__doc__ or "", 20)
    if args.smoke:
        sizes = Sizes(torch.device("cpu"), torch.float16, [1], 128, 24, 70, 32, 1, 1)
    elif torch.cuda.is_available():
        sizes = Sizes(torch.device("cuda"), torch.bfloat16, [1, 8, 64], 2048, 1000, 4070, 64, args.reps, 3)
    else:
        print("no CUDA GPU here: nothing to measure (--smoke checks the script on CPU)")
        return
    bandwidth, rate = device_limits(sizes.device)
    for batch in sizes.batches:
        decode_sweep(sizes, batch, bandwidth)
    prefill_sweep(sizes, rate)


if __name__ == "__main__":
    main()
