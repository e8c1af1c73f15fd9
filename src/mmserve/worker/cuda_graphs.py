"""Decode steps replayed from CUDA graphs: one graph per padded batch size over static buffers.

A plain decode step (one new token per request, no image token among them) of n requests runs in
the graph of the smallest captured size >= n (`--cuda-graph-sizes`). Its inputs are copied into
the first n rows of static buffers: token ids [B], positions [B] or [3, B] (M-RoPE), slot mapping
[B], block tables [B, max_blocks], sequence lengths [B]. Rows n .. size are padding: token 0 at
position 0, its K/V written to the scratch slot (a block the scheduler never hands out), reading
one key of the scratch block. Prefill and mixed steps stay eager.

The attention metadata inside the graph is built from the static tensors by the attention
backend's `GraphMetadata` builder, so lengths are read from tensors, never from Python ints: one
graph serves every batch of its size. A backend supports graphs only by having a `graph_metadata`
builder: the triton backend does (its paged kernel reads lengths from tensors); the torch backend
does not (its decode reads every block up to the longest context).

On CPU (or before capture) `run` executes the same forward eagerly on the same static buffers,
so the padding and buffer logic is tested without a GPU (`torch_decode_metadata` serves there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from mmserve.models.attention.torch_sdpa import AttentionMetadata

# (slot_mapping [B], block_tables [B, W], seq_lens [B], block_size) -> the backend's metadata
GraphMetadata = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], Any]


def torch_decode_metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          block_size: int) -> AttentionMetadata:
    """The torch backend's decode metadata from tensors alone: every request decodes, and its mask
    covers its first `seq_lens` keys of the table's W blocks."""
    B, W = block_tables.shape
    keys = torch.arange(W * block_size, device=seq_lens.device)
    mask = keys[None, :] < seq_lens[:, None]  # [B, W * S]
    return AttentionMetadata(slot_mapping, torch.arange(B, device=seq_lens.device), block_tables,
                             mask[:, None, None, :], [])


def graph_metadata_for(backend: Any) -> GraphMetadata | None:
    """The attention backend's graph metadata builder (its `graph_metadata`), if it declares graph
    support by having one."""
    return getattr(backend, "graph_metadata", None)


@dataclass
class GraphInputs:
    """A plain decode step's inputs for `DecodeGraphs.run` (host tensors until `to_device`)."""

    slot_mapping: torch.Tensor  # [n] int64
    block_tables: torch.Tensor  # [n, w] int64, w <= the graphs' max_blocks
    seq_lens: torch.Tensor  # [n] int64


class DecodeGraphs:
    """Static decode buffers, padded batches and one captured graph per size (see the module)."""

    def __init__(self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sizes: list[int],
                 max_blocks: int, block_size: int, scratch_block: int, build_metadata: GraphMetadata) -> None:
        self.model, self.kv_caches, self.sizes = model, kv_caches, sorted(sizes)
        self.block_size, self.build_metadata = block_size, build_metadata
        self.scratch_block = scratch_block
        B, device = self.sizes[-1], kv_caches[0][0].device
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=device)
        self.positions = torch.zeros((3, B) if model.uses_mrope else (B,), dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(B, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(B, max_blocks, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(B, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # size -> (CUDA graph, its output [size, D])
        self.replays = 0  # steps run from a captured graph (tests, benchmarks)
        self.eager_runs = 0  # steps run eagerly over the static buffers (no graph captured for the size)

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def size_for(self, n: int, widest_table: int) -> int | None:
        """The padded size a plain decode of n requests runs at, or None when no graph fits it."""
        if widest_table > self.max_blocks:
            return None
        return next((size for size in self.sizes if size >= n), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs: GraphInputs) -> torch.Tensor:
        """Hidden states [n, D] of a plain decode step (n <= the largest size), from its graph
        when captured, else eagerly over the same static buffers."""
        n = input_ids.shape[0]
        size = self.size_for(n, inputs.block_tables.shape[1])
        assert size is not None, f"no decode graph holds {n} requests"
        self._fill(n, size, input_ids, positions, inputs)
        if size in self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
            self.replays += 1
            return out[:n]
        self.eager_runs += 1
        return self._forward(size)[:n]

    def capture(self) -> None:
        """Capture every size's graph (largest first, sharing one memory pool), after a warm-up."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._fill(0, size, self.input_ids[:0], self.positions[..., :0], GraphInputs(
                self.slot_mapping[:0], self.block_tables[:0], self.seq_lens[:0]))
            for _ in range(2):  # warm-up: lazy initialisations happen outside the capture
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            self.graphs[size] = (graph, out)

    def _fill(self, n: int, size: int, input_ids: torch.Tensor, positions: torch.Tensor, inputs: GraphInputs) -> None:
        """Rows [0, n) get the step's inputs; rows [n, size) are padding (see the module)."""
        width = inputs.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:size].zero_()
        self.positions[..., :n].copy_(positions)
        self.positions[..., n:size].zero_()
        self.slot_mapping[:n].copy_(inputs.slot_mapping)
        self.slot_mapping[n:size].fill_(self.scratch_block * self.block_size)
        self.block_tables[:n, :width].copy_(inputs.block_tables)
        self.block_tables[:n, width:].fill_(self.scratch_block)
        self.block_tables[n:size].fill_(self.scratch_block)
        self.seq_lens[:n].copy_(inputs.seq_lens)
        self.seq_lens[n:size].fill_(1)

    def _forward(self, size: int) -> torch.Tensor:
        meta = self.build_metadata(self.slot_mapping[:size], self.block_tables[:size], self.seq_lens[:size],
                                   self.block_size)
        embeds = self.model.embed_tokens(self.input_ids[:size])  # [size, D]
        return self.model(embeds, self.positions[..., :size], self.kv_caches, meta, None)
