"""What every parity test (LLaVA, Qwen, video) runs on mmserve's side: greedy outputs of a fresh
offline `LLM`, with the engine's integrity and every KV block's return checked after."""

from __future__ import annotations

from typing import Any

from mmserve import LLM, SamplingParams


def run_greedy(path: str, items: list[dict[str, Any]], max_new: int,
               **engine_args: Any) -> tuple[list[list[int]], LLM]:
    """Greedy token ids per prompt (`max_new` each) and the `LLM` (for its counters). On the CPU
    unless `engine_args` name a device: the references it is held to run there in float32, and a
    machine with CUDA must not move it to a GPU in bfloat16 (`--device auto`)."""
    engine_args.setdefault("device", "cpu")
    llm = LLM(model=path, **engine_args)
    outs = llm.generate(items, SamplingParams(temperature=0.0, max_tokens=max_new))
    llm.engine.core.check_integrity()
    assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.kv_cache.pool.num_blocks
    return [o.outputs[0].token_ids for o in outs], llm
