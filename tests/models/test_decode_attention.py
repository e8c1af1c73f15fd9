"""Decode attention reading K/V where they lie (`models/attention/cpu_decode.py`) against attention
written out by hand: block tables made of long runs (read in place, one or several per request),
short runs and scattered blocks (gathered), contexts ending inside a block or on its edge."""

from __future__ import annotations

import math

import pytest
import torch

from mmserve.models.attention.cpu_decode import MIN_RUN_BLOCKS, DecodePlan, RunSplits, decode_attention
from mmserve.models.attention.torch_sdpa import AttentionMetadata, paged_attention

BLOCK = 4


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q: [H, Dh]; keys, values: [L, Hkv, Dh] -> [H, Dh] in float64."""
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)  # [H, L, Dh]
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = (k @ q.double()[:, :, None])[..., 0] / math.sqrt(q.shape[1])  # [H, L]
    return (scores.softmax(-1)[:, None, :] @ v)[:, 0]


def tables_of(shapes: list[list[int]], num_blocks: int, g: torch.Generator) -> list[list[int]]:
    """Each request's table: runs of the given lengths of consecutive ids, placed apart at random."""
    free = torch.randperm(num_blocks // 16, generator=g).tolist()  # 16-block slots, one run each
    tables = []
    for runs in shapes:
        table = []
        for length in runs:
            slot = free.pop()
            table += list(range(slot * 16, slot * 16 + length))
        tables.append(table)
    return tables


@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (4, 4), (6, 1)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_decodes_over_runs_and_scattered_blocks_equal_attention_written_out(heads, kv_heads, dtype, tol):
    g = torch.Generator().manual_seed(heads + kv_heads)
    Dh, long = 16, MIN_RUN_BLOCKS
    # per request: run lengths in blocks, and how many slots of its last block hold keys
    shapes = [([1], 1), ([long], 3), ([long, 1, 1], 4), ([long + 3, 2, long, 1], 2), ([2, 1], 1),
              ([long * 2], 4), ([1, long], 1), ([3, long + 1, 1], 3)]
    num_blocks = 16 * 32
    tables = tables_of([runs for runs, _ in shapes], num_blocks, g)
    seq_lens = [(len(t) - 1) * BLOCK + fill for t, (_, fill) in zip(tables, shapes)]
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, Dh, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, Dh, generator=g).to(dtype)
    q = torch.randn(len(shapes) + 2, heads, Dh, generator=g).to(dtype)  # two rows that do not decode
    rows = [i + 1 for i in range(len(shapes))]
    plan = DecodePlan.build(rows, seq_lens, [t + [0] * 3 for t in tables], BLOCK)  # tables may run past the keys
    assert len(plan.rounds) == 2  # one request has two long runs

    out = decode_attention(q, k_cache, v_cache, plan, 1 / math.sqrt(Dh))

    for b, (table, n) in enumerate(zip(tables, seq_lens)):
        keys = k_cache[table].reshape(-1, kv_heads, Dh)[:n]
        values = v_cache[table].reshape(-1, kv_heads, Dh)[:n]
        torch.testing.assert_close(out[b].double(), reference(q[rows[b]], keys, values), atol=tol, rtol=tol)


def test_a_decode_step_in_place_equals_the_padded_one():
    """`paged_attention` through the plan (CPU) and through the padded copies (other devices)."""
    g = torch.Generator().manual_seed(1)
    tables = tables_of([[MIN_RUN_BLOCKS + 2, 1], [1, 1, 1], [MIN_RUN_BLOCKS * 3]], 16 * 8, g)
    seq_lens = [len(t) * BLOCK - 1 for t in tables]
    k_cache, v_cache = torch.randn(16 * 8, BLOCK, 2, 8, generator=g), torch.randn(16 * 8, BLOCK, 2, 8, generator=g)
    q, k, v = torch.randn(3, 4, 8, generator=g), torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    outs = []
    for in_place in (True, False):
        meta = AttentionMetadata.build([1, 1, 1], seq_lens, tables, BLOCK, in_place)
        assert (meta.decode_plan is not None) == in_place
        outs.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 8**-0.5))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_run_splits_kept_between_steps_equal_splits_made_afresh():
    """Tables growing a block at a time (a run continued, a run started, a long run closed), one
    table dropped for a step and one replaced by a new list: the kept splits equal fresh ones."""
    g = torch.Generator().manual_seed(2)
    kept = RunSplits()
    tables = [[], list(range(40, 40 + MIN_RUN_BLOCKS - 1)), [7]]
    for step in range(30):
        for table in tables:
            choice = int(torch.randint(0, 3, (1,), generator=g))
            if choice == 0 and table:  # continue the last run
                table.append(table[-1] + 1)
            elif choice == 1:  # a block from elsewhere
                table.append(int(torch.randint(100, 10_000, (1,), generator=g)))
        if step == 10:
            tables[2] = list(tables[2])  # the same ids in a new list (a resumed request's)
        present = tables if step % 7 else tables[:2]
        counts = [max(len(t) - 1, 0) for t in present]
        assert kept.split(present, counts) == RunSplits().split(present, counts)
        for table, n in zip(present, counts):
            long, short = RunSplits().split([table], [n])[0]
            assert sorted(short + [b for first, length in long for b in range(first, first + length)]) \
                == sorted(table[:n])
            assert all(length >= MIN_RUN_BLOCKS for _, length in long)
