"""Attention of a prefill chunk after cached tokens (`models/layers.py: prefill_attention`): the
cached keys unmasked and the chunk's own keys causally, merged by log-sum-exp, against one
attention over all keys under a causal mask (what `paged_attention` did before; the baseline,
written out here). Per layer, on CPU, median of `--repeats` calls each, interleaved.

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
import statistics
import time

import mmserve  # noqa: F401  (first: sets OMP_WAIT_POLICY before torch loads, as the engine's processes have it)
import torch
import torch.nn.functional as F

from mmserve.models.layers import SPLIT_FROM_CACHED, SPLIT_FROM_NEW, prefill_attention

SHAPES = [  # (label, new, cached, heads, kv heads, head dim)
    ("tiny-llava agent turn 6", 182, 720, 8, 4, 32),
    ("tiny-qwen3-vl agent turn 6", 250, 1200, 4, 2, 32),
    ("7B-class layer, 512 after 4096", 512, 4096, 28, 4, 128),
    ("chunked prefill, 2nd chunk of 2048", 2048, 2048, 8, 4, 32),
    ("small chunk, 16 after 300", 16, 300, 8, 4, 32),
]


def masked(q, k, v, cached_k, cached_v, scale):
    """One attention over all keys under a causal mask from `start`: the baseline."""
    n, start = q.shape[0], cached_k.shape[0]
    visible = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    keys, values = torch.cat([cached_k, k]).transpose(0, 1)[None], torch.cat([cached_v, v]).transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=visible, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    worst = 0.0
    for label, n, start, heads, kv_heads, dh in SHAPES:
        q = torch.randn(n, heads, dh, generator=g)
        k, v = torch.randn(n, kv_heads, dh, generator=g), torch.randn(n, kv_heads, dh, generator=g)
        cached_k = torch.randn(start, kv_heads, dh, generator=g)
        cached_v = torch.randn(start, kv_heads, dh, generator=g)
        scale = dh**-0.5
        error = prefill_attention(q, k, v, cached_k, cached_v, scale) - masked(q, k, v, cached_k, cached_v, scale)
        took: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(args.repeats + 3):
            for name, fn in (("old", masked), ("new", prefill_attention))[:: 1 if i % 2 else -1]:
                t = time.perf_counter()
                fn(q, k, v, cached_k, cached_v, scale)
                if i >= 3:  # the first calls warm the allocator and the kernels' thread pool
                    took[name].append((time.perf_counter() - t) * 1e3)
        old, new = statistics.median(took["old"]), statistics.median(took["new"])
        split = start >= SPLIT_FROM_CACHED or n >= SPLIT_FROM_NEW
        if split:
            worst = max(worst, new / old)
        target = "target <= 1.0" if split else "the same call both ways: noise"
        print(f"{label:36s} old {old:8.3f} ms  new {new:8.3f} ms  new/old {new / old:.3f} ({target})"
              f"  max |diff| {error.abs().max().item():.1e}")
    print(f"worst new/old where the chunk is split {worst:.3f} (target <= 1.0)")


if __name__ == "__main__":
    main()
