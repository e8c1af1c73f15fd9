"""Attention of a prefill chunk after cached tokens (`models/attention/torch_sdpa.py:
prefill_attention`, the torch backend): the cached keys unmasked and the chunk's own keys
causally, merged by log-sum-exp, against one attention over all keys under a causal mask
(`masked_prefill_attention`, what `paged_attention` did for every such chunk before: the baseline,
its mask built outside the clock as a step builds it once for every layer). "new" is what
`paged_attention` does now: the chunk's `AttentionMetadata` decides between the two. Per layer,
on CPU, median of `--repeats` calls each, interleaved.

Shapes (new tokens after cached tokens; query heads / key-value heads x head dim):
- the built-in LLaVA's turn 6 of `warm_path.py`'s agent loop (182 after 720; 8/4 x 32),
- the built-in Qwen3-VL's (about 250 after 1,200; 4/2 x 32),
- a 7B-class layer (Qwen2.5-VL-7B: 28/4 x 128): a 512-token chunk after 4,096 cached,
- chunked prefill's second chunk of a long prompt (2,048 after 2,048; 8/4 x 32),
- a small chunk after a short context (16 after 300), below the split's thresholds: the same call
  both ways (its ratio is the machine's noise).
Target: new / old <= 1.0 for every split shape (never slower), well below it where the chunk or its
cached context is long.

Run: `python benchmarks/prefill_attention.py [--repeats N]`.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import mmserve  # noqa: F401  (first: sets OMP_WAIT_POLICY before torch loads, as the engine's processes have it)
import torch

from mmserve.models.attention.torch_sdpa import AttentionMetadata, masked_prefill_attention, prefill_attention

SHAPES = [  # (label, new, cached, heads, kv heads, head dim)
    ("tiny-llava agent turn 6", 182, 720, 8, 4, 32),
    ("tiny-qwen3-vl agent turn 6", 250, 1200, 4, 2, 32),
    ("7B-class layer, 512 after 4096", 512, 4096, 28, 4, 128),
    ("chunked prefill, 2nd chunk of 2048", 2048, 2048, 8, 4, 32),
    ("small chunk, 16 after 300", 16, 300, 8, 4, 32),
]


def interleaved_medians(calls: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, float]:
    """Median ms of each call, taking turns (the first to go alternating); 3 warm-up rounds."""
    took: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(repeats + 3):
        for name in list(calls)[:: 1 if i % 2 else -1]:
            t = time.perf_counter()
            calls[name]()
            if i >= 3:  # the first calls warm the allocator and the kernels' thread pool
                took[name].append((time.perf_counter() - t) * 1e3)
    return {name: statistics.median(t) for name, t in took.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    worst = 0.0
    for label, n, start, heads, kv_heads, dh in SHAPES:
        chunk = (torch.randn(n, heads, dh, generator=g), torch.randn(n, kv_heads, dh, generator=g),
                 torch.randn(n, kv_heads, dh, generator=g), torch.randn(start, kv_heads, dh, generator=g),
                 torch.randn(start, kv_heads, dh, generator=g))  # q, k, v, cached k, cached v
        scale = dh**-0.5
        causal = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]  # [n, start + n]
        span = AttentionMetadata.build([n], [start + n], [list(range(-(-(start + n) // 16)))], 16).prefills[0]
        calls = {"old": functools.partial(masked_prefill_attention, *chunk, causal, scale),
                 "new": (functools.partial(prefill_attention, *chunk, scale) if span.mask is None
                         else functools.partial(masked_prefill_attention, *chunk, span.mask, scale))}
        error = (calls["new"]() - calls["old"]()).abs().max().item()
        ms = interleaved_medians(calls, args.repeats)
        ratio = ms["new"] / ms["old"]
        if span.mask is None:  # split
            worst = max(worst, ratio)
        target = "target <= 1.0" if span.mask is None else "the same call both ways: noise"
        print(f"{label:36s} old {ms['old']:8.3f} ms  new {ms['new']:8.3f} ms  new/old {ratio:.3f} ({target})"
              f"  max |diff| {error:.1e}")
    print(f"worst new/old where the chunk is split {worst:.3f} (target <= 1.0)")


if __name__ == "__main__":
    main()
