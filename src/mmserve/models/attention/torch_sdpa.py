"""The torch backend: attention by PyTorch's scaled-dot-product kernels (the CPU default).

Paged decoder attention (`AttentionMetadata`, `paged_attention`, and for prefill chunks after
cached tokens `prefill_attention` / `masked_prefill_attention`) and the vision towers' attention
within segments (`Segments`). Shapes: T = tokens of the whole step (all requests flattened),
B = requests, H = heads, Hkv = key/value heads, Dh = head dim, S = block size, N = blocks in the
cache, P = rows of a vision tower call.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from mmserve.models.attention import cpu_kernels
from mmserve.models.attention.host_metadata import padded_tables
from mmserve.models.cpu_ops import CPU_OPS
from mmserve.models.layers import TORCH_OPS, LayerOps, QKNorm, Rope
from mmserve.worker.device import to_device


@dataclass
class PrefillSpan:
    """One request's prefill chunk: tokens [lo, hi) of the step, after `start` cached tokens."""

    lo: int
    hi: int
    start: int
    block_table: torch.Tensor  # [num_blocks] int64
    # [n, start + n] causal from `start` for a small chunk after a short context (one masked
    # attention); None for a chunk that starts the request or one split by `prefill_attention`
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Where one step's tokens read and write K/V.

    Tokens are laid out request after request. Decoding requests (one query each) attend together:
    on the CPU by our C kernel, which reads K/V where they lie through the block tables
    (`cpu_kernels.py`, `in_kernel`); elsewhere, or without a C compiler, over padded copies of
    their blocks (`decode_mask` marks real keys). Each prefill chunk attends on its own: a chunk
    that starts the request needs only its own K/V (causal); a later chunk also reads its earlier
    tokens from the cache: a small one after a short context under a causal mask built here once
    for every layer (`masked_prefill_attention`), any other in two parts (`prefill_attention`).
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * S + offset) of each token
    decode_index: torch.Tensor  # [Bd] int64: flat index of each decoding request's token
    decode_block_tables: torch.Tensor  # [Bd, max_blocks] int64, padded with block 0
    decode_mask: torch.Tensor  # [Bd, 1, 1, max_blocks * S] bool: True on the request's context
    prefills: list[PrefillSpan]
    decode_lens: torch.Tensor | None = None  # [Bd] int64: each decoding request's keys (the kernel's)
    kernel_splits: int = 0  # the C kernel's parts per context; 0: the padded path
    ops: ClassVar[LayerOps] = CPU_OPS  # the small ops between GEMMs: C kernels for decode on CPU, else PyTorch

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, in_place: bool = True) -> AttentionMetadata:
        """`query_lens[b]` new tokens of request b end its `seq_lens[b]` tokens of context; with
        `in_place` (on the CPU) decodes read K/V where they lie by the C kernel when it is built.
        Only prefill chunks make tensors of their tables; a decode's slot is one lookup."""
        ends = list(itertools.accumulate(query_lens))
        tables = {b: torch.tensor(block_tables[b], dtype=torch.int64) for b, q in enumerate(query_lens) if q > 1}
        slots = _slot_mapping(query_lens, seq_lens, block_tables, tables, block_size)
        decode = [b for b, q in enumerate(query_lens) if q == 1]
        d_index = torch.tensor([ends[b] - 1 for b in decode], dtype=torch.int64)
        d_tables = padded_tables([block_tables[b] for b in decode], torch.int64)  # [Bd, width]
        width = d_tables.shape[1]
        d_lens = torch.tensor([seq_lens[b] for b in decode], dtype=torch.int64)
        d_mask = torch.arange(width * block_size)[None, :] < d_lens[:, None]  # [Bd, L]
        prefills = [PrefillSpan(ends[b] - query_lens[b], ends[b], seq_lens[b] - query_lens[b], table,
                                _small_chunk_mask(seq_lens[b] - query_lens[b], query_lens[b]))
                    for b, table in tables.items()]
        splits = 0
        if in_place and decode and cpu_kernels.load() is not None:
            splits = kernel_splits(len(decode), -(-max(seq_lens[b] for b in decode) // block_size))
        return cls(slots, d_index, d_tables, d_mask[:, None, None, :], prefills, d_lens, splits)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, rope: Rope | None = None,
               qk_norm: QKNorm | None = None) -> torch.Tensor:
        """q and k normalised by `qk_norm` and rotated by `rope` (cos, sin) when given, then this
        step's `paged_attention` (the models' one call, whatever the backend)."""
        if qk_norm is not None:
            q, k = self.ops.qk_norm(q, k, *qk_norm)
        if rope is not None:
            q, k = self.ops.rotary(q, k, *rope)
        return paged_attention(q, k, v, k_cache, v_cache, self, scale)


def kernel_splits(requests: int, blocks: int) -> int:
    """Parts per context for the C decode kernel: enough work items for two per thread (a single
    request's context is split across the threads), at least four blocks a part."""
    threads = torch.get_num_threads()
    if requests >= 2 * threads:
        return 1
    return max(1, min(-(-2 * threads // requests), blocks // 4))


# below both, one masked attention over all keys costs less than two and a merge (measured on CPU:
# the split loses up to ~0.06 ms a layer there, and gains 10-40% from ~900 cached keys or 256 new)
SPLIT_FROM_CACHED, SPLIT_FROM_NEW = 512, 128


def _slot_mapping(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                  tables: dict[int, torch.Tensor], block_size: int) -> torch.Tensor:
    """[T] int64: each token's cache slot; a decode's looked up on the host, a chunk's by a gather."""
    pieces: list[torch.Tensor] = []
    single: list[int] = []  # the slots of consecutive decodes, made one tensor
    for b, (q, s) in enumerate(zip(query_lens, seq_lens)):
        if q == 1:
            single.append(block_tables[b][(s - 1) // block_size] * block_size + (s - 1) % block_size)
            continue
        if single:
            pieces.append(torch.tensor(single, dtype=torch.int64))
            single = []
        positions = torch.arange(s - q, s)
        pieces.append(tables[b][positions // block_size] * block_size + positions % block_size)
    if single or not pieces:
        pieces.append(torch.tensor(single, dtype=torch.int64))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _small_chunk_mask(start: int, n: int) -> torch.Tensor | None:
    """[n, start + n] bool (query i at position start + i sees keys 0 .. start + i) for a chunk
    attended with one masked call; None for one that starts its request or is split."""
    if start == 0 or start >= SPLIT_FROM_CACHED or n >= SPLIT_FROM_NEW:
        return None
    return torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend over each request's cached context.

    q: [T, H, Dh]; k, v: [T, Hkv, Dh]; k_cache, v_cache: [N, S, Hkv, Dh]. Returns [T, H, Dh].
    The cache may hold another dtype than q's (`--kv-cache-dtype`): K/V are rounded to it as
    they are written, and every key and value attended is the cache's, widened (cast) to q's
    dtype, the step's own too: a prefix-cache hit reads exactly what the miss attended.
    """
    N, S, Hkv, Dh = k_cache.shape
    k_held, v_held = k.to(k_cache.dtype), v.to(v_cache.dtype)  # k, v themselves when the dtypes agree
    k_cache.view(N * S, Hkv, Dh).index_copy_(0, meta.slot_mapping, k_held)
    v_cache.view(N * S, Hkv, Dh).index_copy_(0, meta.slot_mapping, v_held)
    gqa = q.shape[1] != Hkv
    out = torch.empty_like(q)
    decoded = meta.kernel_splits > 0 and meta.decode_lens is not None and cpu_kernels.paged_decode(
        q, k_cache, v_cache, meta.decode_block_tables, meta.decode_lens, meta.decode_index, out, scale,
        meta.kernel_splits)
    if meta.decode_index.numel() and not decoded:  # padded copies of each request's blocks
        Bd = meta.decode_index.shape[0]
        rows = meta.decode_block_tables.reshape(-1)
        keys = k_cache.index_select(0, rows).view(Bd, -1, Hkv, Dh).transpose(1, 2).to(q.dtype)  # [Bd, Hkv, L, Dh]
        values = v_cache.index_select(0, rows).view(Bd, -1, Hkv, Dh).transpose(1, 2).to(q.dtype)
        queries = q[meta.decode_index][:, :, None]  # [Bd, H, 1, Dh]
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.decode_mask, scale=scale,
                                           enable_gqa=gqa)  # [Bd, H, 1, Dh]
        out[meta.decode_index] = o[:, :, 0]
    if meta.prefills and k_held is not k:  # the chunks' own keys and values as the cache holds them
        k, v = k_held.to(q.dtype), v_held.to(q.dtype)
    for p in meta.prefills:
        if p.start == 0:  # the chunk is the whole context so far: plain causal attention
            o = F.scaled_dot_product_attention(q[p.lo:p.hi].transpose(0, 1)[None], k[p.lo:p.hi].transpose(0, 1)[None],
                                               v[p.lo:p.hi].transpose(0, 1)[None], is_causal=True, scale=scale,
                                               enable_gqa=gqa)  # [1, H, n, Dh]
            out[p.lo:p.hi] = o[0].transpose(0, 1)
        else:
            blocks = p.block_table[: -(-p.start // S)]  # those holding the cached tokens
            cached_k = k_cache.index_select(0, blocks).view(-1, Hkv, Dh)[:p.start].to(q.dtype)  # [start, Hkv, Dh]
            cached_v = v_cache.index_select(0, blocks).view(-1, Hkv, Dh)[:p.start].to(q.dtype)
            chunk = (q[p.lo:p.hi], k[p.lo:p.hi], v[p.lo:p.hi], cached_k, cached_v)
            out[p.lo:p.hi] = (prefill_attention(*chunk, scale) if p.mask is None
                              else masked_prefill_attention(*chunk, p.mask, scale))
    return out


def masked_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached_k: torch.Tensor,
                             cached_v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """A prefill chunk after cached tokens as one attention over all its keys under `mask`
    ([n, start + n], `_small_chunk_mask`): cheaper than `prefill_attention` for a small chunk after
    a short context. Shapes as there."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], torch.cat([cached_k, k]).transpose(0, 1)[None],
                                       torch.cat([cached_v, v]).transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1])  # [1, H, n, Dh]
    return o[0].transpose(0, 1)


_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # -> (output, logsumexp)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached_k: torch.Tensor,
                      cached_v: torch.Tensor, scale: float) -> torch.Tensor:
    """A prefill chunk after `start` cached tokens: its queries see every cached key, and their
    own keys causally. q: [n, H, Dh]; k, v: [n, Hkv, Dh] (the chunk's); cached_k, cached_v:
    [start, Hkv, Dh]. Returns [n, H, Dh].

    Computed as two attentions merged by their log-sum-exps (as FlashInfer's `merge_state` does),
    not as one over all keys under a mask: the cached part needs no mask at all, and the chunk's
    own part is plain causal attention, whose kernel skips the blocks above the diagonal. A mask
    would make the kernel read and apply [n, start + n] of it and skip nothing. A query head group
    sharing a key/value head is folded into the query rows for the cached part (no copy of the
    cache per query head)."""
    n, H, Dh = q.shape
    if q.device.type != "cpu":  # the log-sum-exp kernel below is the CPU's: elsewhere one causal masked call
        start = cached_k.shape[0]
        keys = torch.arange(start + n, device=q.device)
        mask = keys[None, :] <= torch.arange(start, start + n, device=q.device)[:, None]  # [n, start + n]
        return masked_prefill_attention(q, k, v, cached_k, cached_v, mask, scale)
    Hkv = k.shape[1]
    group = H // Hkv
    folded = q.reshape(n, Hkv, group, Dh).permute(1, 2, 0, 3).reshape(1, Hkv, group * n, Dh)
    o_cached, lse_cached = _flash_attention(folded, cached_k.transpose(0, 1)[None], cached_v.transpose(0, 1)[None],
                                            scale=scale)  # [1, Hkv, group * n, Dh], [1, Hkv, group * n]
    own_k, own_v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, n, Dh]
    if group > 1:
        own_k, own_v = own_k.repeat_interleave(group, 0), own_v.repeat_interleave(group, 0)
    o_own, lse_own = _flash_attention(q.transpose(0, 1)[None], own_k[None], own_v[None], is_causal=True,
                                      scale=scale)  # [1, H, n, Dh], [1, H, n]
    # softmax over both key sets = each part's softmax weighted by its share of the total mass
    share = torch.sigmoid(lse_cached.reshape(H, n) - lse_own.reshape(H, n))[..., None]  # [H, n, 1]
    merged = torch.lerp(o_own[0].float(), o_cached.reshape(H, n, Dh).float(), share)  # [H, n, Dh]
    return merged.to(q.dtype).transpose(0, 1)




@dataclass(frozen=True)
class Segments:
    """The attention segments of one tower call, grouped by length so that equal segments (the
    full windows, the frames of one video) attend in one batched call.

    `groups`: (length L, rows [n, L] int64 on the compute device: the patch indices of each of
    the n segments of that length; None when the call is n segments of L rows in order, as a
    batch of fixed-size images is). Every patch is in exactly one segment; built once per call."""

    groups: tuple[tuple[int, torch.Tensor | None], ...]
    ops: ClassVar[LayerOps] = TORCH_OPS  # PyTorch's, as transformers' towers compute them

    @classmethod
    def from_cu(cls, cu: list[int], device: torch.device) -> Segments:
        """The segments of `cu`, their row indices built on the host and moved to `device` in one
        pinned copy without blocking (the host never waits for the device's queue here)."""
        starts: dict[int, list[int]] = {}
        for lo, hi in zip(cu[:-1], cu[1:]):
            if hi > lo:
                starts.setdefault(hi - lo, []).append(lo)
        groups = tuple((n, torch.tensor(s)[:, None] + torch.arange(n)) for n, s in starts.items())
        return cls(to_device(groups, device))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q, k, v: [P, H, Dh] -> [P, H, Dh]: full (non-causal) attention within each segment."""
        P, H, Dh = q.shape
        out = torch.empty_like(q)
        for length, rows in self.groups:
            if rows is None:  # equal segments in order: views, no gather
                qs, ks, vs = (x.view(P // length, length, H, Dh).transpose(1, 2) for x in (q, k, v))
                o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [n, H, L, Dh]
                return o.transpose(1, 2).reshape(P, H, Dh)
            qs, ks, vs = (x[rows].transpose(1, 2) for x in (q, k, v))  # [n, H, L, Dh]
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [n, H, L, Dh]
            out[rows] = o.transpose(1, 2)
        return out


class TorchBackend:
    """PyTorch's SDPA (`models/attention/backend.py`'s interface), with our C decode kernel on the
    CPU. CPU-bound for now: its step metadata is built on the CPU and `prefill_attention` calls the
    CPU flash kernel. `in_place`: decodes read K/V where they lie (the CPU's C kernel; off on other
    devices)."""

    name = "torch"

    def __init__(self, in_place: bool = True) -> None:
        self.in_place = in_place

    def build_metadata(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                       block_size: int) -> AttentionMetadata:
        return AttentionMetadata.build(query_lens, seq_lens, block_tables, block_size, self.in_place)

    def segments(self, cu: list[int], device: torch.device) -> Segments:
        return Segments.from_cu(cu, device)

    def equal_segments(self, count: int, length: int, device: torch.device) -> Segments:
        return Segments(((length, None),))


TORCH = TorchBackend()
