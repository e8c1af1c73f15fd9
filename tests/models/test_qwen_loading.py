"""Qwen-VL checkpoints in the layouts they are published in: sharded safetensors with an index,
and Qwen2-VL's and Qwen2.5-VL's older form (`visual.*`, `model.layers.*`, written by transformers
4.4x, with a flat config.json: decoder fields at the top level, `rope_scaling` of type mrope, the
vision `in_chans`; Qwen2-VL's without `hidden_act`, whose default is QuickGELU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmserve.models.hf_config import load_model_config
from mmserve.models.loader import load_model
from helpers.tiny_models import make_qwen_checkpoint

OLD_NAMES = (("model.visual.", "visual."), ("model.language_model.", "model."))


def _old_layout(src: str, dst: Path) -> None:
    """A copy of `src` whose tensors carry the 4.49 names, in two shards with an index."""
    shutil.copytree(src, dst)
    tensors = {}
    for file in sorted(dst.glob("*.safetensors")):
        tensors.update(load_file(file))
        file.unlink()
    for index in dst.glob("*.index.json"):
        index.unlink()
    renamed = {}
    for name, tensor in tensors.items():
        for new, old in OLD_NAMES:
            if name.startswith(new):
                name = old + name[len(new):]
                break
        renamed[name] = tensor
    names = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: renamed[n].contiguous() for n in part}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _flat_config(dst / "config.json")


def _flat_config(path: Path) -> None:
    """config.json rewritten as Qwen2-VL-7B-Instruct and Qwen2.5-VL-7B-Instruct publish theirs."""
    raw = json.loads(path.read_text())
    text = raw.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**raw, **{k: v for k, v in text.items() if k not in ("model_type", "dtype", "layer_types")},
            "rope_theta": rope["rope_theta"], "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    vision = flat["vision_config"]
    vision["in_chans"] = vision.pop("in_channels")
    if raw["model_type"] == "qwen2_vl":
        assert vision.pop("hidden_act") == "quick_gelu"
    path.write_text(json.dumps(flat))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_sharded_and_old_layouts_load_the_same_weights(family, tmp_path):
    base = make_qwen_checkpoint(tmp_path / "new", family=family)
    sharded = make_qwen_checkpoint(tmp_path / "sharded", family=family, max_shard_size="200KB")
    assert len(list(Path(sharded).glob("*.safetensors"))) > 1
    assert (Path(sharded) / "model.safetensors.index.json").is_file()
    _old_layout(base, tmp_path / "old")
    assert "text_config" not in json.loads((tmp_path / "old" / "config.json").read_text())
    assert load_model_config(str(tmp_path / "old")) == load_model_config(base)
    reference = dict(load_model(base).named_parameters())
    for path in (sharded, str(tmp_path / "old")):
        params = dict(load_model(path).named_parameters())
        assert params.keys() == reference.keys()
        assert all(torch.equal(params[name], reference[name]) for name in reference)


def test_a_tensor_with_no_place_is_a_clear_error(tmp_path):
    path = tmp_path / "extra"
    shutil.copytree(make_qwen_checkpoint(tmp_path / "src", family="qwen3_vl"), path)
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    tensors["model.visual.blocks.99.attn.qkv.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(file), metadata={"format": "pt"})
    try:
        load_model(str(path))
    except ValueError as e:
        assert "no place in the model" in str(e)
    else:
        raise AssertionError("an unknown tensor loaded silently")
