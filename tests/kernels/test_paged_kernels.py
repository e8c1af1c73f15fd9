"""Our paged-attention and KV-cache-write kernels against the torch backend (interpreted on CPU):
mixed steps of decodes, whole prefills and chunks after 1 or many cached blocks, over scattered
block tables, for several block sizes, GQA ratios and head sizes (24, 64, 80, 128, a tiny 8)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.triton_device import DEVICE
from mmserve.models.attention.torch_sdpa import TORCH
from mmserve.worker.device import to_device

pytest.importorskip("triton")

from mmserve.models.attention.cache_write_kernel import write_kv_cache  # noqa: E402
from mmserve.models.attention.triton_backend import TritonBackend  # noqa: E402

# (cached tokens, new tokens) per request: decodes (one right at a block's end), a whole prefill,
# a chunk after one block, after a partial block, after many blocks
MIXED = [(9, 1), (0, 7), (16, 5), (3, 2), (0, 1), (40, 1), (37, 12)]


def make_step(requests: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block: int,
              dtype: torch.dtype, seed: int):
    """Random caches holding every request's cached K/V in scattered blocks, and the step's q, k, v."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block) for c, n in requests) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for cached, new in requests:
        need = -(-(cached + new) // block)
        tables.append(order[used:used + need])
        used += need
    shape = (num_blocks, block, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))  # stale values everywhere
    T = sum(n for _, n in requests)
    q = torch.randn(T, heads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(T, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v, k_cache, v_cache, tables


def run_both(requests, heads, kv_heads, head_dim, block, dtype=torch.float32, seed=0):
    q, k, v, k_cache, v_cache, tables = make_step(requests, heads, kv_heads, head_dim, block, dtype, seed)
    query_lens, seq_lens = [n for _, n in requests], [c + n for c, n in requests]
    scale = 1 / math.sqrt(head_dim)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = TORCH.build_metadata(query_lens, seq_lens, tables, block).attend(q, k, v, want_k, want_v, scale)
    got_k, got_v = k_cache.to(DEVICE), v_cache.to(DEVICE)
    meta = to_device(TritonBackend(DEVICE).build_metadata(query_lens, seq_lens, tables, block), DEVICE)
    got = meta.attend(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), got_k, got_v, scale)
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)
    return got.cpu(), want


@pytest.mark.parametrize("heads,kv_heads,head_dim,block", [
    (4, 4, 64, 16), (8, 2, 80, 16), (6, 1, 24, 4), (4, 2, 128, 8), (2, 2, 8, 4), (12, 4, 80, 32), (3, 1, 64, 16)])
def test_a_mixed_step_equals_the_torch_backend(heads, kv_heads, head_dim, block):
    got, want = run_both(MIXED, heads, kv_heads, head_dim, block, seed=heads * 100 + head_dim)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 80), (4, 4, 24), (16, 1, 64)])
def test_a_decode_batch_equals_the_torch_backend(heads, kv_heads, head_dim):
    requests = [(c, 1) for c in (0, 15, 16, 33, 70)]
    got, want = run_both(requests, heads, kv_heads, head_dim, 16, seed=head_dim)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_chunks_after_many_cached_blocks_equal_the_torch_backend(loops):
    """Long chunks: several query blocks per program grid row, each stopping at its own causal end
    (with both loop headers: `loops`)."""
    got, want = run_both([(64, 70), (5, 130), (128, 3)], 4, 2, 32, 16, seed=7)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


# Triton's interpreter computes a bfloat16 `tl.dot` wrongly (bfloat16 loads, stores and conversions
# are exact), so bfloat16 is checked on a GPU only
HALF = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_equals_the_torch_backend_within_rounding(dtype):
    got, want = run_both(MIXED, 8, 2, 64, 16, dtype, seed=3)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_a_decode_launch_reads_its_lengths_from_tensors():
    """A CUDA graph replays one launch with new values in the same tensors: growing every
    sequence by one token in place (no new Python ints) gives the longer contexts' attention."""
    requests = [(6, 1), (30, 1)]
    q, k, v, k_cache, v_cache, tables = make_step([(c + 1, 1) for c, _ in requests], 4, 2, 32, 8, torch.float32, 5)
    backend = TritonBackend(DEVICE)
    meta = to_device(backend.build_metadata([1, 1], [c + 1 for c, _ in requests], tables, 8), DEVICE)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    meta.attend(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, 0.2)
    grown = backend.build_metadata([1, 1], [c + 2 for c, _ in requests], tables, 8)
    meta.seq_lens.copy_(grown.seq_lens)
    meta.slot_mapping.copy_(grown.slot_mapping)
    got = meta.attend(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, 0.2)
    want_k, want_v = k_cache.cpu().clone(), v_cache.cpu().clone()
    want = TORCH.build_metadata([1, 1], [c + 2 for c, _ in requests], tables, 8).attend(q, k, v, want_k, want_v, 0.2)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


def test_the_cache_write_skips_padded_tokens():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(5, 3, 24, generator=g), torch.randn(5, 3, 24, generator=g)
    k_cache, v_cache = torch.zeros(4, 4, 3, 24), torch.zeros(4, 4, 3, 24)
    slots = torch.tensor([13, -1, 2, 7, -1])
    got_k, got_v = k_cache.to(DEVICE), v_cache.to(DEVICE)
    write_kv_cache(k.to(DEVICE), v.to(DEVICE), got_k, got_v, slots.to(DEVICE))
    real = slots >= 0
    k_cache.view(16, 3, 24)[slots[real]] = k[real]
    v_cache.view(16, 3, 24)[slots[real]] = v[real]
    assert torch.equal(got_k.cpu(), k_cache) and torch.equal(got_v.cpu(), v_cache)


@pytest.mark.parametrize("block_m,block_n,warps,stages", [(64, 64, 8, 3), (128, 32, 8, 3), (128, 128, 4, 2),
                                                          (32, 16, 4, 4)])
def test_every_tile_the_sweep_tries_computes_the_same_attention(monkeypatch, block_m, block_n, warps, stages):
    """`benchmarks/attention_sweep.py` times the tiles' neighbours on a GPU (`tuning.base_tiles`
    replaced): each one gives a mixed step's attention."""
    from mmserve.models.attention import tuning

    tiles = tuning.TileConfig(block_m, block_n, warps, stages)
    monkeypatch.setattr(tuning, "base_tiles", lambda head_dim, itemsize, arch=tuning.NOMINAL_ARCH: tiles)
    got, want = run_both(MIXED, 8, 2, 80, 16, seed=block_m + block_n)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
