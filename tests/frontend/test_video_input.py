"""P0's video input without an engine: which options win, what a refusal leaves, what a repeat skips."""

from __future__ import annotations

import pytest

from mmserve.frontend.input_processor import InputProcessor
from mmserve.multimodal.media import MediaError
from mmserve.sampling_params import SamplingParams
from helpers.qwen_inputs import VIDEO_PROMPT, input_processor
from helpers.tiny_models import make_qwen_checkpoint
from helpers.tiny_videos import encode_video, make_frames

PROMPT = VIDEO_PROMPT
CLIP = encode_video(make_frames(50, 12, (64, 64)), fps=4)  # 12 frames, 3 s


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_qwen_checkpoint(tmp_path_factory.mktemp("video-input"), family="qwen3_vl")



def groups(p: InputProcessor, **prompt) -> int:
    request = p.process("r", {"prompt": PROMPT, "multi_modal_data": {"video": CLIP}, **prompt}, SamplingParams())
    return sum(item.modality == "video" for item in request.mm_items)


def test_options_override_in_order(path):
    """checkpoint (fps 2: 6 frames) < --media-io-kwargs < request media_io_kwargs < mm_processor_kwargs."""
    assert groups(input_processor(path)) == 3
    server = input_processor(path, media_io_kwargs={"video": {"num_frames": 4}})
    assert groups(server) == 2
    assert groups(server, media_io_kwargs={"video": {"fps": 4}}) == 6
    assert groups(server, media_io_kwargs={"video": {"fps": 4}}, mm_processor_kwargs={"num_frames": 8}) == 4


def test_a_refused_video_leaves_nothing_and_a_repeat_is_not_decoded(path):
    p = input_processor(path, max_video_frames=8)
    with pytest.raises(MediaError, match="--max-video-frames"):
        groups(p, media_io_kwargs={"video": {"fps": 4}})  # 12 frames > 8
    assert len(p.processor_cache.keys()) == 0 and p.videos.resolver.num_decoded == 0
    assert groups(p) == groups(p) == 3
    assert len(p.processor_cache.keys()) == 1 and p.videos.resolver.num_decoded == 1


def test_uuid_alone_needs_a_cached_video(path):
    p = input_processor(path)
    alone = {"prompt": PROMPT, "multi_modal_data": {"video": None}, "multi_modal_uuids": {"video": "v"}}
    with pytest.raises(ValueError, match="not cached"):
        p.process("a", alone, SamplingParams())
    first = p.process("b", {**alone, "multi_modal_data": {"video": CLIP}}, SamplingParams())
    again = p.process("c", alone, SamplingParams())
    assert [i.mm_hash for i in again.mm_items] == [i.mm_hash for i in first.mm_items]
    assert again.prompt_token_ids == first.prompt_token_ids


def test_video_on_a_model_without_video_and_too_many_videos(path, tmp_path):
    from helpers.tiny_models import make_checkpoint

    llava = input_processor(make_checkpoint(tmp_path))
    with pytest.raises(ValueError, match="no video"):
        llava.process("l", {"prompt": "hi", "multi_modal_data": {"video": CLIP}}, SamplingParams())
    two = {"prompt": PROMPT.replace("hi", "<|vision_start|><|video_pad|><|vision_end|>"),
           "multi_modal_data": {"video": [CLIP, CLIP]}}
    with pytest.raises(ValueError, match="--limit-mm-per-prompt"):
        input_processor(path).process("t", two, SamplingParams())
    request = input_processor(path, limit_mm_per_prompt={"video": 2}).process("u", two, SamplingParams())
    assert sum(item.modality == "video" for item in request.mm_items) == 6


def test_a_group_over_the_encoder_budget_is_refused_not_the_whole_video(path):
    """The budget is per temporal group: 40 frames of 128x128 (more tokens than the budget in all)
    fit; 2 frames of 640x640 do not."""
    p = input_processor(path, encoder_cache_tokens=16, max_num_encoder_input_tokens=16)  # raised to the largest image
    long_clip = encode_video(make_frames(51, 40, (128, 128)), fps=4)
    request = p.process("l", {"prompt": PROMPT, "multi_modal_data": {"video": long_clip},
                              "media_io_kwargs": {"video": {"fps": 4, "max_pixels": 4 << 20}}}, SamplingParams())
    tokens = sum(item.placeholder.length for item in request.mm_items)
    assert tokens > p.max_encoder_tokens
    big = encode_video(make_frames(52, 2, (640, 640)), fps=1)
    with pytest.raises(ValueError, match="temporal group of video 0"):
        p.process("b", {"prompt": PROMPT, "multi_modal_data": {"video": big},
                        "media_io_kwargs": {"video": {"max_pixels": 4 << 20, "num_frames": 2}}}, SamplingParams())
    assert len(p.processor_cache.keys()) == 1  # only the accepted clip
