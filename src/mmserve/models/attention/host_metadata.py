"""A step's attention metadata on the host, made by numpy from the scheduler's lists.

`torch.tensor` of a list of lists costs ~40 ns an element: a decode batch of 64 at 2k tokens
carries 8,000 block ids, and turning them into the padded table took 0.3 ms of every step's host
work on the GPU path (graph inputs and the triton backend's metadata alike). A row's list copied
into a preallocated array takes a third of that; the slots then come from array arithmetic with
no tensor op per request. Every value equals the list arithmetic it replaces (integers only).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch


def padded_tables(tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """[B, width] `dtype`: row b is `tables[b]` followed by zeros up to the widest row."""
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), width), dtype=_NUMPY[dtype])
    for row, table in zip(out, tables):
        row[:len(table)] = table
    return torch.from_numpy(out)


def token_slots(tables: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                block_size: int) -> torch.Tensor:
    """[T] int64: the cache slot of each scheduled token, request by request (`query_lens[b]` new
    tokens ending at position `seq_lens[b] - 1`), from the padded `tables` ([B, width])."""
    q = np.asarray(query_lens, dtype=np.int64)
    ends = np.asarray(seq_lens, dtype=np.int64)
    request = np.repeat(np.arange(len(q)), q)  # [T]
    first_token = np.cumsum(q) - q  # each request's first row in the step
    positions = np.arange(int(q.sum()), dtype=np.int64) - first_token[request] + (ends - q)[request]
    blocks: npt.NDArray[np.int64] = tables.numpy()[request, positions // block_size].astype(np.int64)
    return torch.from_numpy(blocks * block_size + positions % block_size)


_NUMPY = {torch.int32: np.int32, torch.int64: np.int64}
