"""Qwen2.5-VL-7B-Instruct's, Qwen3-VL-8B-Instruct's and llava-1.5-7b-hf's published architectures
(their config.json's sizes), for the benchmarks that build them without downloading them: random
weights on a GPU (gpu_serving.py), no weights at all on the `meta` device (kernel_resources.py)."""

from __future__ import annotations

QWEN25_VL_7B_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters={"rope_theta": 1000000.0})
QWEN25_VL_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", tokens_per_second=2)
QWEN3_VL_8B_TEXT = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=262144,
                        rms_norm_eps=1e-6, tie_word_embeddings=False,
                        rope_parameters={"rope_theta": 5000000.0, "mrope_section": [24, 20, 20]})
QWEN3_VL_8B_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                          spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                          deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh")
LLAVA_15_7B_TEXT = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5)
LLAVA_15_7B_VISION = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                          image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu",
                          layer_norm_eps=1e-5)
