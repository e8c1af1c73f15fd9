"""InternVL's `config.json`, read into plain frozen dataclasses (no torch, no transformers), in
either layout its checkpoints are published in:

- transformers' (`InternVLForConditionalGeneration`: the `-hf` repos of InternVL 3 and 3.5), its
  tile limit in `preprocessor_config.json`;
- InternVL's own (`InternVLChatModel`, remote code: `OpenGVLab/InternVL3-8B`, `InternVL3_5-8B`, their
  AWQ quantizations): `llm_config`, a `vision_config` with InternViT's own names (`qkv_bias`,
  `qk_normalization`), `select_layer`, `ps_version`, and the tiling (`max_dynamic_patch`,
  `use_thumbnail`) in config.json itself; the image token's id is the tokenizer's.

The weights are the same in both (transformers' conversion renames them and splits the fused
`qkv`), and so is the arithmetic; `InternVLModelConfig.layout` says which names to read.

The decoder is a Qwen2 (InternVL 3), Qwen3 (InternVL 3.5) or Llama one with 1-D rotary positions:
read into `QwenTextConfig`, whose attention covers all three (a bias on q, k, v; q / k RMSNorm),
with one rotary section (every frequency on the one axis, which 1-D positions drive).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any

from mmserve.models.hf_config import decoder_fields
from mmserve.models.qwen_config import QwenTextConfig

TEXT_MODEL_TYPES = ("qwen2", "qwen3", "llama")
HF, CHAT = "hf", "chat"
# InternVL's own names for its decoder classes (its `llm_config.architectures`)
_LLM_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}


@dataclass(frozen=True)
class InternVisionConfig:
    """InternViT: a ViT over square tiles with a CLS token, learned positions and layer scales."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int  # a tile's side in pixels
    patch_size: int
    num_channels: int
    attention_bias: bool
    use_qk_norm: bool  # RMSNorm over all heads' q and k (InternViT-6B)
    norm_type: str  # "layer_norm" | "rms_norm"
    layer_norm_eps: float
    hidden_act: str
    use_mean_pooling: bool  # False: a final LayerNorm on the last layer's output

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid(self) -> int:
        """Patches per side of a tile."""
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class InternVLModelConfig:
    """An InternVL checkpoint: InternViT, the pixel-shuffle projector, a decoder."""

    text: QwenTextConfig
    vision: InternVisionConfig
    image_token_id: int
    downsample_ratio: float
    projector_hidden_act: str
    vision_feature_layer: int
    vision_feature_select_strategy: str
    tie_word_embeddings: bool
    # the default tiling: (min tiles, max tiles, thumbnail after several); HF: preprocessor_config.json's
    # `min_patches` / `max_patches` (transformers' InternVL processor always crops, with a thumbnail);
    # CHAT: config.json's `min_dynamic_patch` / `max_dynamic_patch` / `use_thumbnail`
    tiling: tuple[int, int, bool]
    layout: str = HF  # HF: transformers' names and files; CHAT: InternVL's own (`InternVLChatModel`)

    @property
    def scale(self) -> int:
        """The pixel shuffle's factor: a tile's grid shrinks by it per side, its width grows by its square."""
        return round(1 / self.downsample_ratio)

    @property
    def tile_tokens(self) -> int:
        """Embedding rows (placeholder tokens) per tile."""
        return (self.vision.grid // self.scale) ** 2

    @property
    def feature_layer(self) -> int:
        """The tower's layer whose output is taken (1..L; L: the last, with its final norm if any)."""
        return self.vision_feature_layer % (self.vision.num_hidden_layers + 1)

    @property
    def max_tiles(self) -> int:
        """Tiles of the largest image under the default tiling, the thumbnail included."""
        _, high, thumbnail = self.tiling
        return high + 1 if thumbnail and high > 1 else high

    @property
    def max_item_tokens(self) -> int:
        return self.max_tiles * self.tile_tokens


def load_internvl_config(raw: dict[str, Any], model_dir: str) -> InternVLModelConfig:
    """`raw` is the parsed config.json of an InternVL checkpoint in `model_dir`; a ValueError names
    what mmserve does not serve."""
    vision = _vision_config(raw.get("vision_config") or {})
    ratio = float(raw.get("downsample_ratio", 0.5))
    scale = round(1 / ratio) if ratio > 0 else 0
    if scale < 1 or abs(scale * ratio - 1) > 1e-6 or vision.grid % scale:
        raise ValueError(f"downsample_ratio {ratio} must be 1 / n for an n that divides the tile's "
                         f"{vision.grid} patches per side")
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"unknown vision_feature_select_strategy {strategy!r}")
    if strategy == "full":
        raise ValueError("vision_feature_select_strategy 'full' is not supported for InternVL (its pixel "
                         "shuffle needs a square grid of patches, without the CLS token)")
    layer = raw.get("vision_feature_layer", -1)
    if not isinstance(layer, int) or layer % (vision.num_hidden_layers + 1) == 0:
        raise ValueError(f"vision_feature_layer must be one layer of the tower; got {layer!r}")
    tie = bool(raw.get("tie_word_embeddings", True))  # transformers 5 ties by the top level (default True)
    return InternVLModelConfig(
        text=_text_config(raw.get("text_config") or {}, tie),
        vision=vision,
        image_token_id=int(raw.get("image_token_id", 151667)),
        downsample_ratio=ratio,
        projector_hidden_act=raw.get("projector_hidden_act", "gelu"),
        vision_feature_layer=layer,
        vision_feature_select_strategy=strategy,
        tie_word_embeddings=tie,
        tiling=_preprocessor_tiling(model_dir),
    )


def load_internvl_chat_config(raw: dict[str, Any], model_dir: str) -> InternVLModelConfig:
    """`raw` is the parsed config.json of an `InternVLChatModel` checkpoint (InternVL's own layout)."""
    llm = dict(raw.get("llm_config") or {})
    archs = llm.get("architectures") or []
    kind = next((_LLM_ARCHITECTURES[a] for a in archs if a in _LLM_ARCHITECTURES), None)
    if kind is None:
        raise ValueError(f"an InternVL checkpoint whose decoder is {', '.join(archs) or 'unnamed'} is not supported; "
                         f"supported: {', '.join(_LLM_ARCHITECTURES)}")
    if raw.get("ps_version", "v2") != "v2":
        raise ValueError(f"ps_version {raw.get('ps_version')!r} is not supported (only InternVL's 'v2' pixel shuffle)")
    v = dict(raw.get("vision_config") or {})
    vision = {**v, "attention_bias": v.get("qkv_bias", True), "use_qk_norm": v.get("qk_normalization", False),
              "use_mean_pooling": True}  # InternVL's tower has no final norm
    image_size = raw.get("force_image_size") or v.get("image_size", 448)
    low, high = int(raw.get("min_dynamic_patch", 1)), int(raw.get("max_dynamic_patch", 12))
    thumbnail = bool(raw.get("use_thumbnail", True))
    if not raw.get("dynamic_image_size", True):
        low = high = 1
    hf_layout = {"vision_config": {**vision, "image_size": image_size},
                 "text_config": {**llm, "model_type": kind},
                 "downsample_ratio": raw.get("downsample_ratio", 0.5),
                 "vision_feature_layer": raw.get("select_layer", -1),
                 "projector_hidden_act": "gelu", "image_token_id": _image_token_id(model_dir),
                 "tie_word_embeddings": bool(llm.get("tie_word_embeddings", False))}
    return replace(load_internvl_config(hf_layout, model_dir), layout=CHAT, tiling=(low, high, thumbnail))


def _image_token_id(model_dir: str) -> int:
    """`<IMG_CONTEXT>`'s id, from the tokenizer's added tokens (InternVL's config does not name it):
    `tokenizer_config.json`'s `added_tokens_decoder`, `added_tokens.json` or `tokenizer.json`'s list."""
    def read(name: str) -> Any:
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    decoder = (read("tokenizer_config.json") or {}).get("added_tokens_decoder") or {}
    found = {token.get("content"): int(i) for i, token in decoder.items()}
    found.update((read("added_tokens.json") or {}).items())
    listed = (read("tokenizer.json") or {}).get("added_tokens", [])
    found.update({token.get("content"): int(token["id"]) for token in listed})
    if "<IMG_CONTEXT>" not in found:
        raise ValueError(f"{model_dir!r}: the tokenizer has no <IMG_CONTEXT> token, which InternVL's prompts need")
    return int(found["<IMG_CONTEXT>"])


def _side(value: Any, what: str) -> int:
    """A square size from an int or a [height, width] pair."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"InternVL's vision {what} must be square; got {value!r}")
        value = value[0]
    return int(value)


def _vision_config(v: dict[str, Any]) -> InternVisionConfig:
    norm = v.get("norm_type", "layer_norm")
    if norm not in ("layer_norm", "rms_norm"):
        raise ValueError(f"unknown InternVL vision norm_type {norm!r}")
    if not v.get("use_absolute_position_embeddings", True):
        raise ValueError("an InternVL tower without absolute position embeddings is not supported")
    return InternVisionConfig(
        hidden_size=v.get("hidden_size", 1024),
        intermediate_size=v.get("intermediate_size", 4096),
        num_hidden_layers=v.get("num_hidden_layers", 24),
        num_attention_heads=v.get("num_attention_heads", 16),
        image_size=_side(v.get("image_size", 448), "image_size"),
        patch_size=_side(v.get("patch_size", 14), "patch_size"),
        num_channels=v.get("num_channels", 3),
        attention_bias=bool(v.get("attention_bias", False)),
        use_qk_norm=bool(v.get("use_qk_norm", False)),
        norm_type=norm,
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        hidden_act=v.get("hidden_act", "gelu"),
        use_mean_pooling=bool(v.get("use_mean_pooling", True)),
    )


def _text_config(t: dict[str, Any], tie: bool) -> QwenTextConfig:
    kind = t.get("model_type", "qwen2")
    if kind not in TEXT_MODEL_TYPES:
        raise ValueError(f"an InternVL checkpoint with a {kind!r} decoder is not supported; supported: "
                         f"{', '.join(TEXT_MODEL_TYPES)}")
    if t.get("use_sliding_window"):
        raise ValueError("an InternVL decoder with use_sliding_window true is not supported")
    fields = decoder_fields(t, vocab_size=151674, rope_theta=1000000.0, max_positions=32768, eos=151645)
    head_dim = t.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    bias = bool(t.get("attention_bias", False))
    return QwenTextConfig(
        **fields,
        head_dim=head_dim,
        attention_bias=bias if kind != "qwen2" else False,  # o_proj's
        mlp_bias=bool(t.get("mlp_bias", False)) if kind == "llama" else False,
        tie_word_embeddings=tie,
        mrope_section=(head_dim // 2, 0, 0),  # 1-D positions: every frequency on the first axis
        mrope_interleaved=False,
        qk_norm=kind == "qwen3",
        qkv_bias=kind == "qwen2" or bias,
    )


def _preprocessor_tiling(model_dir: str) -> tuple[int, int, bool]:
    """transformers' layout: the image processor's `min_patches` / `max_patches` (its class defaults,
    1 and 12, where the file is silent), a thumbnail after several tiles."""
    path = os.path.join(model_dir, "preprocessor_config.json")
    pre: dict[str, Any] = {}
    if os.path.isfile(path):
        with open(path) as f:
            pre = json.load(f)
    return int(pre.get("min_patches", 1)), int(pre.get("max_patches", 12)), True
