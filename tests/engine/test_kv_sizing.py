"""KV cache sizing: explicit flags win, CUDA's profiled budget otherwise, CPU keeps 1 GiB; a
profiled cache that cannot hold one full-length request is a start-up error naming the flags.
The largest-step profile itself runs here on CPU (its CUDA memory reading needs a GPU)."""

from __future__ import annotations

import pytest

from mmserve import LLM
from mmserve.config import EngineConfig
from mmserve.engine.core import kv_cache_blocks, resolve_max_model_len
from mmserve.models.hf_config import load_model_config
from mmserve.worker.memory import available_kv_cache_bytes, profile_largest_step
from helpers.tiny_models import make_checkpoint, make_qwen_checkpoint

BLOCK_BYTES = 1 << 20


class FakeExecutor:
    def __init__(self, available: int | None) -> None:
        self.available = available

    def kv_cache_bytes_per_block(self) -> int:
        return BLOCK_BYTES

    def available_kv_cache_bytes(self) -> int | None:
        return self.available


@pytest.mark.parametrize("args, available, want", [
    ({}, None, (1024, False)),  # CPU: 1 GiB
    ({}, 300 * BLOCK_BYTES + 5, (300, True)),  # CUDA: what --gpu-memory-utilization leaves
    ({"kv_cache_memory_gb": 0.5}, 300 * BLOCK_BYTES, (512, False)),  # an explicit size wins
    ({"num_kv_blocks": 7}, 300 * BLOCK_BYTES, (7, False)),  # so does an explicit count
])
def test_explicit_flags_win_then_the_profile_then_one_gib(args, available, want):
    assert kv_cache_blocks(EngineConfig.from_kwargs(**args), FakeExecutor(available)) == want


def test_nothing_left_after_the_profile_names_the_flags():
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        kv_cache_blocks(EngineConfig(), FakeExecutor(-5))


def test_a_profiled_cache_must_hold_one_full_length_request(tmp_path):
    model = load_model_config(make_checkpoint(tmp_path))
    config = EngineConfig.from_kwargs(max_model_len=256, block_size=16)
    assert resolve_max_model_len(config, model, 16, profiled=True) == 256
    with pytest.raises(ValueError, match="--gpu-memory-utilization.*--max-model-len"):
        resolve_max_model_len(config, model, 15, profiled=True)
    assert resolve_max_model_len(config, model, 16 * 64) == 256


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_the_largest_step_profile_runs_and_frees_its_kv(tmp_path, family):
    path = make_checkpoint(tmp_path) if family == "llava" else make_qwen_checkpoint(tmp_path, family=family)
    llm = LLM(model=path, max_model_len=128, max_num_batched_tokens=300, max_num_seqs=4)  # kept: collection frees it
    runner = llm.engine.core.executor.runner
    assert available_kv_cache_bytes(runner) is None  # CPU keeps its flag
    kv = runner.kv_caches
    profile_largest_step(runner)  # 300 tokens as sequences of <= 128, the largest image, logits for 4 rows
    assert runner.kv_caches == []
    runner.kv_caches = kv
