"""Decode attention by our C kernel (`models/attention/cpu_kernels.py`, `csrc/paged_decode.c`)
against attention written out by hand: block tables of scattered blocks, contexts ending inside a
block or on its edge, grouped query heads (pairs and a third), contexts split across threads,
float32, bfloat16 and float16 caches, float32 queries over the 16-bit ones (every float16 value
widened exactly); and the loader (built once per machine into
its cache folder, off by `MMSERVE_CPU_KERNELS=0`)."""

from __future__ import annotations

import math

import pytest
import torch

from mmserve.models.attention import cpu_kernels
from mmserve.models.attention.torch_sdpa import AttentionMetadata, kernel_splits, paged_attention

needs_kernel = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q: [H, Dh]; keys, values: [L, Hkv, Dh] -> [H, Dh] in float64."""
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)  # [H, L, Dh]
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = (k @ q.double()[:, :, None])[..., 0] / math.sqrt(q.shape[1])  # [H, L]
    return (scores.softmax(-1)[:, None, :] @ v)[:, 0]


def scattered_tables(seq_lens: list[int], block: int, num_blocks: int, g: torch.Generator) -> list[list[int]]:
    """Each request's table: distinct blocks in random order (a cache after hours of traffic)."""
    free = torch.randperm(num_blocks, generator=g).tolist()
    return [[free.pop() for _ in range(-(-n // block))] for n in seq_lens]


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,block", [(8, 4, 16, 4), (4, 4, 32, 16), (6, 1, 24, 8),
                                                           (16, 2, 128, 16), (2, 2, 80, 32), (12, 4, 80, 16)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float16, torch.float16), (torch.float32, torch.float16),
                                                (torch.float32, torch.bfloat16)])
def test_the_kernel_equals_attention_written_out(heads, kv_heads, head_dim, block, splits, dtype, cache_dtype):
    g = torch.Generator().manual_seed(heads * 31 + head_dim + block)
    seq_lens = [1, block, block + 1, 7 * block, 40 * block - 3, 3]  # in the first block, on edges, past them
    num_blocks = sum(-(-n // block) for n in seq_lens) + 5
    tables = scattered_tables(seq_lens, block, num_blocks, g)
    width = max(len(t) for t in tables) + 2  # tables padded past their keys
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(cache_dtype)  # the reference
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(cache_dtype)  # reads these
    q = torch.randn(len(seq_lens) + 2, heads, head_dim, generator=g).to(dtype)  # two rows that do not decode
    rows = torch.tensor([i + 1 for i in range(len(seq_lens))])
    out = torch.full_like(q, float("nan"))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])

    assert cpu_kernels.paged_decode(q, k_cache, v_cache, padded, torch.tensor(seq_lens), rows, out,
                                    1 / math.sqrt(head_dim), splits)

    for b, (table, n) in enumerate(zip(tables, seq_lens)):
        keys = k_cache[table].reshape(-1, kv_heads, head_dim)[:n]
        values = v_cache[table].reshape(-1, kv_heads, head_dim)[:n]
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]  # the output's rounding
        torch.testing.assert_close(out[rows[b]].double(), reference(q[rows[b]], keys, values), atol=tol, rtol=tol)
    assert out[0].isnan().all() and out[-1].isnan().all()  # rows that do not decode are left alone


def finite_16_bit_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit dtype, in bit order (zeros, subnormals, both signs)."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return values[values.isfinite()]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pairs", ["same", "neighbours", "random"])
def test_16_bit_values_are_widened_and_rounded_exactly(dtype, pairs):
    """Two keys of equal score: the output is the mean of their value rows, summed in float32
    and rounded to the nearest 16-bit value (ties to even) as torch rounds it. Every finite value
    widened (the same value twice), every tie (a value and the next), and random pairs."""
    values, head_dim = finite_16_bit_values(dtype), 64
    values = values[: values.numel() // head_dim * head_dim]
    if pairs == "same":
        other = values
    elif pairs == "neighbours":  # the next value up in magnitude: the mean is a tie
        other = (values.view(torch.int16) + 1).view(dtype)
    else:
        other = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(0))]
    keep = other.isfinite()
    values, other = values[keep][: keep.sum() // head_dim * head_dim], other[keep][: keep.sum() // head_dim * head_dim]
    rows = values.numel() // head_dim
    v_cache = torch.stack([values.view(rows, head_dim), other.view(rows, head_dim)], 1)[:, :, None]  # [rows, 2, 1, Dh]
    k_cache, q = torch.zeros_like(v_cache), torch.zeros(rows, 1, head_dim, dtype=dtype)
    out = torch.zeros_like(q)
    assert cpu_kernels.paged_decode(q, k_cache, v_cache, torch.arange(rows)[:, None], torch.full((rows,), 2),
                                    torch.arange(rows), out, 1.0, 1)
    expected = ((v_cache[:, 0].float() + v_cache[:, 1].float()) / 2).to(dtype)
    assert torch.equal(out, expected)  # as values: the sums start at +0, so -0 comes out +0


@needs_kernel
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float16, torch.float16), (torch.float32, torch.float16),
                                                (torch.float32, torch.bfloat16)])
def test_a_step_by_the_kernel_equals_the_padded_one(dtype, cache_dtype):
    """`paged_attention` with decodes and prefill chunks in one step: the kernel (CPU) and the
    padded copies (other devices) agree, q of the model's dtype and the cache of the model's or
    a 16-bit one under float32 (`--kv-cache-dtype`)."""
    g = torch.Generator().manual_seed(1)
    block, seq_lens, query_lens = 4, [13, 9, 30, 5], [1, 3, 1, 1]
    tables = scattered_tables(seq_lens, block, 40, g)
    T, tol = sum(query_lens), 1e-5 if dtype == torch.float32 else 2e-2
    k_cache, v_cache = (torch.randn(40, block, 2, 8, generator=g).to(cache_dtype) for _ in range(2))
    q, k, v = (torch.randn(T, h, 8, generator=g).to(dtype) for h in (4, 2, 2))
    outs = []
    for in_place in (True, False):
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, block, in_place)
        assert (meta.kernel_splits > 0) == in_place
        outs.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 8**-0.5))
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)


def test_splits_give_every_thread_work_and_keep_parts_of_four_blocks():
    threads = torch.get_num_threads()
    assert kernel_splits(2 * threads, 1000) == 1
    assert kernel_splits(1, 1000) == 2 * threads
    assert kernel_splits(1, 5) == 1
