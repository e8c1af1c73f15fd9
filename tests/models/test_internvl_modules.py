"""InternVL's tower, pixel shuffle and projector against transformers', module by module, and its
config.json read in both layouts (what mmserve refuses, it refuses by name, before any weight is read).

Three tower shapes: InternViT-300M's (LayerNorm, a bias on q, k, v; InternVL 3 / 3.5 up to 38B),
InternViT-6B's (RMSNorm, no bias, an RMSNorm over all heads' q and k, a final LayerNorm: the 78B's),
and a feature layer before the last (the layers past it are neither built nor read).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mmserve.models.hf_config import load_model_config
from mmserve.models.internvl import InternVLForConditionalGeneration, pixel_shuffle
from mmserve.models.builtin_internvl import write_internvl_own_layout
from mmserve.models.loader import load_model
from helpers.tiny_models import make_internvl_checkpoint

SIX_B = {"norm_type": "rms_norm", "use_qk_norm": True, "attention_bias": False, "use_mean_pooling": False}


def hf_features(path: str, pixels: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output


@pytest.mark.parametrize("vision, layer", [({}, -1), (SIX_B, -1), ({"num_hidden_layers": 3}, -2)],
                         ids=["internvit-300m", "internvit-6b", "feature-layer-2-of-3"])
def test_image_features_equal_transformers(tmp_path, vision, layer):
    path = make_internvl_checkpoint(tmp_path, vision_config=vision)
    if layer != -1:
        config = json.loads(Path(path, "config.json").read_text())
        config["vision_feature_layer"] = layer
        Path(path, "config.json").write_text(json.dumps(config))
    pixels = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(0))
    model = load_model(path)
    assert isinstance(model, InternVLForConditionalGeneration)
    assert len(model.model.vision_tower.encoder.layer) == model.config.feature_layer
    assert (model.model.vision_tower.layernorm is not None) == bool(vision.get("use_mean_pooling") is False)
    assert torch.equal(model.encode_tiles(pixels), hf_features(path, pixels))


def test_pixel_shuffle_equals_transformers():
    from transformers.models.internvl.modeling_internvl import InternVLModel

    features = torch.randn(2, 8, 8, 6)
    ref = InternVLModel.pixel_shuffle(None, features, scale_factor=0.5)  # type: ignore[arg-type]
    assert torch.equal(pixel_shuffle(features, 2), ref)


def test_the_config_reads_the_published_layout(tmp_path):
    path = make_internvl_checkpoint(tmp_path)
    cfg = load_model_config(path)
    assert (cfg.vision.image_size, cfg.vision.patch_size, cfg.tile_tokens) == (56, 7, 16)
    assert cfg.max_tiles == 7 and cfg.max_item_tokens == 7 * 16  # max_patches 6, plus the thumbnail
    assert cfg.tie_word_embeddings and cfg.text.qkv_bias and not cfg.text.qk_norm
    assert cfg.text.mrope_section == (cfg.text.head_dim // 2, 0, 0)


@pytest.mark.parametrize("change, message", [
    ({"text_config": {"model_type": "gpt_oss"}}, "'gpt_oss' decoder is not supported"),
    ({"vision_feature_select_strategy": "full"}, "'full' is not supported"),
    ({"downsample_ratio": 0.3}, "downsample_ratio 0.3"),
    ({"vision_config": {"image_size": [56, 28]}}, "must be square"),
    ({"vision_feature_layer": [-1, -2]}, "vision_feature_layer must be one layer"),
])
def test_what_it_cannot_serve_is_refused_by_name(tmp_path, change, message):
    source = Path(make_internvl_checkpoint(tmp_path / "src"))
    path = tmp_path / "changed"
    shutil.copytree(source, path)
    change_config(path, change)
    with pytest.raises(ValueError, match=message):
        load_model_config(str(path))


def change_config(path: Path, change: dict) -> None:
    """config.json at `path` with `change` merged in (a dict value merged into the section it names)."""
    config = json.loads((path / "config.json").read_text())
    for key, value in change.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture
def own_layout(tmp_path) -> Path:
    """A tiny InternVL in InternVL's own layout (`InternVLChatModel`); its `-hf` twin is `twin`."""
    own = tmp_path / "own"
    write_internvl_own_layout(make_internvl_checkpoint(tmp_path / "hf", max_patches=4), own)
    return own


def twin(own: Path) -> str:
    """The `-hf` checkpoint `own_layout` was written from."""
    return make_internvl_checkpoint(own.parent / "hf", max_patches=4)


def test_internvl_s_own_layout_reads_its_config(own_layout):
    cfg = load_model_config(str(own_layout))
    assert cfg.layout == "chat" and cfg.tiling == (1, 4, True) and cfg.max_tiles == 5
    assert cfg.image_token_id == 5 and cfg.tile_tokens == 16  # the tokenizer's <IMG_CONTEXT>
    assert cfg.tie_word_embeddings and cfg.text.qkv_bias  # llm_config's: a Qwen2 decoder, tied


def test_internvl_s_own_names_load_into_transformers_tree(own_layout):
    """Every tensor of the own layout finds its place (the fused qkv whole), and the features equal
    transformers' on the `-hf` twin."""
    pixels = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    model = load_model(str(own_layout))
    assert model.model.vision_tower.encoder.layer[0].attention.qkv is not None
    assert torch.equal(model.encode_tiles(pixels), hf_features(twin(own_layout), pixels))


@pytest.mark.parametrize("change, message", [
    ({"llm_config": {"architectures": ["InternLM2ForCausalLM"]}}, "InternLM2ForCausalLM is not supported"),
    ({"ps_version": "v1"}, "ps_version 'v1' is not supported"),
])
def test_what_the_own_layout_cannot_serve_is_refused_by_name(own_layout, change, message):
    change_config(own_layout, change)
    with pytest.raises(ValueError, match=message):
        load_model_config(str(own_layout))


def test_the_own_layout_needs_the_image_context_token(own_layout):
    for name in ("tokenizer_config.json", "tokenizer.json"):
        text = (own_layout / name).read_text().replace("<IMG_CONTEXT>", "<IMG_CTX>")
        (own_layout / name).write_text(text)
    with pytest.raises(ValueError, match="no <IMG_CONTEXT> token"):
        load_model_config(str(own_layout))
