"""A step's host metadata by numpy (models/attention/host_metadata.py) equals the list arithmetic
it stands for: padded block tables, each token's slot, and the two callers' tensors (the triton
backend's metadata, a CUDA graph's decode inputs) in their dtypes."""

from __future__ import annotations

import random

import pytest
import torch

from mmserve.models.attention.host_metadata import padded_tables, token_slots
from mmserve.models.attention.triton_backend import TritonBackend
from mmserve.worker.step_inputs import _graph_inputs


def ragged_step(seed: int, batch: int, block_size: int, decode_only: bool):
    """(query_lens, seq_lens, tables): each request's table just holds its tokens."""
    rng = random.Random(seed)
    query_lens, seq_lens, tables = [], [], []
    for _ in range(batch):
        q = 1 if decode_only or rng.random() < 0.6 else rng.randint(2, 70)
        s = q + rng.randint(0, 300)
        query_lens.append(q)
        seq_lens.append(s)
        tables.append(rng.sample(range(5000), -(-s // block_size)))
    return query_lens, seq_lens, tables


def slots_by_lists(query_lens, seq_lens, tables, block_size) -> list[int]:
    return [tables[b][p // block_size] * block_size + p % block_size
            for b, (q, s) in enumerate(zip(query_lens, seq_lens)) for p in range(s - q, s)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [16, 32])
def test_tables_and_slots_equal_the_list_arithmetic(seed, block_size):
    query_lens, seq_lens, tables = ragged_step(seed, batch=1 + seed * 9, block_size=block_size, decode_only=False)
    width = max(len(t) for t in tables)
    for dtype in (torch.int32, torch.int64):
        padded = padded_tables(tables, dtype)
        assert padded.dtype == dtype
        assert padded.tolist() == [t + [0] * (width - len(t)) for t in tables]
    slots = token_slots(padded_tables(tables, torch.int32), query_lens, seq_lens, block_size)
    assert slots.dtype == torch.int64 and slots.tolist() == slots_by_lists(query_lens, seq_lens, tables, block_size)


def test_no_rows():
    assert padded_tables([], torch.int64).shape == (0, 0)
    assert token_slots(padded_tables([], torch.int64), [], [], 16).shape == (0,)


@pytest.mark.parametrize("seed", range(3))
def test_the_triton_backends_metadata(seed):
    query_lens, seq_lens, tables = ragged_step(seed, batch=12, block_size=16, decode_only=False)
    meta = TritonBackend(torch.device("cpu")).build_metadata(query_lens, seq_lens, tables, 16)
    width = max(len(t) for t in tables)
    assert meta.block_tables.dtype == torch.int32
    assert meta.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
    assert meta.slot_mapping.tolist() == slots_by_lists(query_lens, seq_lens, tables, 16)
    assert meta.query_start.dtype == torch.int32
    assert meta.query_start.tolist() == [sum(query_lens[:b]) for b in range(len(query_lens) + 1)]
    assert meta.seq_lens.tolist() == seq_lens and meta.max_query_len == max(query_lens)


def test_a_decode_graphs_inputs():
    _, seq_lens, tables = ragged_step(7, batch=64, block_size=16, decode_only=True)
    inputs = _graph_inputs(seq_lens, tables, 16)
    assert inputs.block_tables.dtype == inputs.slot_mapping.dtype == torch.int64
    assert inputs.slot_mapping.tolist() == [t[(s - 1) // 16] * 16 + (s - 1) % 16 for s, t in zip(seq_lens, tables)]
    assert inputs.block_tables.tolist() == padded_tables(tables, torch.int64).tolist()
    assert inputs.seq_lens.tolist() == seq_lens
