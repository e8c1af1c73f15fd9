"""The tiny Qwen-VL checkpoints: published layout, transformers loads them, deterministic bytes,
and greedy outputs that follow the image."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration,
                          Qwen3VLForConditionalGeneration)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mmserve.ipc.pixel_codes import pixel_values
from mmserve.models.builtin import resolve_model
from mmserve.models.builtin_qwen_vl import SPECIAL_TOKENS, write_tiny_qwen_vl
from mmserve.multimodal.qwen_processor import QwenVLProcessor
from helpers.tiny_models import make_image, make_qwen_checkpoint

HF_CLASS = {"qwen3_vl": Qwen3VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
            "qwen2_vl": Qwen2VLForConditionalGeneration}
ARCHITECTURE = {family: cls.__name__ for family, cls in HF_CLASS.items()}
# Small enough that writing, loading and generating take a fraction of a second.
SMALL = {
    "qwen3_vl": dict(text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1),
                     vision_config=dict(depth=2, hidden_size=32, intermediate_size=64),
                     min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 64),
    "qwen2_5_vl": dict(text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2,
                                        num_key_value_heads=1),
                       vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, fullatt_block_indexes=[1]),
                       min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64),
    "qwen2_vl": dict(text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1),
                     vision_config=dict(depth=2, embed_dim=32, mlp_ratio=2),
                     min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64),
}


def read_files(path: str | Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(Path(path).iterdir())}


def greedy(path: str, image, max_new_tokens: int = 12) -> list[int]:
    """transformers' greedy continuation of a one-image chat prompt (built by our processor,
    which tests/multimodal/test_qwen_processing.py holds equal to transformers')."""
    processor = QwenVLProcessor(path)
    model = HF_CLASS[json.loads((Path(path) / "config.json").read_text())["model_type"]].from_pretrained(
        path, dtype=torch.float32).eval()
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                          {"type": "text", "text": "What is this?"}]}])
    data = processor.process_image(image)
    ids, _ = processor.expand(prompt, [processor.num_placeholder_tokens(data)])
    ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             mm_token_type_ids=(ids == processor.image_token_id).long(),  # else no M-RoPE
                             pixel_values=pixel_values(data), image_grid_thw=data["image_grid_thw"][None],
                             max_new_tokens=max_new_tokens)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", list(SMALL))
def test_same_arguments_write_byte_identical_files(family, tmp_path):
    kwargs = dict(SMALL[family], family=family, max_shard_size="100KB")
    write_tiny_qwen_vl(tmp_path / "a", **kwargs)
    write_tiny_qwen_vl(tmp_path / "b", **kwargs)
    write_tiny_qwen_vl(tmp_path / "seed", **kwargs, seed=1)
    a, b, seeded = read_files(tmp_path / "a"), read_files(tmp_path / "b"), read_files(tmp_path / "seed")
    assert a == b
    assert "model.safetensors.index.json" in a and sum(name.endswith(".safetensors") for name in a) > 1
    assert {n for n in a if a[n] != seeded[n]} <= {n for n in a if n.endswith(".safetensors")}
    assert a.keys() == seeded.keys() and a != seeded


def test_builtin_name_writes_the_qwen3_default(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSERVE_CACHE", str(tmp_path / "cache"))
    path = resolve_model("builtin:tiny-qwen3-vl")
    assert resolve_model("builtin:tiny-qwen3-vl") == path
    write_tiny_qwen_vl(tmp_path / "direct")
    assert read_files(path) == read_files(tmp_path / "direct")
    assert json.loads((Path(path) / "config.json").read_text())["architectures"] == [ARCHITECTURE["qwen3_vl"]]


@pytest.mark.parametrize("family", list(SMALL))
def test_the_published_layout(family, tmp_path):
    path = Path(make_qwen_checkpoint(tmp_path, family=family, **SMALL[family]))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "preprocessor_config.json",
            "video_preprocessor_config.json"} <= set(read_files(path))
    config = json.loads((path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    assert config["architectures"] == [ARCHITECTURE[family]] and config["model_type"] == family
    named = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    assert (config["image_token_id"], config["video_token_id"], config["vision_start_token_id"],
            config["vision_end_token_id"]) == tuple(ids[t] for t in named)
    text = config["text_config"]
    assert text["vocab_size"] % 64 == 0 and text["vocab_size"] >= len(tokenizer)
    assert (text["eos_token_id"], text["pad_token_id"]) == (ids["<|im_end|>"], ids["<|endoftext|>"])
    generation = json.loads((path / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (ids["<|im_end|>"], ids["<|endoftext|>"])
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    for token in SPECIAL_TOKENS:  # each one id, and no BOS is added
        assert tokenizer(token)["input_ids"] == [ids[token]]


@pytest.mark.parametrize("family", list(SMALL))
def test_the_processor_configs_carry_the_vision_settings(family, tmp_path):
    path = Path(make_qwen_checkpoint(tmp_path, family=family, **SMALL[family]))
    vision = json.loads((path / "config.json").read_text())["vision_config"]
    size = {"shortest_edge": SMALL[family]["min_pixels"], "longest_edge": SMALL[family]["max_pixels"]}
    fields = {"patch_size": vision["patch_size"], "temporal_patch_size": vision["temporal_patch_size"],
              "merge_size": vision["spatial_merge_size"], "size": size}
    assert vision["patch_size"] == (16 if family == "qwen3_vl" else 14)
    image = json.loads((path / "preprocessor_config.json").read_text())
    assert image["image_processor_type"] == "Qwen2VLImageProcessor" and fields.items() <= image.items()
    video = json.loads((path / "video_preprocessor_config.json").read_text())
    assert fields.items() <= video.items() and video["fps"] == 2 and 0 < video["min_frames"] <= video["max_frames"]
    loaded = Qwen2VLImageProcessorPil.from_pretrained(path)
    assert (loaded.patch_size, loaded.temporal_patch_size, loaded.merge_size) == tuple(list(fields.values())[:3])
    assert (loaded.size["shortest_edge"], loaded.size["longest_edge"]) == tuple(size.values())


@pytest.mark.parametrize("family", list(SMALL))
def test_transformers_loads_every_weight(family, tmp_path):
    path = make_qwen_checkpoint(tmp_path / "one", family=family, **SMALL[family])
    sharded = make_qwen_checkpoint(tmp_path / "sharded", family=family, max_shard_size="100KB", **SMALL[family])
    model, info = HF_CLASS[family].from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    again = dict(HF_CLASS[family].from_pretrained(sharded, dtype=torch.float32).named_parameters())
    assert all(torch.equal(param, again[name]) for name, param in model.named_parameters())


def test_rope_follows_an_overridden_head_dim(tmp_path):
    """M-RoPE's section must sum to head_dim / 2, else the checkpoint does not run."""
    for family, text in (("qwen3_vl", dict(head_dim=16)), ("qwen2_5_vl", dict(hidden_size=64, num_attention_heads=2))):
        kwargs = dict(SMALL[family], text_config={**SMALL[family]["text_config"], **text})
        path = make_qwen_checkpoint(tmp_path, family=family, **kwargs)
        rope = json.loads((Path(path) / "config.json").read_text())["text_config"]["rope_parameters"]
        assert 2 * sum(rope["mrope_section"]) == (16 if family == "qwen3_vl" else 32)
        assert rope.get("mrope_interleaved", False) == (family == "qwen3_vl")
        assert len(greedy(path, make_image(0, (64, 64)), max_new_tokens=2)) == 2


@pytest.mark.parametrize("variant", ["qwen3_vl", "qwen2_5_vl", "qwen2_vl", "builtin"])
def test_greedy_outputs_follow_the_image(variant, tmp_path):
    """The init std makes outputs depend on the image and not repeat one token (else the
    parity tests could pass with the image ignored)."""
    if variant == "builtin":
        path = make_qwen_checkpoint(tmp_path)
    else:
        path = make_qwen_checkpoint(tmp_path, family=variant, **SMALL[variant])
    outputs = [greedy(path, make_image(seed, (64, 64))) for seed in (0, 2)]
    assert outputs[0] != outputs[1]
    assert all(len(set(out)) > 3 for out in outputs)


def test_bad_arguments_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown Qwen-VL family"):
        write_tiny_qwen_vl(tmp_path / "x", family="qwen1_vl")
    with pytest.raises(ValueError, match="vocab_size"):
        write_tiny_qwen_vl(tmp_path / "y", text_config=dict(vocab_size=64))
