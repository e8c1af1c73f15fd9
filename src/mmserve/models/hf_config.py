"""The model's `config.json`, read into plain frozen dataclasses (no torch, no transformers).

P0 needs a few of these values (context length, image token); workers need all of them.
Both the transformers 5 layout (`rope_parameters`) and older ones (`rope_theta`) are read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from mmserve.models.internvl_config import InternVLModelConfig
    from mmserve.models.qwen_config import QwenVLModelConfig

_SUPPORTED_ARCHITECTURES = ("LlavaForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                            "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                            "InternVLForConditionalGeneration", "InternVLChatModel")


@dataclass(frozen=True)
class TextConfig:
    """A Llama decoder's shape."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    eos_token_id: int | None


@dataclass(frozen=True)
class VisionConfig:
    """A CLIP vision tower's shape."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class LlavaModelConfig:
    """A LLaVA checkpoint: vision tower, projector, Llama decoder."""

    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    vision_feature_layer: int | tuple[int, ...]
    vision_feature_select_strategy: str
    projector_hidden_act: str
    multimodal_projector_bias: bool
    tie_word_embeddings: bool

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Indices into the vision tower's hidden states (0 = embeddings), non-negative."""
        layers = self.vision_feature_layer
        layers = (layers,) if isinstance(layers, int) else layers
        n = self.vision.num_hidden_layers + 1
        return tuple(layer % n for layer in layers)

    @property
    def max_item_tokens(self) -> int:
        """Embedding tokens per image (placeholder tokens in the prompt); every image has as many."""
        cls_token = 1 if self.vision_feature_select_strategy == "full" else 0
        return self.vision.num_patches + cls_token


def load_model_config(model_dir: str) -> ModelConfig:
    """Read `model_dir/config.json` (a LLaVA, InternVL or Qwen-VL family, by `architectures`); a
    clear ValueError for what mmserve cannot serve."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir!r} has no config.json: not a Hugging Face model directory")
    with open(path) as f:
        raw = json.load(f)
    check_architecture(raw, model_dir)
    archs = raw.get("architectures") or []
    if "InternVLForConditionalGeneration" in archs:
        from mmserve.models.internvl_config import load_internvl_config

        return load_internvl_config(raw, model_dir)
    if "InternVLChatModel" in archs:
        from mmserve.models.internvl_config import load_internvl_chat_config

        return load_internvl_chat_config(raw, model_dir)
    if "LlavaForConditionalGeneration" not in archs and raw.get("model_type") != "llava":
        from mmserve.models.qwen_config import load_qwen_config

        return load_qwen_config(raw, model_dir)
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"unknown vision_feature_select_strategy {strategy!r}")
    layer = raw.get("vision_feature_layer", -2)
    return LlavaModelConfig(
        text=_text_config(raw.get("text_config") or {}),
        vision=_vision_config(raw.get("vision_config") or {}),
        image_token_id=raw.get("image_token_index", raw.get("image_token_id", 32000)),
        vision_feature_layer=layer if isinstance(layer, int) else tuple(layer),
        vision_feature_select_strategy=strategy,
        projector_hidden_act=raw.get("projector_hidden_act", "gelu"),
        multimodal_projector_bias=raw.get("multimodal_projector_bias", True),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)
                                 or (raw.get("text_config") or {}).get("tie_word_embeddings", False)),
    )


ModelConfig = Union[LlavaModelConfig, "QwenVLModelConfig", "InternVLModelConfig"]


def check_architecture(raw: dict[str, Any], name: str) -> None:
    """ValueError naming `name` unless config.json (`raw`) is a family mmserve serves."""
    archs = raw.get("architectures") or []
    if not any(a in _SUPPORTED_ARCHITECTURES for a in archs) and raw.get("model_type") != "llava":
        found = ", ".join(archs) if archs else f"model_type {raw.get('model_type')!r}"
        raise ValueError(f"{name} is a {found} checkpoint, which mmserve does not serve; it serves "
                         f"{', '.join(_SUPPORTED_ARCHITECTURES)}")


def decoder_fields(t: dict[str, Any], *, vocab_size: int, rope_theta: float, max_positions: int,
                   eos: int) -> dict[str, Any]:
    """The `TextConfig` fields every family's decoder config names alike (transformers' names; the
    family's defaults where a field is absent), but `head_dim` and the biases, which differ by family.
    The rope must be the default one, or dynamic NTK scaling, which changes nothing within
    `max_position_embeddings` (transformers scales the base only past it; `--max-model-len` may not
    go past it: engine/core.py); a ValueError names any other."""
    heads = t.get("num_attention_heads", 32)
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope", "dynamic"):  # "mrope": Qwen2-VL's old name for its sections
        raise ValueError(f"rope type {rope_type!r} is not supported yet (only 'default', and 'dynamic' within "
                         "max_position_embeddings)")
    eos_id = t.get("eos_token_id", eos)
    return dict(
        vocab_size=t.get("vocab_size", vocab_size),
        hidden_size=t.get("hidden_size", 4096),
        intermediate_size=t.get("intermediate_size", 11008),
        num_hidden_layers=t.get("num_hidden_layers", 32),
        num_attention_heads=heads,
        num_key_value_heads=t.get("num_key_value_heads") or heads,
        rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", t.get("rope_theta", rope_theta))),
        max_position_embeddings=t.get("max_position_embeddings", max_positions),
        eos_token_id=eos_id[0] if isinstance(eos_id, list) else eos_id,
    )


def _text_config(t: dict[str, Any]) -> TextConfig:
    fields = decoder_fields(t, vocab_size=32000, rope_theta=10000.0, max_positions=2048, eos=2)
    return TextConfig(
        **fields,
        head_dim=t.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"],
        attention_bias=t.get("attention_bias", False),
        mlp_bias=t.get("mlp_bias", False),
        tie_word_embeddings=t.get("tie_word_embeddings", False),
    )


def _vision_config(v: dict[str, Any]) -> VisionConfig:
    return VisionConfig(
        hidden_size=v.get("hidden_size", 1024),
        intermediate_size=v.get("intermediate_size", 4096),
        num_hidden_layers=v.get("num_hidden_layers", 24),
        num_attention_heads=v.get("num_attention_heads", 16),
        image_size=v.get("image_size", 336),
        patch_size=v.get("patch_size", 14),
        num_channels=v.get("num_channels", 3),
        layer_norm_eps=v.get("layer_norm_eps", 1e-5),
        hidden_act=v.get("hidden_act", "quick_gelu"),
    )


def eos_token_ids(model_dir: str) -> tuple[int, ...]:
    """Every EOS id generation stops at, in the file's order: generation_config.json's `eos_token_id`
    (an int or a list), else config.json's (top level, else the decoder's; transformers'
    `GenerationConfig.from_model_config`, which vLLM falls back to)."""
    path = os.path.join(model_dir, "generation_config.json")
    eos: Any = None
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
        eos = raw.get("eos_token_id", (raw.get("text_config") or {}).get("eos_token_id"))
    if eos is None:
        eos = load_model_config(model_dir).text.eos_token_id  # the family's default
    ids = [eos] if isinstance(eos, int) else list(eos or ())
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))


def eos_token_id(model_dir: str) -> int | None:
    """The engine's primary EOS id: the first of `eos_token_ids` (the others stop generation as
    stop token ids, `models/generation_config.py`)."""
    ids = eos_token_ids(model_dir)
    return ids[0] if ids else None
