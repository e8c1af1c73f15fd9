"""The attention kernels' shared parts: one key tile folded into a running softmax, and how a
kernel loops over its key tiles on a GPU and under the interpreter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Kernels loop over key tiles with `range(lo, hi, step)` when compiled (Triton software-pipelines
# a `for` loop: `num_stages` tiles in flight) and with `while` under the interpreter (Triton 3.6's
# cannot take a `range` bound that a program loaded: it converts it with `int()`, which NumPy 2.4
# refuses for a one-element array). Triton 3.9's interpreter runs both; tests set this to True
# there to prove the `range` headers the GPU compiles.
RANGE_LOOPS_UNDER_INTERPRETER = False


def range_loops(device: torch.device) -> bool:
    """Whether the kernels launched on `device` loop with `range` (see above)."""
    return device.type != "cpu" or RANGE_LOOPS_UNDER_INTERPRETER


@triton.jit
def attend_tile(q, k, v, seen, m_i, l_i, acc, scale):
    """Fold one key/value tile into the running state (flash attention's online softmax).

    q: [M, D]; k, v: [N, D]; seen: [M, N] bool (or [1, N]), True where the row's query sees the
    key; m_i (running max of scores), l_i (running sum of exp(score - m_i)): [M] float32;
    acc (running sum of probabilities x values): [M, D] float32. Returns the new (m_i, l_i, acc).
    A row must see some key of its first tile, or its max stays -inf and the exps are NaN. k and v
    may be of another dtype than q's (a `--kv-cache-dtype` cache): they are cast to q's first."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [M, N]
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def load_paged_kv(k_cache_ptr, v_cache_ptr, table_ptr, start, end, kv_head, d, d_ok,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """One tile of a sequence's cached keys and values: positions key = start .. start + TILE_N,
    each found through the sequence's block table (`table_ptr`); those >= end load nothing (0).
    Returns (key [TILE_N], key_ok [TILE_N], k [TILE_N, BLOCK_D], v [TILE_N, BLOCK_D])."""
    key = start + tl.arange(0, TILE_N)
    key_ok = key < end
    block = tl.load(table_ptr + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    slot = (key % BLOCK_SIZE)[:, None]
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + block[:, None] * stride_kb + slot * stride_ks + kv_head * stride_kh + d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot * stride_vs + kv_head * stride_vh + d[None, :],
                mask=kv_mask, other=0.0)
    return key, key_ok, k, v
