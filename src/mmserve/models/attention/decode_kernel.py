"""Our Triton split-KV (flash-decoding) paged attention for decode batches: each sequence's
context cut into splits that programs read side by side, then merged by log-sum-exp.

At small batches one program per (sequence, KV head) leaves most of a GPU idle (batch 1 of a
model with 4 KV heads: 4 programs walking 2,000 keys each on 132 SMs); splitting the context
gives every SM work. Imported only by the triton backend (it needs `triton`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mmserve.models.attention.online_softmax import attend_tile, load_paged_kv, range_loops
from mmserve.models.attention.tuning import kv_stages

# Shapes (B = sequences, one query each; H = query heads, Hkv = KV heads, G = H / Hkv, Dh = head
# dim, N = cache blocks, S = block size, W = block-table width, P = splits):
#   q, out: [B, H, Dh], row b is sequence b's query; k_cache, v_cache: [N, S, Hkv, Dh]
#   seq_lens: [B] int32 (keys of context, the query's own included); block_tables: [B, W] int32
#   part: [B, H, P, BLOCK_D] float32, each split's normalised output; lse: [B, H, P] float32, its
#   log-sum-exp of scaled scores
# Split kernel: one program per (sequence, KV head, split). A sequence's keys are cut into
# partitions of `_partition(seq_len)` keys (whole TILE_N tiles, computed from the tensor in both
# kernels, so short and long contexts alike use every split): split s reads keys
# [s * part, min((s + 1) * part, seq_len)). A split that starts past the end returns at once: a
# captured graph's grid is fixed by P, never by lengths. Its ROWS rows are the G query heads of its
# KV head (padded to >= 16, tl.dot's least), so each K/V tile is loaded once for the group.
# Masks: rows >= G are computed and not stored; lanes d >= Dh (padding to BLOCK_D) load as 0;
# keys past the split's end score -inf and load nothing, not even their block-table entry.
# Reduce kernel: one program per (sequence, head), the used splits' outputs weighted by
# exp(lse - max lse). With P == 1 the split kernel writes `out` itself and no reduce runs.

TILE_N = 64  # keys per tile
MAX_SPLITS = 16  # vLLM's unified Triton attention cuts a decode's context into 16 segments
MIN_SPLIT_KEYS = 128  # a split reads at least two tiles of the widest table's context
PROGRAMS_PER_SM = 2
NOMINAL_SMS = 132  # an H100's: the grid the interpreter runs (CPU) is the one a GPU would


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (NOMINAL_SMS off CUDA)."""
    if device.type != "cuda":
        return NOMINAL_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(batch: int, kv_heads: int, max_context: int, sms: int) -> int:
    """Splits per (sequence, KV head): enough programs for PROGRAMS_PER_SM on every SM, a power
    of two, at most MAX_SPLITS, and at most one per MIN_SPLIT_KEYS keys of `max_context` (the
    block tables' width: a captured graph's longest context)."""
    wanted = triton.next_power_of_2(triton.cdiv(PROGRAMS_PER_SM * sms, batch * kv_heads))
    return max(1, min(wanted, MAX_SPLITS, max_context // MIN_SPLIT_KEYS))


@dataclass(frozen=True)
class DecodeLaunch:
    """A split program's shape: `tile_n` keys per tile, its warps and its pipeline stages."""

    tile_n: int
    num_warps: int
    num_stages: int


@functools.cache  # called per layer per eager step: one launch per (dtype, cache element size)
def decode_launch(dtype: torch.dtype, cache_itemsize: int) -> DecodeLaunch:
    """The split kernel's launch for a query of `dtype` over a cache of `cache_itemsize`-byte
    elements: TILE_N keys a tile; 4 warps in half precision, 8 for a float32 query, whose
    [ROWS, BLOCK_D] tiles in float32 (K and V widened from a 16-bit cache too) pass 4 warps'
    registers and spill; 3 stages (`kv_stages`). `benchmarks/attention_sweep.py` replaces it to
    time other launches."""
    warps = 8 if dtype == torch.float32 else 4
    return DecodeLaunch(TILE_N, warps, kv_stages(3, dtype.itemsize, cache_itemsize))


@triton.jit
def _partition(seq_len, NUM_SPLITS: tl.constexpr, TILE_N: tl.constexpr):
    """Keys per split of a `seq_len`-key context: whole tiles, NUM_SPLITS of them covering it."""
    return tl.cdiv(tl.cdiv(seq_len, TILE_N), NUM_SPLITS) * TILE_N


@triton.jit
def _decode_tile(q, k_cache_ptr, v_cache_ptr, table_ptr, start, end, kv_head, d, d_ok, m_i, l_i, acc, scale,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """Keys start .. start + TILE_N (those < end) folded into the running softmax."""
    _, key_ok, k, v = load_paged_kv(k_cache_ptr, v_cache_ptr, table_ptr, start, end, kv_head, d, d_ok, stride_kb,
                                    stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE, TILE_N)
    return attend_tile(q, k, v, key_ok[None, :], m_i, l_i, acc, scale)


@triton.jit
def _split_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, lse_ptr, seq_lens_ptr,
                         block_tables_ptr, scale, stride_qt, stride_qh, stride_ot, stride_oh,
                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                         HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, RANGE_LOOP: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    part = _partition(seq_len, NUM_SPLITS, TILE_N)
    lo = split * part
    if lo < seq_len:
        hi = tl.minimum(lo + part, seq_len)
        rows = tl.arange(0, ROWS)
        head = kv_head * GROUP + rows
        row_ok = rows < GROUP
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [ROWS, BLOCK_D]
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        if RANGE_LOOP:
            for start in range(lo, hi, TILE_N):
                m_i, l_i, acc = _decode_tile(q, k_cache_ptr, v_cache_ptr, table, start, hi, kv_head, d, d_ok,
                                             m_i, l_i, acc, scale, stride_kb, stride_ks, stride_kh,
                                             stride_vb, stride_vs, stride_vh, BLOCK_SIZE, TILE_N)
        else:
            start = lo
            while start < hi:
                m_i, l_i, acc = _decode_tile(q, k_cache_ptr, v_cache_ptr, table, start, hi, kv_head, d, d_ok,
                                             m_i, l_i, acc, scale, stride_kb, stride_ks, stride_kh,
                                             stride_vb, stride_vs, stride_vh, BLOCK_SIZE, TILE_N)
                start += TILE_N
        out = acc / l_i[:, None]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + seq * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            row = (seq * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split  # [ROWS] in [B, H, P]
            tl.store(part_ptr + row[:, None] * BLOCK_D + d[None, :], out, mask=row_ok[:, None])
            tl.store(lse_ptr + row, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def _reduce_splits_kernel(part_ptr, lse_ptr, out_ptr, seq_lens_ptr, stride_ot, stride_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len, _partition(seq_len, NUM_SPLITS, TILE_N))  # splits that read keys
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < used
    row = (seq * tl.num_programs(1) + head) * NUM_SPLITS + s  # [SPLITS_PAD]
    lse = tl.load(lse_ptr + row, mask=s_ok, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, 0))  # 0 for unused splits; split 0 always reads keys
    d = tl.arange(0, BLOCK_D)
    parts = tl.load(part_ptr + row[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(weight[:, None] * parts, 0) / tl.sum(weight, 0)  # [BLOCK_D]
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float, splits: int | None = None) -> torch.Tensor:
    """Attention of each sequence's one query over its cached context (shapes above). The split
    count (`decode_splits`, unless `splits` is given: a benchmark's one-split baseline) comes from
    the batch, the KV heads and the tables' width (all fixed for a captured graph), never from the
    lengths, which only the kernels read."""
    B, H, Dh = q.shape
    _, S, Hkv, _ = k_cache.shape
    assert B == seq_lens.shape[0] and q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    group = H // Hkv
    if splits is None:
        splits = decode_splits(B, Hkv, block_tables.shape[1] * S, sm_count(q.device))
    block_d = max(16, triton.next_power_of_2(Dh))
    launch = decode_launch(q.dtype, k_cache.element_size())
    out = torch.empty_like(q)
    part, lse = out, out  # not read with one split
    if splits > 1:
        part = torch.empty(B, H, splits, block_d, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    _split_decode_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, out, part, lse, seq_lens, block_tables, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=Dh, GROUP=group, BLOCK_SIZE=S, ROWS=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        TILE_N=launch.tile_n, NUM_SPLITS=splits, RANGE_LOOP=range_loops(q.device), num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    if splits > 1:
        _reduce_splits_kernel[(B, H)](
            part, lse, out, seq_lens, out.stride(0), out.stride(1), HEAD_DIM=Dh, BLOCK_D=block_d, TILE_N=launch.tile_n,
            NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), num_warps=4)
    return out
