"""Our Triton paged-attention kernel: decode and prefill chunks (after any number of cached
tokens) of many sequences in one launch, reading every length from tensors.

Imported only by the triton backend (it needs `triton`); under `TRITON_INTERPRET=1` it runs on
CPU tensors, which is how CI proves it against the torch backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.models.attention.decode_kernel import decode_attention
from mmserve.models.attention.online_softmax import attend_tile, load_paged_kv, range_loops
from mmserve.models.attention.tuning import device_arch, kv_stages, prefill_tiles

# Shapes (T = query tokens of the step, B = sequences, H = query heads, Hkv = key/value heads,
# G = H / Hkv, Dh = head dim, N = cache blocks, S = block size):
#   q, out: [T, H, Dh]; k_cache, v_cache: [N, S, Hkv, Dh] (already holding this step's K/V)
#   query_start: [B + 1] int32, sequence b's queries are rows query_start[b] .. query_start[b + 1]
#   seq_lens: [B] int32, tokens of context including the queries (the queries are its last ones)
#   block_tables: [B, max_blocks] int32, cache block of each S-token block of each sequence
# One program per (sequence, block of BLOCK_Q queries, KV head). Its BLOCK_M = BLOCK_Q * G_PAD rows
# are (query, head of the KV head's group) pairs, so a KV tile is loaded once for the whole group.
# Keys come in tiles of TILE_N positions, whatever S is: each lane finds its cache block through
# the block table (S need not be a power of two, nor divide TILE_N).
# Masks: rows past the chunk or past G (padding to powers of two) are computed and not stored;
# head-dim lanes >= Dh (padding to BLOCK_D) load as 0; key j is seen by the query at position p iff
# j <= p (causal inside the chunk, every cached token before it) and j < seq_len (lanes past it
# load nothing, not even their block-table entry). Every row sees key 0, so no row's max is -inf.
# The loop stops at the last tile the program's latest query can see. Decode batches take the
# split-KV kernel instead (decode_kernel.py): one query per sequence leaves this grid too small.


@triton.jit
def _chunk_tile(q, k_cache_ptr, v_cache_ptr, table_ptr, start, seq_len, position, kv_head, d, d_ok, m_i, l_i, acc,
                scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """Keys start .. start + TILE_N folded into the running softmax of rows at `position` (causal)."""
    key, key_ok, k, v = load_paged_kv(k_cache_ptr, v_cache_ptr, table_ptr, start, seq_len, kv_head, d, d_ok, stride_kb,
                                      stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE, TILE_N)
    seen = (key[None, :] <= position[:, None]) & key_ok[None, :]
    return attend_tile(q, k, v, seen, m_i, l_i, acc, scale)


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_ptr, seq_lens_ptr,
                            block_tables_ptr, scale, stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                            HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
                            TILE_N: tl.constexpr, RANGE_LOOP: tl.constexpr):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        cached = seq_len - q_len
        rows = tl.arange(0, BLOCK_Q * G_PAD)
        query = q_block * BLOCK_Q + rows // G_PAD  # index inside the chunk
        head = kv_head * GROUP + rows % G_PAD
        row_ok = (query < q_len) & (rows % G_PAD < GROUP)
        position = cached + query  # [BLOCK_M]
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_off = (q_start + query)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

        m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * G_PAD, BLOCK_D], tl.float32)
        kv_end = tl.minimum(seq_len, cached + (q_block + 1) * BLOCK_Q)  # keys the last query sees
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        if RANGE_LOOP:
            for start in range(0, kv_end, TILE_N):
                m_i, l_i, acc = _chunk_tile(q, k_cache_ptr, v_cache_ptr, table, start, seq_len, position, kv_head,
                                            d, d_ok, m_i, l_i, acc, scale, stride_kb, stride_ks, stride_kh,
                                            stride_vb, stride_vs, stride_vh, BLOCK_SIZE, TILE_N)
        else:
            start = seq_len * 0
            while start < kv_end:
                m_i, l_i, acc = _chunk_tile(q, k_cache_ptr, v_cache_ptr, table, start, seq_len, position, kv_head,
                                            d, d_ok, m_i, l_i, acc, scale, stride_kb, stride_ks, stride_kh,
                                            stride_vb, stride_vs, stride_vh, BLOCK_SIZE, TILE_N)
                start += TILE_N
        out = acc / l_i[:, None]
        o_off = (q_start + query)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int,
                    scale: float) -> torch.Tensor:
    """Attention of every query of the step over its sequence's cached context (shapes above).

    `max_query_len` only sizes the grid; everything a program reads about its sequence comes from
    the tensors. A decode batch (`max_query_len` 1: every eager decode-only step and every
    captured graph) goes to the split-KV kernel, `decode_kernel.py`."""
    if max_query_len == 1:
        return decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale)
    T, H, Dh = q.shape
    _, S, Hkv, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    group = H // Hkv
    g_pad = triton.next_power_of_2(group)
    tiles = prefill_tiles(Dh, q.element_size(), max_query_len * g_pad, block_tables.shape[1] * S, device_arch(q.device))
    block_q = max(1, tiles.block_m // g_pad)  # rows are queries x padded group (tl.dot wants >= 16)
    out = torch.empty_like(q)
    B = seq_lens.shape[0]
    grid = (B, triton.cdiv(max_query_len, block_q), Hkv)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, query_start, seq_lens, block_tables, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=Dh, GROUP=group, BLOCK_SIZE=S, G_PAD=g_pad, BLOCK_Q=block_q,
        BLOCK_D=max(16, triton.next_power_of_2(Dh)), TILE_N=tiles.block_n, RANGE_LOOP=range_loops(q.device),
        num_warps=tiles.num_warps, num_stages=kv_stages(tiles.num_stages, q.element_size(), k_cache.element_size()))
    return out
