"""The built-in tiny LLaVA: deterministic, loadable by transformers, image-dependent outputs."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmserve.models import builtin
from mmserve.models.builtin import BUILTIN_PREFIX, resolve_model, write_tiny_llava
from helpers.tiny_models import make_checkpoint, make_image

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("tiny"))


def greedy(path: str, image, max_new_tokens: int = 20) -> list[int]:
    model = LlavaForConditionalGeneration.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    inputs = processor(text=PROMPT, images=image, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_tokenizer_training_is_deterministic():
    first = builtin.tokenizer_json.__wrapped__()
    assert builtin.tokenizer_json.__wrapped__() == first
    tokenizer = builtin.build_tokenizer()
    assert 1000 <= len(tokenizer) <= 2000
    assert [tokenizer.convert_tokens_to_ids(t) for t in builtin.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    ids = tokenizer("USER: <image>\nhello world").input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(4) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "USER: \nhello world"


def test_same_arguments_give_byte_identical_files(tmp_path):
    kwargs = dict(text_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=2, num_hidden_layers=1),
                  vision_config=dict(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                     num_hidden_layers=1, image_size=28))
    rng_before = torch.get_rng_state()
    write_tiny_llava(tmp_path / "a", **kwargs)
    write_tiny_llava(tmp_path / "b", **kwargs)
    write_tiny_llava(tmp_path / "c", seed=1, **kwargs)
    assert torch.equal(torch.get_rng_state(), rng_before), "global RNG state must not change"
    names = sorted(os.listdir(tmp_path / "a"))
    assert "model.safetensors" in names and names == sorted(os.listdir(tmp_path / "b"))
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    weights = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert weights != (tmp_path / "c" / "model.safetensors").read_bytes()


def test_transformers_loads_model_and_processor(tiny):
    model = LlavaForConditionalGeneration.from_pretrained(tiny)
    processor = AutoProcessor.from_pretrained(tiny)
    config = model.config
    assert type(processor).__name__ == "LlavaProcessor"
    assert processor.image_token_id == config.image_token_id
    assert len(processor.tokenizer) <= config.text_config.vocab_size
    assert model.generation_config.eos_token_id == processor.tokenizer.eos_token_id
    assert Path(tiny, "processor_config.json").is_file()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    assert processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == PROMPT
    text_only = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                 {"role": "user", "content": "Bye"}]
    rendered = processor.apply_chat_template(text_only, add_generation_prompt=True, tokenize=False)
    assert rendered == "USER: Hi ASSISTANT: Hello.</s>USER: Bye ASSISTANT:"


def test_greedy_outputs_vary_and_depend_on_the_image(tiny):
    first, second = greedy(tiny, make_image(0)), greedy(tiny, make_image(1))
    assert first != second
    for out in (first, second):
        assert max(Counter(out).values()) < len(out) // 2, out


@pytest.mark.parametrize("strategy,layer,patch", [("full", -1, 7), ("default", -2, 14)])
def test_variants_load_and_generate(tmp_path, strategy, layer, patch):
    path = make_checkpoint(tmp_path, vision_feature_select_strategy=strategy, vision_feature_layer=layer,
                           text_config=dict(num_key_value_heads=4), vision_config=dict(image_size=28, patch_size=patch))
    processor = AutoProcessor.from_pretrained(path)
    ids = processor(text=PROMPT, images=make_image(0), return_tensors="pt")["input_ids"][0]
    grid = (28 // patch) ** 2
    assert int((ids == processor.image_token_id).sum()) == grid + (1 if strategy == "full" else 0)
    assert greedy(path, make_image(0), 5) != greedy(path, make_image(1), 5)


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, tiny):
    sharded = Path(make_checkpoint(tmp_path, max_shard_size="200KB"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    whole = LlavaForConditionalGeneration.from_pretrained(tiny).state_dict()
    parts = LlavaForConditionalGeneration.from_pretrained(sharded).state_dict()
    assert whole.keys() == parts.keys()
    assert all(torch.equal(whole[k], parts[k]) for k in whole)


def test_resolve_builtin_creates_once_under_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSERVE_CACHE", str(tmp_path))
    path = resolve_model(BUILTIN_PREFIX + "tiny-llava")
    assert Path(path).parent.parent == tmp_path
    config = json.loads(Path(path, "config.json").read_text())
    assert config["vision_config"]["image_size"] == 336 and config["vision_config"]["patch_size"] == 28
    assert config["text_config"]["num_key_value_heads"] == 4
    processor = AutoProcessor.from_pretrained(path)
    ids = processor(text=PROMPT, images=make_image(0), return_tensors="pt")["input_ids"][0]
    assert int((ids == processor.image_token_id).sum()) == 144
    mtime = Path(path, "model.safetensors").stat().st_mtime_ns
    assert resolve_model(BUILTIN_PREFIX + "tiny-llava") == path
    assert Path(path, "model.safetensors").stat().st_mtime_ns == mtime
    assert os.listdir(Path(path).parent) == [Path(path).name], "no staging folder left behind"


def test_resolve_builtin_tolerates_a_concurrent_creator(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSERVE_CACHE", str(tmp_path))
    target = tmp_path / "builtin" / f"tiny-llava-{builtin.BUILTIN_VERSION}"
    real_write = builtin.write_tiny_llava

    def write_and_lose_the_race(path, **kwargs):
        real_write(path, **kwargs)
        real_write(target, **kwargs)  # another process finishes first

    monkeypatch.setattr(builtin, "write_tiny_llava", write_and_lose_the_race)
    assert resolve_model("builtin:tiny-llava") == str(target)
    assert os.listdir(target.parent) == [target.name]


def test_resolve_directory_and_bad_names(tmp_path):
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="unknown built-in model 'builtin:huge'"):
        resolve_model("builtin:huge")
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model(str(tmp_path / "file"))
