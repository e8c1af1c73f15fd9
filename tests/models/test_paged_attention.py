"""`paged_attention` against attention written out by hand (float64 scores, an explicit causal
mask over each request's whole context): a step mixing decodes, prefills from the start and
prefill chunks after cached tokens, with scattered block tables and grouped key/value heads."""

from __future__ import annotations

import math

import pytest
import torch

from mmserve.models.attention.torch_sdpa import (SPLIT_FROM_CACHED, SPLIT_FROM_NEW, AttentionMetadata,
                                              paged_attention, prefill_attention)

BLOCK = 4


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """q: [n, H, Dh] at positions start .. start + n - 1; keys, values: [start + n, Hkv, Dh]."""
    n, H, Dh = q.shape
    group = H // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)  # [H, ctx, Dh]
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(Dh)  # [H, n, ctx]
    visible = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [n, H, Dh]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_a_mixed_step_equals_attention_written_out(heads, kv_heads, dtype, tol):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    Dh = 16
    # (cached tokens, new tokens) per request: decodes, whole prefills, chunks after a cache hit
    # (one shorter than a block, one after a partial block, one far longer than its cache), and
    # chunks large enough for the split into cached and own keys (by either side of it)
    requests = [(9, 1), (0, 7), (13, 5), (3, 2), (0, 1), (40, 1), (5, 33), (16, 16),
                (SPLIT_FROM_CACHED + 3, 20), (40, SPLIT_FROM_NEW + 2)]
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in requests) + 8
    order = torch.randperm(num_blocks, generator=g).tolist()  # tables point anywhere in the cache
    tables, used = [], 0
    for cached, new in requests:
        need = -(-(cached + new) // BLOCK)
        tables.append(order[used:used + need])
        used += need
    k_cache = torch.zeros(num_blocks, BLOCK, kv_heads, Dh, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    contexts = []  # every request's whole K/V, the cached part written into its blocks first
    for (cached, new), table in zip(requests, tables):
        keys = torch.randn(cached + new, kv_heads, Dh, generator=g).to(dtype)
        values = torch.randn(cached + new, kv_heads, Dh, generator=g).to(dtype)
        for pos in range(cached):
            k_cache[table[pos // BLOCK], pos % BLOCK] = keys[pos]
            v_cache[table[pos // BLOCK], pos % BLOCK] = values[pos]
        contexts.append((keys, values))
    q = torch.randn(sum(new for _, new in requests), heads, Dh, generator=g).to(dtype)
    k = torch.cat([keys[cached:] for (cached, _), (keys, _) in zip(requests, contexts)])
    v = torch.cat([values[cached:] for (cached, _), (_, values) in zip(requests, contexts)])
    meta = AttentionMetadata.build([new for _, new in requests], [c + n for c, n in requests], tables, BLOCK)

    out = paged_attention(q, k, v, k_cache, v_cache, meta, 1 / math.sqrt(Dh))

    lo = 0
    for (cached, new), (keys, values) in zip(requests, contexts):
        want = reference(q[lo:lo + new], keys, values, cached)
        torch.testing.assert_close(out[lo:lo + new].double(), want, atol=tol, rtol=tol)
        lo += new
    for (cached, new), (keys, values), table in zip(requests, contexts, tables):  # this step's K/V is cached now
        for pos in range(cached, cached + new):
            assert torch.equal(k_cache[table[pos // BLOCK], pos % BLOCK], keys[pos])
            assert torch.equal(v_cache[table[pos // BLOCK], pos % BLOCK], values[pos])


@pytest.mark.parametrize("start", [10, SPLIT_FROM_CACHED])
def test_a_query_whose_cached_keys_dominate_and_one_whose_own_keys_do(start):
    """The merge weighs each part by its softmax mass: with the cached keys far more similar to the
    queries (or far less), the result follows them (or the chunk's own keys) without overflow."""
    g = torch.Generator().manual_seed(3)
    n, H, Dh = 6, 2, 8
    q = torch.randn(n, H, Dh, generator=g) * 4
    for cached_scale, own_scale in ((30.0, 0.01), (0.01, 30.0)):
        keys = torch.cat([q[:1, :].repeat(start, 1, 1) * cached_scale / 4, torch.randn(n, H, Dh, generator=g)])
        keys[start:] = q * own_scale / 4
        values = torch.randn(start + n, H, Dh, generator=g)
        out = prefill_attention(q, keys[start:], values[start:], keys[:start], values[:start], 1 / math.sqrt(Dh))
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), reference(q, keys, values, start), atol=1e-5, rtol=1e-5)
