"""On a CUDA GPU: an `LLM` gives its GPU memory back, so LLMs made one after another in one
process each get the whole KV cache `--gpu-memory-utilization` allows, after a clean shutdown,
after an exception left a `with` block, and after a failure whose traceback still holds one.
`make test-gpu`; skipped where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from helpers.gpu_cases import checkpoint, release_llms

pytestmark = pytest.mark.gpu
ARGS = dict(device="cuda", max_model_len=512)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def blocks(llm: LLM) -> int:
    return llm.engine.core.kv_cache.pool.num_blocks


def sized_fully(path: str, full: int) -> None:
    """A new LLM gets (almost) the KV blocks the first did: nothing of an earlier one is held."""
    with LLM(model=path, **ARGS) as llm:
        assert blocks(llm) >= 0.97 * full, (blocks(llm), full)
        assert llm.generate("hello", GREEDY)[0].outputs[0].token_ids


def test_two_llms_in_a_row_both_get_a_full_kv_cache(tmp_path):
    path = checkpoint("builtin:tiny-llava", tmp_path)
    first = LLM(model=path, **ARGS)
    full = blocks(first)
    out = first.generate("hello", GREEDY)[0].outputs[0].token_ids
    first.shutdown()
    held = torch.cuda.memory_allocated()
    print(f"\nKV blocks: {full}; torch memory held after shutdown: {held / 2**20:.1f} MiB")
    assert held < 256 * 2**20  # workspaces at most: no weights, no KV
    sized_fully(path, full)
    assert out


def test_a_failure_does_not_starve_the_next_engine(tmp_path):
    path = checkpoint("builtin:tiny-llava", tmp_path)
    with LLM(model=path, **ARGS) as llm:
        full = blocks(llm)

    def fails_inside_with() -> None:
        with LLM(model=path, **ARGS):
            raise KeyError("a test's assertion")

    def fails_holding_one() -> None:
        llm = LLM(model=path, **ARGS)  # noqa: F841  (held by the traceback below)
        raise KeyError("a test's assertion")

    kept = []
    for failing in (fails_inside_with, fails_holding_one):
        try:
            failing()
        except KeyError as e:
            kept.append(e)  # its traceback keeps the frame (and any LLM in it) alive, as pytest's report does
        if failing is fails_holding_one:
            assert release_llms() >= 1  # what the kit's conftest does after each test
        sized_fully(path, full)
    assert len(kept) == 2
