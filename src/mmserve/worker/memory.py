"""Sizing the KV cache on a GPU: what `--gpu-memory-utilization` leaves after the largest step.

`available_kv_cache_bytes` runs the largest work a step may hold: the vision tower on the largest
image the family admits (`largest_item_data`), then one forward of `max_num_batched_tokens` prompt
tokens (split into sequences no longer than the context) on a temporary KV cache, and logits and
a sort for `max_num_seqs` rows, as sampling makes them. It then reads the peak of torch's
allocator and the device's free memory (vLLM's rule):

    kv bytes = total * utilization - peak torch memory - memory others hold (CUDA context, nccl)

Not profiled: several images in one step's tower call (the encoder budget may admit more than
one); the utilization's margin covers them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mmserve.worker.device import item_on, to_device

if TYPE_CHECKING:
    from mmserve.worker.model_runner import ModelRunner


def available_kv_cache_bytes(runner: ModelRunner) -> int | None:
    """Bytes this rank may give its KV cache on CUDA (None elsewhere: the CPU keeps its flag)."""
    device = runner.device
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_largest_step(runner)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)  # not torch's: context, nccl, other processes
    return int(total * runner.config.device.gpu_memory_utilization - peak - others)


@torch.inference_mode()
def profile_largest_step(runner: ModelRunner) -> None:
    """One forward of the largest step on throwaway inputs and a temporary KV cache (freed after)."""
    config, block_size = runner.config, runner.block_size
    tokens = config.scheduler.max_num_batched_tokens
    longest = config.model.max_model_len or runner.model.config.text.max_position_embeddings
    query_lens = [min(longest, tokens - done) for done in range(0, tokens, longest)]
    tables, next_block = [], 0
    for n in query_lens:
        blocks = -(-n // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    item = item_on(runner.model.largest_item_data(), runner.device)
    runner.model.encode_items([item], runner.dtype)
    del item
    runner.allocate_kv_cache(next_block, scratch=False)
    try:
        meta = runner.model.attention.build_metadata(query_lens, query_lens, tables, block_size)
        positions = torch.cat([torch.arange(n) for n in query_lens])
        if runner.model.uses_mrope:
            positions = positions.expand(3, -1)
        ids = torch.zeros(tokens, dtype=torch.int64)
        ids, positions, meta = to_device((ids, positions, meta), runner.device)
        hidden = runner.model(runner.model.embed_tokens(ids), positions, runner.kv_caches, meta, None)  # [T, D]
        rows = torch.arange(config.scheduler.max_num_seqs, device=runner.device) % tokens
        logits = runner.model.compute_logits(hidden[rows]).float()  # [max_num_seqs, V], as sampling holds it
        logits.sort(dim=-1, descending=True)
    finally:
        runner.kv_caches = []
