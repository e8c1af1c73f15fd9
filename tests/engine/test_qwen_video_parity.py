"""Video on Qwen2-VL, Qwen2.5-VL and Qwen3-VL: greedy outputs token-for-token equal to transformers' `generate`.

Both sides get the same decoded frames: a lossless PNG .mov (decodes bit-exact), an H.264 .mp4
(the reference is fed PyAV's decoding of the same bytes), raw frames with their fps beside an
image, and a request with its own sampling fps. Each video is one item per temporal group here;
the runs cover batching, prefill chunks smaller than one group, TP = 2, every cache hitting on a
repeat, a clip that shares its first frames with a later video reusing those groups, and a video
larger than the encoder cache.

Qwen2-VL's temporal position steps 1 per group, Qwen2.5-VL's by the group's seconds (the H.264
clip, sampled at 2 fps, tells them apart). Qwen2(.5)-VL positions: text after a video resumes at
max + 1 (the model's original rule), where transformers 5.x resumes at start + max(h, w) / merge;
they agree when a video's scaled temporal extent does not exceed its spatial one, which these
clips keep (see models/mrope.py).
"""

from __future__ import annotations

import pytest

from helpers.hf_reference import hf_qwen_greedy
from mmserve import LLM, SamplingParams
from helpers.tiny_models import make_image, make_qwen_checkpoint
from helpers.tiny_videos import encode_video, make_frames

MAX_NEW = 8
FAST = {"fps": 4}  # sampled at 4 fps: Qwen2.5-VL's temporal step is 1 position per group


def chat(text: str, images: int = 0, videos: int = 1) -> str:
    pads = ("<|vision_start|><|image_pad|><|vision_end|>" * images
            + "<|vision_start|><|video_pad|><|vision_end|>" * videos)
    return f"<|im_start|>user\n{pads}{text}<|im_end|>\n<|im_start|>assistant\n"


def clip(count: int) -> dict:
    """The first `count` frames of one lossless 4 fps video (8 frames: 4 groups)."""
    data = encode_video(make_frames(0, 8, (128, 112))[:count], fps=4, codec="png")
    return {"prompt": chat("what happens?"), "multi_modal_data": {"video": data}, "mm_processor_kwargs": FAST}


def prompts() -> list[dict]:
    h264 = encode_video(make_frames(1, 10, (144, 112)), fps=5, codec="h264")
    return [
        clip(8),
        {"prompt": chat("describe the clip"), "multi_modal_data": {"video": h264}},
        {"prompt": chat("compare", images=1), "multi_modal_data": {
            "image": make_image(2, (64, 48)), "video": (make_frames(3, 9, (150, 140)), 3.0)}},
    ]


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl", "qwen2_vl"])
def variant(request, tmp_path_factory):
    path = make_qwen_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param)
    items = prompts()
    refs, _ = hf_qwen_greedy(path, items, MAX_NEW)
    return path, items, refs


def generate(llm: LLM, items: list[dict]) -> list[list[int]]:
    outs = llm.generate(items, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    llm.engine.core.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


def test_batched_equals_transformers(variant):
    path, items, refs = variant
    assert generate(LLM(model=path), items) == refs


def test_chunks_smaller_than_a_group_equal_transformers(variant):
    path, items, refs = variant
    assert generate(LLM(model=path, max_num_batched_tokens=5, block_size=4), items) == refs


def test_every_cache_hitting_on_a_repeat(variant):
    """The same videos again: not decoded, not processed, not encoded; prefix blocks reused."""
    path, items, refs = variant
    llm = LLM(model=path, block_size=4)
    assert generate(llm, items) == refs
    runner, resolver = llm.engine.core.executor.runner, llm.engine.input_processor.videos.resolver
    encoded, decoded = runner.num_encoded_items, resolver.num_decoded
    outs = llm.generate(items, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert (runner.num_encoded_items, resolver.num_decoded) == (encoded, decoded), "a repeat redid work"
    assert all(o.num_cached_tokens > 0 for o in outs)


def test_appended_frames_reuse_the_groups_already_encoded(variant):
    """A 4-frame clip, then the 8-frame video it starts: only the 2 new groups are encoded, and
    the longer video's tokens still equal transformers'."""
    path, items, refs = variant
    llm = LLM(model=path, block_size=4)
    generate(llm, [clip(4)])
    runner = llm.engine.core.executor.runner
    assert runner.num_encoded_items == 2
    assert generate(llm, [items[0]]) == refs[:1]
    assert runner.num_encoded_items == 4


def test_tp2_equals_transformers(variant):
    path, items, refs = variant
    llm = LLM(model=path, tensor_parallel_size=2, max_num_batched_tokens=16, block_size=4, num_kv_blocks=256)
    try:
        assert generate(llm, items) == refs
    finally:
        llm.engine.core.shutdown()


def test_a_video_larger_than_the_encoder_cache_runs(variant):
    """vLLM #36814: the encoder cache and budget need to hold one group at a time, not the video;
    tokens equal a roomy engine's (whose outputs the tests above tie to transformers). Also guards
    the tests above: the same question about another video gets another answer."""
    path, _, refs = variant
    item = {"prompt": chat("what happens?"), "multi_modal_data": {"video": encode_video(
        make_frames(5, 8, (320, 320)), fps=4)}, "media_io_kwargs": {"video": {"fps": 4, "max_pixels": 1 << 20}}}
    small = LLM(model=path, encoder_cache_tokens=16, max_num_encoder_input_tokens=16, max_num_batched_tokens=32)
    video_tokens = sum(i.placeholder.length for i in small.engine.input_processor.process(
        "probe", item, SamplingParams()).mm_items)
    assert video_tokens > small.engine.input_processor.max_encoder_tokens
    roomy = generate(LLM(model=path), [item])
    assert generate(small, [item]) == roomy and roomy != refs[:1]
