"""Qwen2.5-VL-7B-Instruct's published architecture (its config.json's sizes), for the benchmarks
that build it without downloading it: random weights on a GPU (gpu_serving.py), no weights at all
on the `meta` device (kernel_resources.py)."""

from __future__ import annotations

QWEN25_VL_7B_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters={"rope_theta": 1000000.0})
QWEN25_VL_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", tokens_per_second=2)
