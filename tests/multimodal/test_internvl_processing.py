"""InternVL's P0 processor against transformers' `InternVLProcessor` on the same files: the token ids
(`<img>`, the tiles' `<IMG_CONTEXT>` tokens, `</img>`), the pixel values of every tile (thumbnail
last), the count of tiles from an image's size alone, and the request's own tiling; what a request
may not set is a ClientError (a 400) before any pixel is touched. InternVL's own layout: the same
tokens and pixels as transformers gives its `-hf` twin, its tiling and arithmetic as its code's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mmserve.errors import ClientError
from mmserve.ipc.pixel_codes import decode
from mmserve.models.builtin_internvl import write_internvl_own_layout
from mmserve.multimodal.processing import create_processor
from helpers.hf_internvl import hf_internvl_processor
from helpers.tiny_models import make_image, make_internvl_checkpoint

SIZES = [(48, 48), (56, 56), (200, 90), (70, 300), (400, 150), (30, 500), (1000, 999)]


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    path = make_internvl_checkpoint(tmp_path_factory.mktemp("internvl"))
    return create_processor(path), hf_internvl_processor(path)


def pixels_of(datas: list[dict]) -> torch.Tensor:
    return torch.cat([decode(d["pixel_codes"], d["pixel_lut"]).view(d["pixel_codes"].shape) for d in datas])


@pytest.mark.parametrize("kwargs", [{}, {"max_patches": 2}, {"min_patches": 3}, {"crop_to_patches": False}],
                         ids=["default", "max-2", "min-3", "no-crop"])
def test_tokens_and_pixels_equal_the_processor(processors, kwargs):
    ours, hf = processors
    images = [make_image(i, size) for i, size in enumerate(SIZES)]
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"},
                                                 *[{"type": "image"}] * (len(images) - 1)]}]
    prompt = ours.apply_chat_template(conversation)
    ref = hf(text=prompt, images=images, return_tensors="pt", **kwargs)
    settings = ours.check_mm_kwargs(kwargs)
    datas = [ours.process_image(image, settings) for image in images]
    ids, ranges = ours.expand(prompt, [ours.num_placeholder_tokens(d) for d in datas])
    assert ids == ref["input_ids"][0].tolist()
    assert torch.equal(pixels_of(datas), ref["pixel_values"])
    for rng in ranges:  # each range is the image's context tokens, between <img> and </img>
        assert set(ids[rng.offset:rng.offset + rng.length]) == {ours.image_token_id}
        assert (ids[rng.offset - 1], ids[rng.offset + rng.length]) == (ours.wrap[0][0], ours.wrap[1][0])
    assert [ours.image_tokens(im.width, im.height, settings) for im in images] == \
        [ours.num_placeholder_tokens(d) for d in datas]


def test_vllm_names_are_transformers_names(processors):
    ours, _ = processors
    assert ours.check_mm_kwargs({"max_dynamic_patch": 2, "dynamic_image_size": True}) == {"max_patches": 2}
    assert ours.check_mm_kwargs({"max_patches": 6, "min_dynamic_patch": 1}) == {}  # the defaults hash as none


@pytest.mark.parametrize("kwargs, message", [
    ({"max_patches": 7}, r"max_patches must be an integer in \[1, 6\]"),
    ({"min_patches": 0}, r"min_patches must be an integer"),
    ({"max_patches": "2"}, r"max_patches must be an integer"),
    ({"min_patches": 4, "max_patches": 2}, "exceeds max_patches"),
    ({"max_patches": 2, "max_dynamic_patch": 3}, "sets max_patches twice"),
    ({"crop_to_patches": 1}, "must be true or false"),
    ({"max_pixels": 100}, "unsupported mm_processor_kwargs max_pixels"),
])
def test_bad_tiling_is_a_client_error(processors, kwargs, message):
    ours, _ = processors
    with pytest.raises(ClientError, match=message):
        ours.check_mm_kwargs(kwargs)
    with pytest.raises(ClientError, match=message):
        ours.process_image(make_image(0, (200, 90)), kwargs)


def test_each_image_needs_its_token(processors):
    ours, _ = processors
    with pytest.raises(ClientError, match="1 <IMG_CONTEXT> token"):
        ours.check_image_count("<IMG_CONTEXT> hi", 2)


@pytest.fixture(scope="module")
def own_processors(tmp_path_factory):
    """InternVL's own layout (tiling from config.json, `<image>` in prompts) and transformers'
    processor on its `-hf` twin."""
    folder = tmp_path_factory.mktemp("internvl-own")
    hf = make_internvl_checkpoint(folder, max_patches=4)
    write_internvl_own_layout(hf, folder / "own")
    return create_processor(str(folder / "own")), hf_internvl_processor(hf), folder / "own"


def test_the_own_layout_gives_the_twin_s_tokens_and_pixels(own_processors):
    ours, hf, _ = own_processors
    images = [make_image(i, size) for i, size in enumerate(SIZES)]
    conversation = [{"role": "user", "content": [*[{"type": "image"}] * len(images),
                                                 {"type": "text", "text": "What are these?"}]}]
    prompt = ours.apply_chat_template(conversation)
    assert prompt.count("<image>\n") == len(images)  # as vLLM writes InternVL's images into its string template
    ref = hf(text=prompt.replace("<image>", "<IMG_CONTEXT>"), images=images, return_tensors="pt")
    datas = [ours.process_image(image) for image in images]
    ids, _ = ours.expand(prompt, [ours.num_placeholder_tokens(d) for d in datas])
    assert ids == ref["input_ids"][0].tolist()
    assert torch.equal(pixels_of(datas), ref["pixel_values"])
    assert max(d["pixel_codes"].shape[0] for d in datas) == 5  # config.json's max_dynamic_patch 4, a thumbnail


def test_the_own_layout_s_arithmetic_is_to_tensor_and_normalize(own_processors):
    """InternVL's code: `ToTensor()` then `Normalize(IMAGENET_MEAN, IMAGENET_STD)`, in float32, per code."""
    ours, _, _ = own_processors
    codes = torch.arange(256, dtype=torch.float32)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    expected = (codes.div(255)[None, :] - mean[:, None]) / std[:, None]
    assert torch.equal(ours.lut, expected)


def test_the_own_layout_without_dynamic_size_takes_one_tile(own_processors, tmp_path):
    _, _, own = own_processors
    fixed = tmp_path / "fixed"
    shutil.copytree(own, fixed)
    config = json.loads((fixed / "config.json").read_text())
    (fixed / "config.json").write_text(json.dumps({**config, "dynamic_image_size": False}))
    processor = create_processor(str(fixed))
    assert processor.process_image(make_image(0, (400, 150)))["pixel_codes"].shape[0] == 1
    assert processor.image_tokens(400, 150, {}) == processor.tile_tokens
