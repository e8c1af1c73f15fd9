"""Qwen-VL checkpoints in the layouts they are published in: sharded safetensors with an index,
and Qwen2.5-VL's older names (`visual.*`, `model.layers.*`, written by transformers 4.49)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

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


def test_sharded_and_old_layouts_load_the_same_weights(tmp_path):
    base = make_qwen_checkpoint(tmp_path / "new", family="qwen2_5_vl")
    sharded = make_qwen_checkpoint(tmp_path / "sharded", family="qwen2_5_vl", max_shard_size="200KB")
    assert len(list(Path(sharded).glob("*.safetensors"))) > 1
    assert (Path(sharded) / "model.safetensors.index.json").is_file()
    _old_layout(base, tmp_path / "old")
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
