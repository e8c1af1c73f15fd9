"""`--mm-processor-kwargs` (vLLM's server-wide processor settings) without an engine: an image's
pixel budget and a video's sampling for every request, a request's own settings winning key by
key; the item hash covers what the server set (a repeat under another setting is processed anew,
the same setting given by the request hits); refused at start, naming the flag, when the model
takes no such setting, a value is out of range, or it passes a server limit."""

from __future__ import annotations

import pytest

from mmserve.config import EngineConfig
from mmserve.config.multimodal import IMAGE_KWARGS, VIDEO_KWARGS
from mmserve.frontend.input_processor import InputProcessor
from mmserve.multimodal.qwen_processor import MM_KWARGS
from mmserve.multimodal.video_options import REQUEST_KEYS
from mmserve.models.builtin import resolve_model
from mmserve.sampling_params import SamplingParams
from helpers.qwen_inputs import IMAGE_PROMPT, VIDEO_PROMPT, input_processor, png_url
from helpers.tiny_models import make_qwen_checkpoint
from helpers.tiny_videos import encode_video, make_frames

CLIP = encode_video(make_frames(50, 12, (64, 64)), fps=4)  # 12 frames, 3 s


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_qwen_checkpoint(tmp_path_factory.mktemp("server-mm-kwargs"), family="qwen3_vl")



def image(p: InputProcessor, **mm_kwargs):
    """The request's one image item: (its placeholder tokens, its hash)."""
    request = p.process("i", {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": png_url((256, 192))},
                              "mm_processor_kwargs": mm_kwargs}, SamplingParams())
    item = request.mm_items[0]
    return item.placeholder.length, item.mm_hash


def video_groups(p: InputProcessor, **prompt) -> int:
    request = p.process("v", {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": CLIP}, **prompt},
                        SamplingParams())
    return sum(item.modality == "video" for item in request.mm_items)


def test_the_keys_are_the_processors():
    assert IMAGE_KWARGS == MM_KWARGS and VIDEO_KWARGS == REQUEST_KEYS


def test_a_server_pixel_budget_sizes_every_image_and_a_request_overrides_it(path):
    default_tokens, default_hash = image(input_processor(path))
    small = 20_000  # between the checkpoint's min_pixels (16,384) and the image's 256 x 192
    p = input_processor(path, mm_processor_kwargs={"max_pixels": small})
    tokens, server_hash = image(p)
    assert tokens < default_tokens and server_hash != default_hash  # the hash covers the server's setting
    assert image(p, max_pixels=small) == (tokens, server_hash)  # the same setting, given by the request: a hit
    assert image(p, max_pixels=1 << 20) == (default_tokens, image(input_processor(path), max_pixels=1 << 20)[1])
    assert p.items.num_processed == 2  # the server's setting once (then a hit), the request's once


def test_server_video_keys_sit_between_media_io_kwargs_and_the_requests(path):
    """checkpoint (fps 2: 3 groups) < --media-io-kwargs < --mm-processor-kwargs < the request's."""
    assert video_groups(input_processor(path)) == 3
    p = input_processor(path, media_io_kwargs={"video": {"fps": 4}}, mm_processor_kwargs={"num_frames": 4})
    assert video_groups(p) == 2
    assert video_groups(p, media_io_kwargs={"video": {"fps": 4}}) == 6
    assert video_groups(p, mm_processor_kwargs={"num_frames": 8}) == 4


@pytest.mark.parametrize("kwargs, message", [
    ({"max_pixels": 0}, "must be a positive integer"),
    ({"max_pixels": 1.5}, "must be a positive integer"),
    ({"fps": float("nan")}, "must be a positive finite number"),
    ({"max_pixel": 100}, "unknown key"),
    ([1], "must be an object"),
])
def test_a_malformed_setting_is_refused_by_the_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(model="x", mm_processor_kwargs=kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"min_pixels": 1 << 20, "max_pixels": 1 << 10}, "min_pixels .* exceeds max_pixels"),
    ({"max_pixels": 1 << 30}, "--max-media-pixels"),
    ({"num_frames": 10_000}, "--max-video-frames"),
])
def test_a_setting_the_server_cannot_serve_is_refused_at_start(path, kwargs, message):
    with pytest.raises(ValueError, match=f"--mm-processor-kwargs.*{message}"):
        input_processor(path, mm_processor_kwargs=kwargs)


def test_a_model_that_takes_no_settings_refuses_them_at_start():
    with pytest.raises(ValueError, match="--mm-processor-kwargs: this model takes no mm_processor_kwargs"):
        input_processor(resolve_model("builtin:tiny-llava"), mm_processor_kwargs={"max_pixels": 4096})
