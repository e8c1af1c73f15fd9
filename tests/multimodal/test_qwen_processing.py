"""Qwen-VL input processing (P0): pixels, grids and token ids equal transformers' own.

The reference is transformers' real `Qwen2_5_VLProcessor` / `Qwen3VLProcessor` `__call__`, with
`Qwen2VLImageProcessorPil`: only its constructor's class check of the (absent) video processor
is skipped, because transformers' video processors need torchvision, which this CPU torch lacks.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mmserve.ipc.pixel_codes import pixel_values
from mmserve.multimodal.qwen_processor import QwenVLProcessor
from helpers.tiny_models import make_image, make_qwen_checkpoint

# 4 to 64 merged tokens per image: factor 32 (patch 16) for Qwen3-VL, 28 (patch 14) for Qwen2.5-VL
FAMILIES = {
    "qwen3_vl": (Qwen3VLProcessor, dict(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 64)),
    "qwen2_5_vl": (Qwen2_5_VLProcessor, dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)),
}
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


def no_video_processor(cls: type) -> type:
    """`cls` constructible without a video processor (the only torchvision-bound part)."""

    class WithoutVideo(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return WithoutVideo


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, checkpoint path, our processor, transformers' processor) for each family."""
    hf_class, pixels = FAMILIES[request.param]
    path = make_qwen_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, **pixels)
    hf = no_video_processor(hf_class)(image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
                                      tokenizer=AutoTokenizer.from_pretrained(path))
    return request.param, path, QwenVLProcessor(path), hf


def transparent_image() -> Image.Image:
    image = make_image(5, (40, 56), mode="RGBA")
    alpha = np.zeros((56, 40), dtype=np.uint8)
    alpha[:, 20:] = 255
    image.putalpha(Image.fromarray(alpha))
    return image


IMAGES = {
    "square": make_image(0, (64, 64)),
    "below-min": make_image(1, (20, 24)),
    "one-pixel": make_image(2, (1, 1)),
    "above-max": make_image(3, (640, 480)),
    "wide": make_image(4, (300, 40)),
    "tall": make_image(5, (17, 193)),
    "gray": make_image(6, (50, 70), mode="L"),
    "palette": make_image(7, (70, 50), mode="P"),
    "transparent": transparent_image(),
}


@pytest.mark.parametrize("name", list(IMAGES))
def test_pixels_and_grid_equal_the_image_processor(family, name):
    _, path, ours, _ = family
    image = IMAGES[name]
    got = ours.process_image(image)
    want = Qwen2VLImageProcessorPil.from_pretrained(path)(images=[image], return_tensors="pt")
    codes, pixels, grid = got["pixel_codes"], pixel_values(got), got["image_grid_thw"]
    assert codes.dtype == torch.uint8 and pixels.dtype == torch.float32 and grid.dtype == torch.int64
    assert torch.equal(pixels, want["pixel_values"]) and grid.tolist() == want["image_grid_thw"][0].tolist()
    processor = ours.image_processor
    assert codes.shape == (int(grid.prod()), 3 * processor.patch_size ** 2)  # one frame, repeated by the lookup
    assert int(got["pixel_frames"]) == processor.temporal_patch_size
    assert ours.num_placeholder_tokens(got) == int(grid.prod()) // processor.merge_size ** 2


def test_the_pixel_budget_clamps_the_grid(family):
    _, _, ours, _ = family
    patch, budget = ours.image_processor.patch_size, ours.default_pixels
    area = {name: int(ours.process_image(IMAGES[name])["image_grid_thw"].prod()) * patch ** 2
            for name in ("below-min", "one-pixel", "above-max")}
    assert area["below-min"] >= budget["min_pixels"] and area["one-pixel"] >= budget["min_pixels"]
    assert area["above-max"] <= budget["max_pixels"]


CASES = {
    "text-only": ("<|im_start|>user\nhello there<|im_end|>\n", []),
    "one": (f"<|im_start|>user\n{VISION}What is this?<|im_end|>\n<|im_start|>assistant\n", ["square"]),
    "two": (f"compare {VISION} and {VISION} please", ["wide", "above-max"]),
    "adjacent": (f"{VISION}{VISION}x", ["below-min", "tall"]),
    "bare-pads": ("a<|image_pad|>b <|image_pad|>", ["gray", "transparent"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_token_ids_equal_the_hf_processor(family, case):
    _, _, ours, hf = family
    prompt, names = CASES[case]
    images = [IMAGES[n] for n in names]
    datas = [ours.process_image(image) for image in images]
    ids, ranges = ours.expand(prompt, [ours.num_placeholder_tokens(d) for d in datas])
    want = hf(text=prompt, images=images or None, return_tensors="pt")
    assert ids == want["input_ids"][0].tolist()
    # mm_token_type_ids: what generate needs for M-RoPE, 1 exactly on the image pads
    assert want["mm_token_type_ids"][0].tolist() == [int(t == ours.image_token_id) for t in ids]
    covered = [i for rng in ranges for i in range(rng.offset, rng.end)]
    assert covered == [i for i, t in enumerate(ids) if t == ours.image_token_id]
    assert [rng.length for rng in ranges] == [ours.num_placeholder_tokens(d) for d in datas]
    if images:
        assert torch.equal(torch.cat([pixel_values(d) for d in datas]), want["pixel_values"])
        assert torch.equal(torch.stack([d["image_grid_thw"] for d in datas]), want["image_grid_thw"])


def test_a_request_pixel_budget_changes_the_grid_as_in_hf(family):
    _, _, ours, hf = family
    factor = ours.image_processor.patch_size * ours.merge_size
    image, prompt = IMAGES["above-max"], f"{VISION}describe"
    default = ours.process_image(image)["image_grid_thw"]
    for mm_kwargs in ({"max_pixels": factor ** 2 * 8},
                      {"min_pixels": factor ** 2 * 100, "max_pixels": factor ** 2 * 200},
                      {"min_pixels": ours.default_pixels["min_pixels"]}):
        got = ours.process_image(image, mm_kwargs)
        budget = {**ours.default_pixels, **mm_kwargs}
        want = hf(text=prompt, images=[image], return_tensors="pt",
                  images_kwargs={"size": {"shortest_edge": budget["min_pixels"], "longest_edge": budget["max_pixels"]}})
        assert torch.equal(pixel_values(got), want["pixel_values"])
        assert got["image_grid_thw"].tolist() == want["image_grid_thw"][0].tolist()
        ids, _ = ours.expand(prompt, [ours.num_placeholder_tokens(got)])
        assert ids == want["input_ids"][0].tolist()
        area = int(got["image_grid_thw"].prod()) * ours.image_processor.patch_size ** 2
        assert budget["min_pixels"] <= area <= budget["max_pixels"]
        assert (got["image_grid_thw"].tolist() == default.tolist()) == (budget == ours.default_pixels)


BAD_KWARGS = {
    "unknown key": ({"max_pixel": 1024}, "unsupported"),
    "a known and an unknown key": ({"max_pixels": 1024, "resample": 2}, "unsupported"),  # fps is a video key
    "zero": ({"min_pixels": 0}, "integer"),
    "negative": ({"max_pixels": -5}, "integer"),
    "float": ({"max_pixels": 1024.0}, "integer"),
    "bool": ({"min_pixels": True}, "integer"),
    "string": ({"max_pixels": "1024"}, "integer"),
    "huge": ({"max_pixels": 1 << 40}, "integer"),
    "min above max": ({"min_pixels": 5000, "max_pixels": 4000}, "exceeds"),
    "min above the default max": ({"min_pixels": 10 ** 8}, "exceeds"),
}


@pytest.mark.parametrize("case", list(BAD_KWARGS))
def test_bad_mm_kwargs_are_a_clear_value_error(family, case):
    _, _, ours, _ = family
    mm_kwargs, message = BAD_KWARGS[case]
    with pytest.raises(ValueError, match=message):
        ours.check_mm_kwargs(mm_kwargs)
    with pytest.raises(ValueError, match=message):
        ours.process_image(IMAGES["square"], mm_kwargs)


def test_checked_mm_kwargs_are_the_given_keys(family):
    """What goes into the item hash: the request's own keys, nothing for no kwargs."""
    _, _, ours, _ = family
    assert ours.check_mm_kwargs(None) == {} and ours.check_mm_kwargs({}) == {}
    assert ours.check_mm_kwargs({"max_pixels": 4096}) == {"max_pixels": 4096}


def test_mm_kwargs_equal_to_the_defaults_hit_the_item_made_without_them(family, tmp_path):
    """An explicit max_pixels (or min_pixels) equal to the processor's default is dropped before
    hashing: the request hits the processor-cache entry a request without kwargs made."""
    from mmserve.multimodal.processor_cache import ProcessorCache
    from mmserve.multimodal.image_items import ItemResolver
    from mmserve.multimodal.media import MediaLimits

    _, _, ours, _ = family
    assert ours.check_mm_kwargs(dict(ours.default_pixels)) == {}
    cache = ProcessorCache(1 << 26)
    resolver = ItemResolver("m", ours, cache, MediaLimits(), True)
    png = tmp_path / "a.png"
    IMAGES["square"].save(png)
    source = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    first = resolver.resolve([source], [None], None)
    resolver.commit(first)
    same = resolver.resolve([source], [None], None, {"max_pixels": ours.default_pixels["max_pixels"]})
    other = resolver.resolve([source], [None], None, {"max_pixels": ours.default_pixels["max_pixels"] // 2})
    assert same[0].mm_hash == first[0].mm_hash and not same[0].fresh
    assert other[0].mm_hash != first[0].mm_hash and other[0].fresh
    assert resolver.num_processed == 2


def test_settings_follow_the_checkpoint(family, tmp_path):
    name, path, ours, _ = family
    assert ours.settings() == QwenVLProcessor(path).settings()
    assert ours.settings()["merge_size"] == 2
    other = make_qwen_checkpoint(tmp_path, family=name, min_pixels=ours.default_pixels["min_pixels"] * 2,
                                 max_pixels=ours.default_pixels["max_pixels"])
    assert QwenVLProcessor(other).settings() != ours.settings()


def test_chat_template_wraps_images_and_videos_in_vision_tokens(family):
    _, _, ours, _ = family
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
                    {"role": "assistant", "content": "A cat."},
                    {"role": "user", "content": [{"type": "video"}, {"type": "image_url"},
                                                 {"type": "text", "text": "And?"}]}]
    assert ours.apply_chat_template(conversation) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{VISION}What is this?<|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
        f"<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>{VISION}And?<|im_end|>\n"
        "<|im_start|>assistant\n")
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")


def test_image_count_must_match_the_pads(family):
    _, _, ours, _ = family
    ours.check_image_count(f"{VISION}{VISION}", 2)
    with pytest.raises(ValueError, match=re.escape("1 <|image_pad|> token(s) but 2 image(s)")):
        ours.check_image_count(f"{VISION}", 2)
    with pytest.raises(ValueError, match="PIL"):
        ours.process_image(np.zeros((8, 8, 3), dtype=np.uint8))


def _with_preprocessor(src: str, dst: Path, **fields) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "preprocessor_config.json").read_text())
    (dst / "preprocessor_config.json").write_text(json.dumps({**config, **fields}))
    return str(dst)


def test_the_checkpoints_normalization_is_used(family, tmp_path):
    """Qwen3-VL ships mean = std = 0.5 (not the class's CLIP defaults): white maps to 1.0."""
    _, path, _, _ = family
    half = _with_preprocessor(path, tmp_path / "half", image_mean=[0.5] * 3, image_std=[0.5] * 3)
    white = Image.new("RGB", (64, 64), (255, 255, 255))
    assert torch.allclose(pixel_values(QwenVLProcessor(half).process_image(white)), torch.tensor(1.0))


def test_qwen2_5_vl_published_pixel_fields_are_read(family, tmp_path):
    """Qwen2.5-VL's published preprocessor_config.json has top-level min_pixels / max_pixels."""
    _, path, _, _ = family
    config = json.loads((Path(path) / "preprocessor_config.json").read_text())
    del config["size"]
    dst = tmp_path / "published"
    shutil.copytree(path, dst)
    (dst / "preprocessor_config.json").write_text(json.dumps({**config, "min_pixels": 3136, "max_pixels": 50176}))
    ours = QwenVLProcessor(str(dst))
    assert ours.default_pixels == {"min_pixels": 3136, "max_pixels": 50176}
    area = int(ours.process_image(IMAGES["above-max"])["image_grid_thw"].prod()) * ours.image_processor.patch_size ** 2
    assert area <= 50176
