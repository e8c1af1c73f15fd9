"""The triton backend's attention kernels on one CUDA GPU, each against the hardware's limit
measured in the same run.

- Decode (Qwen2.5-VL-7B's attention: 28 query heads, 4 KV heads of 128, bfloat16, blocks of 16,
  shuffled blocks), batch 1 to 64 at 2,048-key contexts: one layer's split-KV decode (the split
  count the backend picks) and the same kernel with one split (one program per sequence and KV
  head, what the engine ran before), each as the K/V bytes it reads per second against a
  device-to-device copy's bandwidth (bytes read + written per second).
- Prefill (Qwen2.5-VL-7B's tower: 16 heads of 80, bfloat16): a 1024x768 image's full attention
  (one 4,070-row segment) and its 64-row windows, as attention FLOP/s (4 x rows x keys x heads x
  head dim per segment) against a large bfloat16 matmul's rate; the head in 64 + 16 lanes as the
  backend runs it, and in one 128-lane part (the kernel before) beside it.

Kernels are timed as CUDA-graph replays (`replay_timed`: no host launch between two kernels, as in
the engine's decode graphs), decode over enough distinct K/V (`decode_inputs`) that no call reads
what the call before left in L2.

Run: `python benchmarks/attention_kernels.py` on a CUDA machine (without one it says so and exits
0); `--smoke` runs the script's own code at tiny sizes on CPU under Triton's interpreter.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import time
from typing import Callable

import torch

from _gpu_limits import copy_bandwidth, matmul_rate

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 28, 4, 128, 16
TOWER_HEADS, TOWER_HEAD_DIM, FRAME_ROWS, WINDOW_ROWS = 16, 80, 4070, 64
L2_FLUSH_BYTES = 256 << 20  # K/V read in turn by a decode benchmark: past any GPU's L2


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Mean seconds of `fn` over `reps` runs after two warm-ups (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / reps


def replay_timed(calls: list[Callable[[], object]], device: torch.device, reps: int) -> float:
    """Mean seconds of one call, `calls` taken in turn: on a GPU, `reps` of them (at least one
    round) captured in a CUDA graph and the graph replayed, so that a small kernel is timed as the
    engine's decode graphs run it, without the host's launch between two kernels; off CUDA, timed."""
    if device.type != "cuda":
        turn = itertools.cycle(calls)
        return timed(lambda: next(turn)(), device, reps)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for call in calls * 2:  # compiled and warm before the capture
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    n = max(reps, len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % len(calls)]()
    return timed(graph.replay, device, 5) / n


def decode_inputs(batch: int, context: int, device: torch.device, dtype: torch.dtype,
                  min_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(q, k_cache, v_cache, seq_lens, block tables) for Qwen2.5-VL-7B's decode attention: `batch`
    sequences of `context` keys in shuffled blocks, in as many sets of tables (disjoint blocks) as
    take `min_bytes` of K/V together, so that calls taking them in turn read memory, not a cache
    that one set fits in (an H100's L2 holds 50 MB; batch 1 reads 4 MB a layer)."""
    blocks = batch * context // BLOCK
    set_bytes = 2 * blocks * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    sets = max(1, -(-min_bytes // set_bytes))
    k_cache, v_cache = (torch.randn(sets * blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, device=device).to(dtype)
                        for _ in range(2))
    order = torch.randperm(sets * blocks, device=device).to(torch.int32)
    tables = [order[i * blocks:(i + 1) * blocks].view(batch, -1) for i in range(sets)]
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device).to(dtype)
    return q, k_cache, v_cache, lens, tables


def device_limits(device: torch.device) -> tuple[float, float]:
    """The copy bandwidth (bytes read + written per second, a 1 GiB copy) and a bfloat16 matmul's
    FLOP/s (8,192-square), measured now (`_gpu_limits.py`, as `make bench-gpu`); 64 MiB and 512 on CPU."""
    cuda = device.type == "cuda"
    return (copy_bandwidth(device, (1 << 30) if cuda else (1 << 26)),
            matmul_rate(device, torch.bfloat16, 8192 if cuda else 512))


def decode_rows(device: torch.device, batches: list[int], context: int, bandwidth: float, reps: int) -> None:
    print(f"decode: {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, {context} keys each, blocks of {BLOCK}; "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'batch':>6} {'splits':>6} {'split us':>9} {'GB/s':>7} {'ratio':>6} {'1-split us':>10} {'GB/s':>7} "
          f"{'ratio':>6} {'speed-up':>8}")
    for batch in batches:
        decode_row(device, batch, context, bandwidth, reps)


def decode_row(device: torch.device, batch: int, context: int, bandwidth: float, reps: int) -> None:
    """One batch's line: the split-KV kernel as the backend launches it, then with one split."""
    from mmserve.models.attention.decode_kernel import decode_attention, decode_splits, sm_count

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    flush = L2_FLUSH_BYTES if device.type == "cuda" else 0
    q, k_cache, v_cache, lens, tables = decode_inputs(batch, context, device, dtype, flush)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()
    splits = decode_splits(batch, KV_HEADS, tables[0].shape[1] * BLOCK, sm_count(device))

    def calls(n: int | None) -> list[Callable[[], object]]:
        return [functools.partial(decode_attention, q, k_cache, v_cache, lens, t, 0.088, splits=n) for t in tables]
    split = replay_timed(calls(None), device, reps)
    single = replay_timed(calls(1), device, reps)
    print(f"{batch:>6} {splits:>6} {split * 1e6:>9.1f} {kv_bytes / split / 1e9:>7.0f} "
          f"{kv_bytes / split / bandwidth:>6.2f} {single * 1e6:>10.1f} {kv_bytes / single / 1e9:>7.0f} "
          f"{kv_bytes / single / bandwidth:>6.2f} {single / split:>8.2f}")


def prefill_rows(device: torch.device, frame_rows: int, rate: float, reps: int) -> None:
    """The tower's segments as the backend runs them (the head in `head_parts` lanes, 64 + 16 for 80),
    then with the head in one part padded to a power of two (128 lanes: the kernel before)."""
    import triton

    from mmserve.models.attention.triton_backend import TritonBackend
    from mmserve.models.attention.varlen_kernel import varlen_attention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    backend = TritonBackend(device)
    q, k, v = (torch.randn(frame_rows, TOWER_HEADS, TOWER_HEAD_DIM, device=device).to(dtype) for _ in range(3))
    windows = list(range(0, frame_rows, WINDOW_ROWS)) + [frame_rows]
    padded = (triton.next_power_of_2(TOWER_HEAD_DIM), 0)
    print(f"prefill: {TOWER_HEADS} heads of {TOWER_HEAD_DIM}, {frame_rows} rows; matmul rate {rate / 1e12:.0f} TFLOP/s")
    print(f"{'segments':>20} {'ms':>8} {'TFLOP/s':>8} {'ratio':>6} {f'{padded[0]} lanes ms':>13} {'ratio':>6} "
          f"{'speed-up':>8}")
    for name, cu in (("one (full)", [0, frame_rows]), (f"{len(windows) - 1} windows", windows)):
        segments = backend.segments(cu, device)
        flops = sum(4 * (hi - lo) ** 2 * TOWER_HEADS * TOWER_HEAD_DIM for lo, hi in zip(cu[:-1], cu[1:]))
        scale = TOWER_HEAD_DIM**-0.5
        seconds = replay_timed([functools.partial(segments.attend, q, k, v, scale)], device, reps)
        one_part = replay_timed([functools.partial(varlen_attention, q, k, v, segments.cu, segments.max_len, scale,
                                                   padded)], device, reps)
        print(f"{name:>20} {seconds * 1e3:>8.3f} {flops / seconds / 1e12:>8.1f} {flops / seconds / rate:>6.2f} "
              f"{one_part * 1e3:>13.3f} {flops / one_part / rate:>6.2f} {one_part / seconds:>8.2f}")


def parse_args(doc: str, reps: int) -> argparse.Namespace:
    """A kernel benchmark's flags: `--smoke` (tiny sizes on CPU under Triton's interpreter, turned
    on here, before triton is imported) and `--reps`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under Triton's interpreter")
    parser.add_argument("--reps", type=int, default=reps)
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    return args


def main() -> None:
    args = parse_args(__doc__ or "", 50)
    if args.smoke:
        device, batches, context, frame_rows, reps = torch.device("cpu"), [1, 2], 256, 130, 1
    elif torch.cuda.is_available():
        device, batches, context, frame_rows, reps = torch.device("cuda"), [1, 8, 32, 64], 2048, FRAME_ROWS, args.reps
    else:
        print("no CUDA GPU here: nothing to measure (--smoke checks the script on CPU)")
        return
    bandwidth, rate = device_limits(device)
    decode_rows(device, batches, context, bandwidth, reps)
    prefill_rows(device, frame_rows, rate, reps)
    print("target: decode ratio >= 0.85 of the copy bandwidth; prefill ratio near the matmul rate")


if __name__ == "__main__":
    main()
