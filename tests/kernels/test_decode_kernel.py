"""Our split-KV decode kernel against a float64 reference (interpreted on CPU): batch 1 at long
contexts, head sizes 64/80/128, GQA 1 to 8, block sizes 16 and 32, contexts ending inside a block
and on its edge, tables wider than any context (a captured graph's), and both loop headers."""

from __future__ import annotations

import pytest
import torch

from helpers.triton_device import DEVICE

pytest.importorskip("triton")

from mmserve.models.attention.decode_kernel import (MAX_SPLITS, NOMINAL_SMS, decode_attention,  # noqa: E402
                                                    decode_splits)


def make_decode(contexts: list[int], heads: int, kv_heads: int, head_dim: int, block: int, dtype: torch.dtype,
                seed: int, width: int | None = None):
    """Random caches with each sequence's blocks scattered, tables `width` blocks wide (padded with
    block 0), and one query per sequence."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block) for c in contexts]
    width = width or max(need)
    num_blocks = sum(need) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(order[used:used + n] + [0] * (width - n))
        used += n
    shape = (num_blocks, block, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(len(contexts), heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(contexts, dtype=torch.int32)


def reference(q, k_cache, v_cache, tables, seq_lens, scale) -> torch.Tensor:
    """Each query over its first seq_len keys, gathered through its table, in float64."""
    B, H, Dh = q.shape
    group = H // k_cache.shape[2]
    out = torch.empty(B, H, Dh, dtype=torch.float64)
    for b in range(B):
        n = int(seq_lens[b])
        k = k_cache[tables[b]].reshape(-1, k_cache.shape[2], Dh)[:n].double().repeat_interleave(group, 1)  # [n, H, Dh]
        v = v_cache[tables[b]].reshape(-1, v_cache.shape[2], Dh)[:n].double().repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


def check(contexts, heads, kv_heads, head_dim, block, dtype=torch.float32, seed=0, width=None, tol=2e-5):
    q, k_cache, v_cache, tables, seq_lens = make_decode(contexts, heads, kv_heads, head_dim, block, dtype, seed, width)
    scale = head_dim**-0.5
    got = decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), seq_lens.to(DEVICE),
                           tables.to(DEVICE), scale)
    want = reference(q, k_cache, v_cache, tables, seq_lens, scale)
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim,context", [(64, 2048), (80, 2100), (128, 2063)])
def test_batch_one_at_a_long_context(loops, head_dim, context):
    """Batch 1 splits its context 16 ways; 2,048 keys end on a block's edge, the others inside one."""
    assert decode_splits(1, 1, context, NOMINAL_SMS) == MAX_SPLITS
    check([context], 2, 1, head_dim, 16, seed=head_dim)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2), (8, 1), (7, 1)])
@pytest.mark.parametrize("block", [16, 32])
def test_gqa_groups_and_block_sizes(heads, kv_heads, block):
    """Groups of 1 to 8 query heads (7: not a power of two) per KV head, contexts of one key, on
    a block's edge, inside a block and across many."""
    check([1, block, 3 * block + 5, 700], heads, kv_heads, 64, block, seed=heads * block + kv_heads)


def test_a_wide_table_leaves_splits_idle(loops):
    """A captured graph's tables are as wide as the longest context it admits: the splits come from
    that width, so short contexts use few of them and the rest return at once."""
    assert decode_splits(3, 2, 128 * 16, NOMINAL_SMS) == MAX_SPLITS
    check([5, 17, 300], 4, 2, 80, 16, seed=3, width=128)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else []))
def test_half_precision_within_rounding(dtype):
    """bfloat16 on a GPU only: Triton's interpreter computes a bfloat16 `tl.dot` wrongly."""
    check([1500, 33], 8, 2, 128, 16, dtype=dtype, seed=9, tol=2e-2)


def test_the_split_count_follows_the_grid_not_the_lengths():
    assert decode_splits(1, 4, 2048, 132) == 16  # 4 programs -> 64: as many as the cap allows
    assert decode_splits(32, 4, 2048, 132) == 4  # 128 programs -> 512
    assert decode_splits(64, 4, 2048, 132) == 2
    assert decode_splits(128, 4, 2048, 132) == 1  # enough programs: one pass, no reduce
    assert decode_splits(1, 4, 300, 132) == 2  # a short widest context: splits of >= 128 keys
    assert decode_splits(1, 4, 100, 132) == 1


def test_one_split_writes_the_output_itself():
    """Large batches run one split per (sequence, KV head) and skip the reduce."""
    assert decode_splits(66, 4, 256, NOMINAL_SMS) == 1
    check([1 + 3 * i for i in range(66)], 4, 4, 16, 16, seed=4)


@pytest.mark.parametrize("tile_n,warps,stages", [(32, 4, 3), (128, 4, 3), (64, 2, 3), (64, 8, 2), (64, 4, 4)])
@pytest.mark.parametrize("splits", [None, 1, 32])
def test_every_launch_the_sweep_tries_computes_the_same_attention(monkeypatch, tile_n, warps, stages, splits):
    """`benchmarks/attention_sweep.py` times the launch's neighbours (keys a tile, warps, stages,
    split counts) on a GPU: each one gives the attention the current launch gives."""
    from mmserve.models.attention import decode_kernel

    launch = decode_kernel.DecodeLaunch(tile_n, warps, stages)
    monkeypatch.setattr(decode_kernel, "decode_launch", lambda dtype, cache_itemsize: launch)
    q, k_cache, v_cache, tables, seq_lens = make_decode([1, 300, 700], 7, 1, 80, 16, torch.float32, seed=tile_n)
    scale = 80**-0.5
    got = decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), seq_lens.to(DEVICE),
                           tables.to(DEVICE), scale, splits=splits)
    torch.testing.assert_close(got.cpu().double(), reference(q, k_cache, v_cache, tables, seq_lens, scale),
                               atol=2e-5, rtol=2e-5)
