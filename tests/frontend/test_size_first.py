"""Size first, then pay (issue 40, item 1): every request-controlled cost is refused from what is
known before the work. Counters prove the work was not done: the image processor's runs, the
videos decoded, the tokenizer's calls; and a refused request leaves no processor-cache entry."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.frontend.input_processor import InputProcessor
from mmserve.multimodal.video import decode_video
from mmserve.multimodal.video_options import VideoOptions, sample_indices
from mmserve.sampling_params import SamplingParams
from helpers.qwen_inputs import IMAGE_PROMPT, VIDEO_PROMPT, input_processor, png_url
from helpers.tiny_models import make_qwen_checkpoint
from helpers.tiny_videos import encode_video, make_frames

CLIP = encode_video(make_frames(60, 12, (64, 64)), fps=4, codec="h264")  # a small MP4


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_qwen_checkpoint(tmp_path_factory.mktemp("size-first"), family="qwen3_vl")



def image_request(p: InputProcessor, **mm_kwargs):
    return p.process("i", {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": png_url()},
                           "mm_processor_kwargs": mm_kwargs}, SamplingParams())


def video_request(p: InputProcessor, clip: bytes = CLIP, **prompt):
    return p.process("v", {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": clip}, **prompt}, SamplingParams())


def test_an_upscaling_pixel_budget_is_refused_from_the_header(path):
    """A 64x64 PNG with min_pixels = max_pixels = 4e7 (the server's own pixel limit) would be
    upscaled to 4e7 pixels: refused from its header size, never decoded or processed."""
    p = input_processor(path)
    with pytest.raises(ValueError, match=r"image 0 needs \d+ embedding tokens, more than the encoder"):
        image_request(p, min_pixels=40_000_000, max_pixels=40_000_000)
    with pytest.raises(ValueError, match="--max-media-pixels"):
        image_request(p, max_pixels=1 << 31)
    assert p.items.num_processed == 0 and len(p.processor_cache.keys()) == 0
    image_request(p)  # the same image at the checkpoint's budget is served
    assert p.items.num_processed == 1


def two_images(p: InputProcessor, first: str, second: str):
    prompt = IMAGE_PROMPT.replace("<|vision_end|>", "<|vision_end|><|vision_start|><|image_pad|><|vision_end|>")
    return p.process("two", {"prompt": prompt, "multi_modal_data": {"image": [first, second]}}, SamplingParams())


def test_a_request_is_refused_before_any_of_its_images_is_processed(path):
    """Every image of a request is read and sized before any is decoded: a second image over the
    server's pixel limit refuses the request with the first one unprocessed."""
    p = input_processor(path, max_media_pixels=100_000)
    with pytest.raises(ValueError, match="--max-media-pixels"):
        two_images(p, png_url(), png_url((400, 400)))
    assert p.items.num_processed == 0 and len(p.processor_cache.keys()) == 0
    assert p.items.inflight.futures == {}


def test_a_requests_new_images_are_processed_at_once_as_one_by_one(path):
    """Several new images of one request run on the pipeline's threads; the items equal those
    of each image processed alone."""
    p, alone = input_processor(path), input_processor(path, mm_processor_cache_gb=0)
    seen: set[str] = set()
    process_image = p.processor.process_image

    def recording(*args, **kwargs):
        seen.add(threading.current_thread().name)
        time.sleep(0.05)  # long enough for the next image to start on another thread
        return process_image(*args, **kwargs)

    p.processor.process_image = recording
    urls = [png_url((64, 64)), png_url((96, 64))]
    request = two_images(p, *urls)
    assert len(seen) == 2 and all(name.startswith("mmserve-items") for name in seen)
    assert p.items.num_processed == 2
    for item, url in zip(request.mm_items, urls):
        want = image_request_of(alone, url).mm_items[0]
        assert item.mm_hash == want.mm_hash and torch.equal(item.data["pixel_codes"], want.data["pixel_codes"])


def image_request_of(p: InputProcessor, url: str):
    return p.process("one", {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": url}}, SamplingParams())


@pytest.mark.parametrize("options,flag", [
    ({"media_io_kwargs": {"video": {"min_pixels": 80_000_000, "max_pixels": 80_000_000}}}, "embedding tokens"),
    ({"media_io_kwargs": {"video": {"min_pixels": 1 << 31, "max_pixels": 1 << 31}}}, "--max-video-pixels"),
    ({"media_io_kwargs": {"video": {"num_frames": 80_000_000}}}, "--max-video-frames"),
    ({"media_io_kwargs": {"video": {"num_frames": 1 << 31}}}, "--max-video-frames"),
    ({"mm_processor_kwargs": {"num_frames": 1 << 31}}, "--max-video-frames"),
    ({"media_io_kwargs": {"video": {"fps": None, "min_frames": 1 << 31, "max_frames": 1 << 31}}}, "--max-video-frames"),
])
def test_video_options_beyond_the_server_limits_are_refused_undecoded(path, options, flag):
    p = input_processor(path)
    with pytest.raises(ValueError, match=flag):
        video_request(p, **options)
    assert p.videos.resolver.num_decoded == 0 and len(p.processor_cache.keys()) == 0


def test_a_video_over_the_total_pixel_budget_is_refused_before_decoding(path):
    """frames x pixels after sampling, from the container's metadata: 6 frames of 64x64."""
    p = input_processor(path, max_video_pixels=6 * 64 * 64 - 1)
    with pytest.raises(ValueError, match="--max-video-pixels"):
        video_request(p)
    assert p.videos.resolver.num_decoded == 0
    assert len(video_request(input_processor(path, max_video_pixels=6 * 64 * 64)).mm_items) == 3


def test_a_video_over_the_prompt_is_refused_before_decoding(path):
    """The groups' tokens, from the metadata and the target size, against max_model_len."""
    p = InputProcessor(EngineConfig.from_kwargs(model=path), path, 64, None)
    with pytest.raises(ValueError, match="max_model_len"):
        pixels = 12 * 256 * 256  # every frame upscaled to 256x256: 64 tokens per group
        video_request(p, media_io_kwargs={"video": {"min_pixels": pixels, "max_pixels": pixels, "fps": 4}})
    assert p.videos.resolver.num_decoded == 0


def test_decoding_keeps_the_sampled_frames_at_their_target_size(path):
    """The served pixels equal the whole-clip path's (every sampled frame decoded at full size,
    stacked, then resized), while each frame is resized as it is decoded."""
    p = input_processor(path)
    clip = encode_video(make_frames(61, 10, (160, 96)), fps=4)
    opts = p.videos.resolver.options(None, {"video": {"fps": 4, "max_pixels": 1 << 16}})
    request = video_request(p, clip, media_io_kwargs={"video": {"fps": 4, "max_pixels": 1 << 16}})
    served = np.concatenate([item.data["pixel_codes"].numpy() for item in request.mm_items])
    video = p.processor.video
    decoded = decode_video(clip, lambda meta: sample_indices(meta, opts, "qwen3_vl", 2), p.videos.resolver.limits)
    whole = video.process(decoded.frames, decoded.indices, decoded.metadata.fps, 10, opts)
    assert np.array_equal(served, whole.pixel_codes.numpy())


class CountingTokenizer:
    """The checkpoint's tokenizer, counting its calls and the characters it was given."""

    def __init__(self, inner) -> None:
        self.inner, self.calls, self.chars = inner, 0, 0

    def __call__(self, text, *args, **kwargs):
        self.calls, self.chars = self.calls + 1, self.chars + len(text)
        return self.inner(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("prompt", ["text", "dict"])
def test_a_prompt_longer_than_max_model_len_can_spell_is_refused_untokenized(path, prompt):
    p = input_processor(path)
    counting = CountingTokenizer(p.processor.tokenizer)
    p.processor.tokenizer = counting
    text = "word " * (2 << 20)  # 10 MiB
    with pytest.raises(ValueError, match="characters.*max_model_len.*not tokenized"):
        p.process("t", text if prompt == "text" else {"prompt": text}, SamplingParams())
    assert counting.calls == 0
    just_over = "a" * (p.max_prompt_chars + 1)
    with pytest.raises(ValueError, match="not tokenized"):
        p.process("t", just_over, SamplingParams())
    assert counting.calls == 0
    long = "word " * 5000  # within the bound; its prefix alone has more than max_model_len tokens
    with pytest.raises(ValueError, match="max_model_len"):
        p.process("t", long, SamplingParams())
    assert counting.calls == 1 and counting.chars < len(long)  # tokenizing stopped


def test_the_same_new_video_in_a_burst_is_decoded_once(path):
    """Videos share the images' in-flight dedup: concurrent requests with one new clip decode it once."""
    from concurrent.futures import ThreadPoolExecutor

    p = input_processor(path)
    clip = encode_video(make_frames(62, 12, (64, 64)), fps=4)
    with ThreadPoolExecutor(6) as pool:
        requests = list(pool.map(lambda i: video_request(p, clip), range(6)))
    assert p.videos.resolver.num_decoded == 1
    assert all(r.mm_items[0].mm_hash == requests[0].mm_items[0].mm_hash for r in requests)
    assert p.items.inflight.futures == {}
    assert isinstance(p.videos.resolver.options(None, None), VideoOptions)


def test_a_video_request_refused_after_processing_leaves_nothing_in_flight(path):
    p = input_processor(path)
    clip = encode_video(make_frames(63, 12, (64, 64)), fps=4)
    long_text = VIDEO_PROMPT + " word" * 3000
    with pytest.raises(ValueError, match="max_model_len"):
        p.process("l", {"prompt": long_text, "multi_modal_data": {"video": clip}}, SamplingParams())
    assert p.videos.resolver.num_decoded == 1
    assert p.items.inflight.futures == {} and len(p.processor_cache.keys()) == 0
