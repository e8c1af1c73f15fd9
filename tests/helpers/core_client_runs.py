"""Driving an `EngineCoreClient` directly (no AsyncLLM): requests made by an in-process `LLM`'s
input processor, and the outputs read back until every request finished."""

from __future__ import annotations

import time
from typing import Any

from mmserve import LLM, SamplingParams
from mmserve.frontend.engine_client.core_client import EngineCoreClient
from mmserve.ipc.messages import EngineCoreRequest, SchedulerStats
from helpers.tiny_models import make_image

ENGINE_ARGS: dict[str, Any] = dict(max_model_len=64, num_kv_blocks=32, block_size=4)
PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"


def request(llm: LLM, rid: str, seed: int, **params: Any) -> EngineCoreRequest:
    """A greedy request for `PROMPT` with image `seed`, its items whole (not cached anywhere)."""
    return llm.engine.input_processor.process(rid, _prompt(seed), _greedy(params))


def expected_tokens(llm: LLM, seed: int, **params: Any) -> list[int]:
    """What the in-process engine answers to `request(llm, _, seed, **params)`."""
    return llm.generate(_prompt(seed), _greedy(params))[0].outputs[0].token_ids


def _prompt(seed: int) -> dict[str, Any]:
    return {"prompt": PROMPT, "multi_modal_data": {"image": make_image(seed)}}


def _greedy(params: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **params})


def collect(client: EngineCoreClient, ids: set[str],
            timeout_s: float = 30.0) -> tuple[dict[str, tuple], SchedulerStats | None]:
    """Read outputs until every id finished: {id: (tokens, finish_reason, error)}, last stats."""
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    done: dict[str, tuple] = {}
    stats = None
    deadline = time.monotonic() + timeout_s
    while len(done) < len(ids):
        out = client.get_output(timeout_s=max(deadline - time.monotonic(), 0.0))
        assert out is not None, f"timed out; finished so far: {sorted(done)}"
        stats = out.stats or stats
        for o in out.outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                done[o.request_id] = (tokens[o.request_id], o.finish_reason, o.error)
    return done, stats
