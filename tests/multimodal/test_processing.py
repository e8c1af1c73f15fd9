"""Input processing: token ids and pixels equal LlavaProcessor's; placeholders; bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from mmserve.ipc.pixel_codes import pixel_values
from mmserve.multimodal.processing import MultiModalProcessor, ProcessedPrompt
from helpers.tiny_models import make_checkpoint, make_image


@pytest.fixture(scope="module", params=["default-p14", "full-p8"])
def checkpoint(request, tmp_path_factory) -> str:
    variants = {
        "default-p14": {},
        "full-p8": dict(vision_feature_select_strategy="full", vision_config=dict(image_size=32, patch_size=8)),
    }
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), **variants[request.param])


@pytest.fixture(scope="module")
def processors(checkpoint) -> tuple[MultiModalProcessor, object]:
    return MultiModalProcessor(checkpoint), AutoProcessor.from_pretrained(checkpoint)


def transparent_image() -> Image.Image:
    image = make_image(5, (30, 50), mode="RGBA")
    alpha = np.zeros((50, 30), dtype=np.uint8)
    alpha[:, 15:] = 255
    image.putalpha(Image.fromarray(alpha))
    return image


CASES = {
    "text-only": ("USER: hello there ASSISTANT:", []),
    "one": ("USER: <image>\nWhat is this? ASSISTANT:", [make_image(0, (40, 40))]),
    "two": ("USER: compare <image> and <image> please ASSISTANT:", [make_image(0), make_image(1, (64, 48))]),
    "odd-sizes": ("<image>x<image>\n", [make_image(2, (17, 93)), make_image(3, (300, 20))]),
    "adjacent": ("<image><image>", [make_image(4, (20, 20)), make_image(5, (50, 30))]),
    "modes": ("A <image> B <image> C <image>", [make_image(6, mode="L"), make_image(7, mode="P"),
                                                transparent_image()]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_token_ids_and_pixels_equal_llava_processor(processors, case):
    ours, hf = processors
    prompt, images = CASES[case]
    got = ours.process(prompt, images)
    want = hf(text=prompt, images=images or None, return_tensors="pt")
    assert got.prompt_token_ids == want["input_ids"][0].tolist()
    assert len(got.mm_items) == len(images)
    for i, item in enumerate(got.mm_items):
        pixels = pixel_values(item.data)
        assert item.data["pixel_codes"].dtype == torch.uint8 and pixels.dtype == torch.float32 and pixels.dim() == 3
        assert torch.equal(pixels, want["pixel_values"][i])


@pytest.mark.parametrize("case", ["one", "two", "adjacent", "modes"])
def test_placeholders_cover_each_image_run_in_order(processors, case):
    ours, _ = processors
    prompt, images = CASES[case]
    got = ours.process(prompt, images)
    ids = got.prompt_token_ids
    covered = []
    for item in got.mm_items:
        rng = item.placeholder
        assert rng.length == ours.num_placeholder_tokens(item.data)
        assert ids[rng.offset:rng.end] == [ours.image_token_id] * rng.length
        covered.extend(range(rng.offset, rng.end))
    assert covered == [i for i, t in enumerate(ids) if t == ours.image_token_id]
    assert len({item.mm_hash for item in got.mm_items}) == len(images)
    assert all(item.modality == "image" and len(item.mm_hash) == 32 for item in got.mm_items)


def test_num_placeholder_tokens_follows_the_strategy(processors, checkpoint):
    ours, hf = processors
    config = json.loads(Path(checkpoint, "config.json").read_text())
    data = ours.process_image(make_image(0, (77, 33)))
    size = config["vision_config"]["image_size"]
    assert tuple(data["pixel_codes"].shape) == (3, size, size)
    grid = (size // config["vision_config"]["patch_size"]) ** 2
    extra = 1 if config["vision_feature_select_strategy"] == "full" else 0
    assert ours.num_placeholder_tokens(data) == grid + extra
    assert ours.image_token == hf.image_token == "<image>"


def test_chat_template(processors):
    ours, _ = processors
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    assert ours.apply_chat_template(parts) == "USER: <image>\nWhat is this? ASSISTANT:"
    assert ours.apply_chat_template([{"role": "user", "content": "Hi"}]) == "USER: Hi ASSISTANT:"


@pytest.mark.parametrize("prompt,count", [("no image here", 0), ("<image> and <image>", 2)])
def test_image_count_mismatch_names_both_counts(processors, prompt, count):
    ours, _ = processors
    with pytest.raises(ValueError, match=f"{count} <image> token.*1 image"):
        ours.process(prompt, [make_image(0)])


@pytest.mark.parametrize("bad", [np.zeros((8, 8, 3), dtype=np.uint8), "cat.png", None])
def test_non_pil_image_is_refused_with_its_type(processors, bad):
    ours, _ = processors
    with pytest.raises(ValueError, match=type(bad).__name__):
        ours.process("<image>", [bad])
    with pytest.raises(ValueError, match=type(bad).__name__):
        ours.process_image(bad)


def test_processed_prompt_is_a_plain_record(processors):
    ours, _ = processors
    got = ours.process("hello", [])
    assert isinstance(got, ProcessedPrompt) and got.mm_items == []
    assert got.prompt_token_ids == ours.tokenizer("hello")["input_ids"]


def test_loads_older_preprocessor_config_layout(tmp_path, checkpoint):
    """transformers 4 saved the image processor in `preprocessor_config.json`, the LlavaProcessor
    fields in `processor_config.json`, and named the torchvision-era class."""
    legacy = tmp_path / "legacy"
    shutil.copytree(checkpoint, legacy)
    config = json.loads((legacy / "processor_config.json").read_text())
    image_config = config.pop("image_processor") | {"image_processor_type": "CLIPImageProcessorFast",
                                                    "processor_class": "LlavaProcessor"}
    (legacy / "preprocessor_config.json").write_text(json.dumps(image_config))
    (legacy / "processor_config.json").write_text(json.dumps(config))
    prompt, images = CASES["two"]
    assert (MultiModalProcessor(str(legacy)).process(prompt, images).prompt_token_ids
            == MultiModalProcessor(checkpoint).process(prompt, images).prompt_token_ids)
    # the oldest layout has no LlavaProcessor fields at all: they come from config.json
    (legacy / "processor_config.json").unlink()
    assert (MultiModalProcessor(str(legacy)).process(prompt, images).prompt_token_ids
            == MultiModalProcessor(checkpoint).process(prompt, images).prompt_token_ids)
