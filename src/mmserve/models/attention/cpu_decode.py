"""Paged decode attention on the CPU that reads K/V where they lie (`DecodePlan`, `decode_attention`).

A decoding request's blocks fall into runs of consecutive block ids: its prompt's blocks, handed
out together, are usually one long run; the blocks it gets one at a time while decoding are
short runs. Each long run (`MIN_RUN_BLOCKS` or more) is attended in place: a view of the cache
(no copy) passed to the CPU flash kernel, per request. All of it runs on one thread, whatever
the step's: one request's run at one layer is too little work to wake OpenMP's other threads for
(measured slower on two threads at every batch and context of `benchmarks/decode_step.py`, and
far slower when another process holds the other core). The short runs and the request's last
block (the one this step writes) are gathered for the whole batch into one small padded copy and
attended in one batched call under a mask. The parts are merged by their log-sum-exps (softmax
over all keys = each part's softmax weighted by its share of the total mass), as
`prefill_attention` merges a chunk's two parts. Attention over a request's keys does not depend
on their order (positions are in the keys already), so runs need not be read in table order.

Shapes: Bd = decoding requests, H = heads, Hkv = key/value heads, group = H / Hkv, Dh = head
dim, S = block size, N = blocks in the cache, F = the widest request's gathered blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A run of at least this many consecutive blocks is read in place (one flash call for that
# request); shorter runs are cheaper gathered with the batch's other short runs.
MIN_RUN_BLOCKS = 4

_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # -> (output, logsumexp)


@dataclass
class DecodePlan:
    """Where each decoding request's keys lie: long runs read in place, the rest gathered."""

    rows: torch.Tensor  # [Bd] int64: flat index of each decoding request's token in the step
    # the runs read in place, in rounds (round r: every request's r-th run): the round's requests
    # [n] int64, and per request its index, the run's first slot and its keys
    rounds: list[tuple[torch.Tensor, list[tuple[int, int, int]]]]
    gathered: torch.Tensor  # [Bd, F] int64: each request's other blocks, padded with block 0
    mask: torch.Tensor  # [Bd, 1, 1, F * S] float32: 0 on a gathered key of the request, -inf elsewhere

    @classmethod
    def build(cls, rows: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int,
              splits: RunSplits | None = None) -> DecodePlan:
        """`rows[b]`: the step's row of request b, whose `seq_lens[b]` keys are in `tables[b]`;
        `splits` keeps the tables' run splits from step to step (else split here)."""
        used = [-(-seq_len // block_size) for seq_len in seq_lens]  # blocks holding keys
        parts = (splits or RunSplits()).split(tables, [n - 1 for n in used])  # the last block is always gathered
        runs, rest, counts = [], [], []
        for seq_len, table, n, (in_place, other) in zip(seq_lens, tables, used, parts):
            runs.append([(first * block_size, length * block_size) for first, length in in_place])
            rest.append(other + [table[n - 1]])
            counts.append(len(other) * block_size + seq_len - (n - 1) * block_size)
        width = max(len(r) for r in rest)
        rounds = []
        for r in range(max(len(request_runs) for request_runs in runs)):
            members = [(b, *request_runs[r]) for b, request_runs in enumerate(runs) if len(request_runs) > r]
            rounds.append((torch.tensor([b for b, _, _ in members], dtype=torch.int64), members))
        gathered = torch.tensor([r + [0] * (width - len(r)) for r in rest], dtype=torch.int64)
        visible = torch.arange(width * block_size)[None, :] < torch.tensor(counts)[:, None]  # [Bd, F * S]
        mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        return cls(torch.tensor(rows, dtype=torch.int64), rounds, gathered, mask[:, None, None, :])


class _Split:
    """One block table's first `covered` ids: closed long runs, other ids, and the open last run."""

    def __init__(self, table: list[int]) -> None:
        self.table = table
        self.covered = 0
        self.long: list[tuple[int, int]] = []
        self.short: list[int] = []
        self.open = (0, 0)  # (first id, length) of the run the next id may continue

    def extend(self, n: int) -> None:
        """Cover ids up to `n` (only the ids added since the last call are looked at)."""
        first, length = self.open
        for block in self.table[self.covered:n]:
            if length and block == first + length:
                length += 1
                continue
            self._close(first, length)
            first, length = block, 1
        self.open, self.covered = (first, length), max(self.covered, n)

    def _close(self, first: int, length: int) -> None:
        if length >= MIN_RUN_BLOCKS:
            self.long.append((first, length))
        else:
            self.short.extend(range(first, first + length))

    def parts(self) -> tuple[list[tuple[int, int]], list[int]]:
        """(long runs as (first id, length), the other ids) of the covered ids."""
        first, length = self.open
        if length >= MIN_RUN_BLOCKS:
            return [*self.long, self.open], self.short
        return self.long, [*self.short, *range(first, first + length)]


class RunSplits:
    """Block tables split into runs, kept from step to step: a decoding request's table only grows
    (the runner extends the same list), so each step looks only at the blocks added since the last.
    Entries are by table identity, checked, and dropped when their table is not in a step."""

    def __init__(self) -> None:
        self._splits: dict[int, _Split] = {}

    def split(self, tables: list[list[int]], counts: list[int]) -> list[tuple[list[tuple[int, int]], list[int]]]:
        """Each table's first `counts[b]` ids as (long runs (first id, length), the other ids)."""
        kept, result = {}, []
        for table, n in zip(tables, counts):
            entry = self._splits.get(id(table))
            if entry is None or entry.table is not table or entry.covered > n:
                entry = _Split(table)
            entry.extend(n)
            kept[id(table)] = entry
            result.append(entry.parts())
        self._splits = kept
        return result


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan,
                     scale: float) -> torch.Tensor:
    """q: [T, H, Dh] (the step's); k_cache, v_cache: [N, S, Hkv, Dh] holding this step's K/V
    already. Returns [Bd, H, Dh]: each decoding request's attention over its context. On one
    thread whatever the step's: each call is too little work to wake other threads for."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _decode_attention(q, k_cache, v_cache, plan, scale)
    finally:
        torch.set_num_threads(threads)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan,
                      scale: float) -> torch.Tensor:
    N, S, Hkv, Dh = k_cache.shape
    Bd, H = plan.rows.shape[0], q.shape[1]
    queries = q.index_select(0, plan.rows).view(Bd, Hkv, H // Hkv, Dh)  # query heads grouped by K/V head
    F = plan.gathered.shape[1]
    keys = k_cache.index_select(0, plan.gathered.view(-1)).view(Bd, F * S, Hkv, Dh).transpose(1, 2)
    values = v_cache.index_select(0, plan.gathered.view(-1)).view(Bd, F * S, Hkv, Dh).transpose(1, 2)
    out, lse = _flash_attention(queries, keys, values, attn_mask=plan.mask.to(q.dtype), scale=scale)
    if plan.rounds:  # out, lse: [Bd, Hkv, group, Dh], [Bd, Hkv, group]
        out, lse = _attend_runs(queries, k_cache, v_cache, plan, scale, out.float(), lse.clone())
    return out.to(q.dtype).reshape(Bd, H, Dh)


def _attend_runs(queries: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan,
                 scale: float, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the runs read in place into `out` [Bd, Hkv, group, Dh] (float32) and `lse` [Bd, Hkv, group]."""
    N, S, Hkv, Dh = k_cache.shape
    flat_k, flat_v = k_cache.view(N * S, Hkv, Dh), v_cache.view(N * S, Hkv, Dh)
    for index, members in plan.rounds:
        parts = [_flash_attention(queries[b:b + 1], flat_k[first:first + n].transpose(0, 1)[None],
                                  flat_v[first:first + n].transpose(0, 1)[None], scale=scale)
                 for b, first, n in members]  # each run a view of the cache: no copy
        o, m = torch.cat([o for o, _ in parts]).float(), torch.cat([m for _, m in parts])
        before = lse[index]
        share = torch.sigmoid(m - before)[..., None]  # the run's share of the mass seen so far and its own
        out[index] = torch.lerp(out[index], o, share)
        lse[index] = torch.logaddexp(before, m)
    return out, lse
