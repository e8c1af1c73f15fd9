"""Quantized vision towers: a checkpoint whose skip list leaves the Qwen tower in (an llm-compressor
recipe without the vision `ignore`, a fine-grained FP8 or AWQ export quantized whole) has every
tower linear quantized, the fused `qkv` included, and greedy float32 tokens equal transformers on
the dequantized weights. As vLLM does: its Qwen2.5-VL and Qwen3-VL towers take the checkpoint's
quantization config, each linear (the tower's QKVParallelLinear too) quantized unless skipped."""

from __future__ import annotations

import pytest

from helpers.hf_reference import hf_qwen_greedy
from helpers.parity_runs import run_greedy
from helpers.quant_checkpoints import quantize_copy
from helpers.tiny_models import make_image, make_qwen_checkpoint
from mmserve.models.parallel import Shard, TensorParallel
from mmserve.models.qwen_config import QwenVisionConfig
from mmserve.models.qwen_vision import QKVParallelLinear
from mmserve.models.quantization.config import QuantSpec
from mmserve.models.quantization.select import make_method

MAX_NEW = 4
METHOD = {"awq": "awq", "w4a16-asym": "w4a16", "w8a16-asym": "w8a16", "fp8-block": "fp8_block",
          "fp8-channel": "fp8_channel"}
PADS = "<|vision_start|><|image_pad|><|vision_end|>"


def _items() -> list[dict]:
    return [{"prompt": f"<|im_start|>user\n{PADS}What is this?<|im_end|>\n<|im_start|>assistant\n",
             "multi_modal_data": {"image": make_image(0, (64, 48))}}]


@pytest.mark.parametrize("family, fmt", [("qwen2_5_vl", "fp8-channel"), ("qwen3_vl", "fp8-block"),
                                         ("qwen2_5_vl", "awq"), ("qwen3_vl", "w4a16-asym"),
                                         ("qwen2_5_vl", "w8a16-asym")])
def test_a_quantized_tower_gives_transformers_tokens_on_the_dequantized_weights(family, fmt, tmp_path):
    source = make_qwen_checkpoint(tmp_path, family=family, min_pixels=28 * 28 * 4, max_pixels=32 * 32 * 16)
    quantized, dequantized = quantize_copy(source, tmp_path, fmt, tower=True)
    got, llm = run_greedy(quantized, _items(), MAX_NEW)
    visual = llm.engine.core.executor.runner.model.model.visual
    methods = {name: m.method.name for name, m in visual.named_modules() if hasattr(m, "method")}
    assert set(methods.values()) == {METHOD[fmt]} and "blocks.0.attn.qkv" in methods
    llm.shutdown()
    assert got == hf_qwen_greedy(dequantized, _items(), MAX_NEW)[0]


@pytest.mark.parametrize("spec, shards", [
    (QuantSpec("awq", group_size=32, symmetric=False),  # qweight, qzeros [in (/ group), out / 8]: words of 8 columns
     {"qweight": [Shard(1, 4, 4), Shard(1, 12, 4), Shard(1, 20, 4)], "scales": [Shard(1, 32, 32), Shard(1, 96, 32),
                                                                                Shard(1, 160, 32)]}),
    (QuantSpec("fp8_block", block=(32, 32)),  # weight [out, in], a scale per 32 x 32 block
     {"weight": [Shard(0, 32, 32), Shard(0, 96, 32), Shard(0, 160, 32)],
      "weight_scale_inv": [Shard(0, 1, 1), Shard(0, 3, 1), Shard(0, 5, 1)]}),
])
def test_each_quantized_tensor_of_a_rank_qkv_is_read_over_its_three_row_ranges(spec, shards):
    """Rank 1 of 2 holds rows 32..63 of q, k and v (64 each): each packed tensor is sliced along its
    own packing at the same three places, and stacked to the rank's 96 rows."""
    cfg = QwenVisionConfig(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3, patch_size=14,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32, hidden_act="silu")
    qkv = QKVParallelLinear(cfg.hidden_size, cfg.num_heads, TensorParallel(1, 2))
    qkv.set_method(make_method(spec))
    for name, want in shards.items():
        assert qkv.tp_shards[name] == want
        assert getattr(qkv, name).shape[want[0].dim] == sum(s.length for s in want)
    assert qkv.tp_shards["bias"] == [Shard(0, 32, 32), Shard(0, 96, 32), Shard(0, 160, 32)]


@pytest.mark.slow  # two rank processes
@pytest.mark.parametrize("fmt", ["fp8-block", "awq"])
def test_two_ranks_of_a_quantized_tower_give_the_same_tokens(fmt, tmp_path):
    """Each rank reads its heads' rows of the fused qkv's packed tensors (three ranges of words,
    groups or blocks) and its slice of every other tower linear."""
    source = make_qwen_checkpoint(tmp_path, family="qwen3_vl", min_pixels=28 * 28 * 4, max_pixels=32 * 32 * 16)
    quantized, dequantized = quantize_copy(source, tmp_path, fmt, tower=True)
    got, llm = run_greedy(quantized, _items(), MAX_NEW, tensor_parallel_size=2)
    llm.shutdown()
    assert got == hf_qwen_greedy(dequantized, _items(), MAX_NEW)[0]
