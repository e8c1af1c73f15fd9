"""`--hf-overrides` / `LLM(hf_overrides=...)` (vLLM's): values over a checkpoint's config.json, merged
as vLLM merges them and read by every process through a directory of links (models/hf_overrides.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from mmserve import LLM, SamplingParams
from mmserve.config import ModelConfig
from mmserve.models.hf_overrides import merged, overridden_dir
from mmserve.models.hub import locate
from helpers.tiny_models import make_image, make_qwen_checkpoint

pytestmark = pytest.mark.slow  # starts engine cores (deselect with -m 'not slow')

PADS = "<|vision_start|><|image_pad|><|vision_end|>"
ITEMS = [{"prompt": f"<|im_start|>user\n{PADS}What is this?<|im_end|>\n<|im_start|>assistant\n",
          "multi_modal_data": {"image": make_image(0, (64, 48))}}]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSERVE_CACHE", str(tmp_path / "mmserve-cache"))


def test_sub_configs_merge_key_by_key_and_everything_else_is_replaced():
    raw = {"architectures": ["A"], "rope_scaling": {"type": "mrope", "mrope_section": [1, 2, 3]},
           "text_config": {"hidden_size": 8, "max_position_embeddings": 32, "rope_parameters": {"rope_theta": 1.0}},
           "vision_config": {"depth": 2}}
    out = merged(raw, {"architectures": ["B"], "rope_scaling": {"type": "default"}, "max_position_embeddings": 64,
                       "text_config": {"max_position_embeddings": 128, "rope_parameters": {"rope_type": "x"}}})
    assert out == {"architectures": ["B"], "rope_scaling": {"type": "default"}, "max_position_embeddings": 64,
                   "text_config": {"hidden_size": 8, "max_position_embeddings": 128,
                                   "rope_parameters": {"rope_type": "x"}},  # a plain dict inside: replaced
                   "vision_config": {"depth": 2}}
    assert raw["text_config"]["max_position_embeddings"] == 32  # the input is not changed


def test_the_overridden_directory_links_every_other_file_and_is_made_once(tmp_path):
    source = make_qwen_checkpoint(tmp_path / "src", family="qwen2_vl")
    overrides = {"text_config": {"max_position_embeddings": 96}}
    path = overridden_dir(source, overrides)
    files = sorted(os.listdir(path))
    assert files == sorted(os.listdir(source))
    assert all(os.path.islink(os.path.join(path, f)) for f in files if f != "config.json")
    config = json.loads(Path(path, "config.json").read_text())
    assert config["text_config"]["max_position_embeddings"] == 96
    assert config["vision_config"] == json.loads(Path(source, "config.json").read_text())["vision_config"]
    assert overridden_dir(source, overrides) == path  # reused
    assert overridden_dir(source, {"text_config": {"max_position_embeddings": 97}}) != path
    copy = Path(shutil.copytree(source, tmp_path / "copy"))
    first = overridden_dir(str(copy), overrides)
    assert first != path  # another checkpoint
    (copy / "config.json").write_text(json.dumps({**config, "edited": True}))
    assert overridden_dir(str(copy), overrides) != first  # its config.json changed since


def test_a_fine_tunes_own_architecture_name_is_served_as_the_family_it_names(tmp_path):
    """A fine-tune that saved its own class name: refused as it is, served with vLLM's usual
    `--hf-overrides '{"architectures": [...]}'` and answering as the original checkpoint does."""
    source = make_qwen_checkpoint(tmp_path / "src", family="qwen2_vl")
    renamed = Path(shutil.copytree(source, tmp_path / "fine-tune"))
    config = json.loads((renamed / "config.json").read_text())
    (renamed / "config.json").write_text(json.dumps({**config, "architectures": ["MyAgentQwen2VL"]}))
    with pytest.raises(ValueError, match="MyAgentQwen2VL checkpoint, which mmserve does not serve"):
        locate(ModelConfig(model=str(renamed)))
    params = SamplingParams(temperature=0.0, max_tokens=6)
    want = LLM(model=source).generate(ITEMS, params)[0].outputs[0].token_ids
    llm = LLM(model=str(renamed), hf_overrides={"architectures": ["Qwen2VLForConditionalGeneration"]})
    assert llm.generate(ITEMS, params)[0].outputs[0].token_ids == want


def test_a_longer_context_is_allowed_once_the_config_says_so(tmp_path):
    """vLLM's other common use: max_position_embeddings raised, then --max-model-len up to it."""
    source = make_qwen_checkpoint(tmp_path / "src", family="qwen2_vl")  # 8192 positions
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        LLM(model=source, max_model_len=10000)
    llm = LLM(model=source, max_model_len=10000, hf_overrides={"text_config": {"max_position_embeddings": 16384}})
    assert llm.engine.core.max_model_len == 10000
    assert len(llm.generate(ITEMS, SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_overrides_that_are_not_an_object_are_refused():
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        ModelConfig(hf_overrides=["architectures"])  # type: ignore[arg-type]
