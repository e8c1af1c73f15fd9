"""The built-in tiny Qwen-VL checkpoints: random weights in the published layout, no download.

`write_tiny_qwen_vl` writes a Qwen3-VL (the default, `builtin:tiny-qwen3-vl`), Qwen2.5-VL or
Qwen2-VL directory that transformers loads as published checkpoints load: `config.json`
(`Qwen3VLForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration` /
`Qwen2VLForConditionalGeneration`), safetensors (sharded
with an index when asked), `generation_config.json`, `tokenizer.json` (the built-in byte-level
BPE with Qwen's special tokens), `chat_template.jinja` (Qwen2-VL's shape), `preprocessor_config.json`
(image_processor_type `Qwen2VLImageProcessor`, the pixel budget) and
`video_preprocessor_config.json`. The same arguments always give byte-identical files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mmserve.models.builtin import fill_random, round_up, tokenizer_json

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
# Qwen2-VL's template: a default system turn; image and video parts wrapped in vision tokens; with
# `tools`, Qwen2.5 / Qwen3's tool turns (the tools listed in the system turn, calls as hermes
# `<tool_call>` JSON, tool results as `<tool_response>` in a user turn). Without tools it renders
# exactly as Qwen2-VL's.
_TOOLS_SYSTEM = (
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' and messages[0]['content'] is string -%}"
    "{{ messages[0]['content'] + '\\n\\n' }}{%- endif -%}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\\n' }}{{ tool | tojson }}{%- endfor -%}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
)
_CONTENT = (
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- elif message['content'] is not none -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] in ('video', 'video_url') -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
)
CHAT_TEMPLATE = (
    "{%- if tools -%}" + _TOOLS_SYSTEM +
    "{%- elif messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' and message['content'] is string -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' }}" + _CONTENT + "{{ '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}" + _CONTENT +
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set call = call['function'] if call['function'] is defined else call -%}"
    "{%- if message['content'] or not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}{{ call['arguments'] | tojson }}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# A scale where greedy outputs follow the image (see builtin.DEFAULT_INIT_STD).
DEFAULT_INIT_STD = 0.2
# 32 px per merged token at patch 16: 16 to 256 image tokens (a 336 px image is 100)
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS = 32 * 32 * 16, 32 * 32 * 256

_VISION = {
    "qwen3_vl": dict(depth=3, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16,
                     spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                     deepstack_visual_indexes=[0, 1], hidden_act="gelu_pytorch_tanh"),
    "qwen2_5_vl": dict(depth=3, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[2],
                       hidden_act="silu", tokens_per_second=2),
    # Qwen2-VL names its width embed_dim; its hidden_size is the decoder's (set by `_config`)
    "qwen2_vl": dict(depth=3, embed_dim=64, mlp_ratio=2, num_heads=2, patch_size=14, spatial_merge_size=2,
                     temporal_patch_size=2, hidden_act="quick_gelu"),
}
_TEXT: dict[str, Any] = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, max_position_embeddings=8192, rms_norm_eps=1e-6)
# mrope_section (t, h, w) at the default head_dim 32; other head dims keep the proportions
_ROPE_SECTION = {"qwen3_vl": (8, 4, 4), "qwen2_5_vl": (4, 6, 6), "qwen2_vl": (4, 6, 6)}


def build_qwen_tokenizer() -> Any:
    """A fresh `PreTrainedTokenizerFast`: the built-in BPE with Qwen's special tokens, no BOS."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json(SPECIAL_TOKENS, None)),
        eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=8192, chat_template=CHAT_TEMPLATE,
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
    )


def mrope_section(family: str, head_dim: int) -> list[int]:
    """The M-RoPE split of the rotary half-dimension (head_dim / 2) into temporal, height and
    width frequencies, in the family's default proportions (h == w; sums to head_dim / 2)."""
    weights = _ROPE_SECTION[family]
    half = head_dim // 2
    spatial = half * weights[1] // sum(weights)
    return [half - 2 * spatial, spatial, spatial]


def _text_config(family: str, tokenizer: Any, text_config: dict | None, ids: dict[str, int]) -> dict[str, Any]:
    """The text config's fields: defaults, overrides, the tokenizer's ids, a matching M-RoPE."""
    text = {**_TEXT, "vocab_size": round_up(len(tokenizer), 64), **(text_config or {}),
            "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"], "bos_token_id": None}
    if text["vocab_size"] < len(tokenizer):
        raise ValueError(f"text vocab_size {text['vocab_size']} < tokenizer size {len(tokenizer)}")
    if family in ("qwen2_vl", "qwen2_5_vl"):
        # Qwen2(.5)-VL's attention always uses hidden / heads, and its config has neither field
        text.pop("head_dim", None)
        head_dim = text["hidden_size"] // text["num_attention_heads"]
        rope: dict[str, Any] = {"mrope_section": mrope_section(family, head_dim)}
    else:
        rope = {"mrope_section": mrope_section(family, text["head_dim"]), "mrope_interleaved": True}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, **rope,
                               **text.get("rope_parameters", {})}
    return text


def _config(family: str, tokenizer: Any, text_config: dict | None, vision_config: dict | None) -> Any:
    from transformers import AutoConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = _text_config(family, tokenizer, text_config, ids)
    out = "hidden_size" if family == "qwen2_vl" else "out_hidden_size"  # the merger's output width
    vision = {**_VISION[family], out: text["hidden_size"], **(vision_config or {})}
    return AutoConfig.for_model(
        family, text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], dtype="float32")


def _write_processor_files(path: Path, tokenizer: Any, vision: Any, min_pixels: int, max_pixels: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer.save_pretrained(str(path))
    pixels = dict(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                  merge_size=vision.spatial_merge_size, min_pixels=min_pixels, max_pixels=max_pixels)
    Qwen2VLImageProcessorPil(**pixels).save_pretrained(str(path))
    pre = json.loads((path / "preprocessor_config.json").read_text())
    pre["image_processor_type"] = "Qwen2VLImageProcessor"  # the published name (the Pil class reads it too)
    (path / "preprocessor_config.json").write_text(json.dumps(pre, indent=2, sort_keys=True) + "\n")
    kind = "Qwen3VLVideoProcessor" if vision.model_type.startswith("qwen3") else "Qwen2VLVideoProcessor"
    video = {**pixels, "video_processor_type": kind, "fps": 2.0, "min_frames": 4,
             "max_frames": 768, "do_sample_frames": True, "size": {"shortest_edge": min_pixels,
                                                                   "longest_edge": max_pixels}}
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2, sort_keys=True) + "\n")


def write_qwen_vl_files(path: str | os.PathLike, *, family: str, text_config: dict, vision_config: dict,
                        min_pixels: int, max_pixels: int) -> Any:
    """Writes a Qwen-VL directory's tokenizer and processor files (no config, no weights) and returns
    its transformers config: for a model whose weights are made elsewhere (the GPU benchmark builds
    a real-size one on the device and saves it there)."""
    tokenizer = build_qwen_tokenizer()
    config = _config(family, tokenizer, text_config, vision_config)
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    _write_processor_files(target, tokenizer, config.vision_config, min_pixels, max_pixels)
    return config


def write_tiny_qwen_vl(path: str | os.PathLike, *, family: str = "qwen3_vl", text_config: dict | None = None,
                       vision_config: dict | None = None, min_pixels: int = DEFAULT_MIN_PIXELS,
                       max_pixels: int = DEFAULT_MAX_PIXELS, init_std: float = DEFAULT_INIT_STD, seed: int = 0,
                       max_shard_size: str | None = None) -> None:
    """Writes a random-weight Qwen3-VL (`family="qwen3_vl"`), Qwen2.5-VL (`"qwen2_5_vl"`) or
    Qwen2-VL (`"qwen2_vl"`) checkpoint directory at `path`; `text_config` / `vision_config`
    override the small defaults."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig
    from transformers.utils import logging as hf_logging

    if family not in _VISION:
        raise ValueError(f"unknown Qwen-VL family {family!r}; known: {', '.join(_VISION)}")
    hf_logging.disable_progress_bar()
    tokenizer = build_qwen_tokenizer()
    config = _config(family, tokenizer, text_config, vision_config)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    fill_random(model, init_std, seed)
    text = config.text_config
    model.generation_config = GenerationConfig(eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id)
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(target), **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
    _write_processor_files(target, tokenizer, config.vision_config, min_pixels, max_pixels)
