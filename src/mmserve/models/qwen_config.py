"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL `config.json` (and the pixel budget of
`preprocessor_config.json`), read into plain frozen dataclasses (no torch, no transformers).

Both layouts published checkpoints use are read: Qwen2-VL's and Qwen2.5-VL's flat one (decoder
fields at the top level, `rope_scaling: {"type": "mrope", "mrope_section": [...]}`, vision
`in_chans`) and the nested one transformers 5 writes and Qwen3-VL ships (`text_config`,
`rope_parameters` or `rope_scaling` with `mrope_interleaved`). Qwen2-VL's vision config names its
width `embed_dim` and its MLP `mlp_ratio`, and its `hidden_size` is the decoder's (the merger's
output): read into the same fields as the others' `hidden_size`, `intermediate_size` and
`out_hidden_size`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from mmserve.models.hf_config import TextConfig, decoder_fields

QWEN2_VL = "qwen2_vl"
QWEN2_5_VL = "qwen2_5_vl"
QWEN3_VL = "qwen3_vl"
FAMILIES = {"Qwen2VLForConditionalGeneration": QWEN2_VL, "Qwen2_5_VLForConditionalGeneration": QWEN2_5_VL,
            "Qwen3VLForConditionalGeneration": QWEN3_VL}


@dataclass(frozen=True)
class QwenTextConfig(TextConfig):
    """A Qwen2 (QKV bias) or Qwen3 (q/k RMSNorm, no bias) decoder with M-RoPE.

    `mrope_section` splits the rotary half-dimension (Dh / 2) into temporal, height and width
    frequencies; `mrope_interleaved` (Qwen3-VL) assigns them round-robin instead of in blocks.
    """

    mrope_section: tuple[int, int, int] = (0, 0, 0)
    mrope_interleaved: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False


@dataclass(frozen=True)
class QwenVisionConfig:
    """The vision tower: patches of temporal_patch_size x patch_size², merged spatial_merge_size².

    Qwen2-VL: LayerNorm, QuickGELU MLP (fc1, fc2), full attention within each frame.
    Qwen2.5-VL: RMSNorm, gated SiLU MLP, window attention except in `fullatt_block_indexes`.
    Qwen3-VL: LayerNorm, GELU MLP, learned position embeddings interpolated to the grid, and
    deepstack mergers after the blocks in `deepstack_visual_indexes`.
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    hidden_act: str
    window_size: int = 0  # Qwen2.5-VL: window side in pixels
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: float = 2.0  # Qwen2.5-VL video positions (Qwen2-VL steps 1 per group)
    num_position_embeddings: int = 0  # Qwen3-VL
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch row of `pixel_values`: C * Tp * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2


@dataclass(frozen=True)
class QwenVLModelConfig:
    """A Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint: vision tower and decoder, and the pixel budget."""

    family: str  # QWEN2_VL | QWEN2_5_VL | QWEN3_VL
    text: QwenTextConfig
    vision: QwenVisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    tie_word_embeddings: bool
    max_pixels: int  # the image processor's default upper bound (`size.longest_edge`)

    @property
    def num_deepstack(self) -> int:
        return len(self.vision.deepstack_visual_indexes)

    @property
    def max_item_tokens(self) -> int:
        """Embedding tokens of the largest image the default processor settings produce."""
        return self.max_pixels // (self.vision.patch_size * self.vision.spatial_merge_size) ** 2


def load_qwen_config(raw: dict[str, Any], model_dir: str) -> QwenVLModelConfig:
    """`raw` is the parsed config.json of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint in `model_dir`."""
    family = next(FAMILIES[a] for a in raw["architectures"] if a in FAMILIES)
    text_raw = raw.get("text_config") or raw  # Qwen2.5-VL's published config is flat
    tie = bool(raw.get("tie_word_embeddings", False) or text_raw.get("tie_word_embeddings", False))
    return QwenVLModelConfig(
        family=family,
        text=_text_config(text_raw, family, tie),
        vision=_vision_config(raw.get("vision_config") or {}, family),
        image_token_id=raw.get("image_token_id", 151655),
        video_token_id=raw.get("video_token_id", 151656),
        vision_start_token_id=raw.get("vision_start_token_id", 151652),
        vision_end_token_id=raw.get("vision_end_token_id", 151653),
        tie_word_embeddings=tie,
        max_pixels=_max_pixels(model_dir),
    )


def _text_config(t: dict[str, Any], family: str, tie: bool) -> QwenTextConfig:
    fields = decoder_fields(t, vocab_size=151936, rope_theta=1000000.0, max_positions=32768, eos=151645)
    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    qwen3 = family == QWEN3_VL
    section = tuple(rope.get("mrope_section") or ((24, 20, 20) if qwen3 else (16, 24, 24)))  # transformers' defaults
    if len(section) != 3:
        raise ValueError(f"a {family} checkpoint needs rope mrope_section of 3 ints; got {section!r}")
    # Qwen2-VL's and Qwen2.5-VL's attention ignore a configured head_dim (transformers uses hidden / heads)
    head_dim = (t.get("head_dim") or hidden // heads) if qwen3 else hidden // heads
    if 2 * sum(section) != head_dim:
        raise ValueError(f"mrope_section {section} must sum to head_dim / 2 ({head_dim // 2})")
    if t.get("use_sliding_window"):
        raise ValueError(f"a {family} checkpoint with use_sliding_window true is not supported (no published "
                         "checkpoint sets it: every layer attends over the whole context)")
    return QwenTextConfig(
        **fields,
        head_dim=head_dim,
        attention_bias=bool(t.get("attention_bias", False)) if qwen3 else False,
        mlp_bias=False,
        tie_word_embeddings=tie,
        mrope_section=section,
        mrope_interleaved=qwen3,  # transformers' Qwen3-VL always interleaves, Qwen2(.5)-VL never does
        qk_norm=qwen3,
        qkv_bias=not qwen3 or bool(t.get("attention_bias", False)),
    )


def _vision_config(v: dict[str, Any], family: str) -> QwenVisionConfig:
    if family == QWEN2_VL:
        return _qwen2_vision_config(v)
    qwen3 = family == QWEN3_VL
    return QwenVisionConfig(
        depth=v.get("depth", 27 if qwen3 else 32),
        hidden_size=v.get("hidden_size", 1152 if qwen3 else 1280),
        intermediate_size=v.get("intermediate_size", 4304 if qwen3 else 3420),
        num_heads=v.get("num_heads", 16),
        in_channels=v.get("in_channels", v.get("in_chans", 3)),
        patch_size=v.get("patch_size", 16 if qwen3 else 14),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        out_hidden_size=v.get("out_hidden_size", 3584),
        hidden_act=v.get("hidden_act", "gelu_pytorch_tanh" if qwen3 else "silu"),
        window_size=0 if qwen3 else v.get("window_size", 112),
        fullatt_block_indexes=() if qwen3 else tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
        tokens_per_second=float(v.get("tokens_per_second", 2)),
        num_position_embeddings=v.get("num_position_embeddings", 2304) if qwen3 else 0,
        deepstack_visual_indexes=tuple(v.get("deepstack_visual_indexes", (8, 16, 24))) if qwen3 else (),
    )


def _qwen2_vision_config(v: dict[str, Any]) -> QwenVisionConfig:
    """Qwen2-VL's vision config (transformers' `Qwen2VLVisionConfig` defaults, Qwen2-VL-7B's shape):
    `embed_dim` wide, `mlp_ratio` x wider inside the MLP, `hidden_size` out."""
    width = v.get("embed_dim", 1280)
    return QwenVisionConfig(
        depth=v.get("depth", 32),
        hidden_size=width,
        intermediate_size=int(width * v.get("mlp_ratio", 4)),
        num_heads=v.get("num_heads", 16),
        in_channels=v.get("in_channels", v.get("in_chans", 3)),
        patch_size=v.get("patch_size", 14),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        out_hidden_size=v.get("hidden_size", 3584),
        hidden_act=v.get("hidden_act", "quick_gelu"),
    )


def _max_pixels(model_dir: str) -> int:
    """The image processor's `max_pixels` (`size.longest_edge` in newer files), else Qwen's 12845056."""
    path = os.path.join(model_dir, "preprocessor_config.json")
    if not os.path.isfile(path):
        return 12845056
    with open(path) as f:
        pre = json.load(f)
    size = pre.get("size") or {}
    return int(pre.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or 12845056)
