"""Video decoding, sampling and pixels: equal to transformers' video processors.

The reference is transformers' own `Qwen3VLVideoProcessor` / `Qwen2VLVideoProcessor` (sampling,
sizing, fused rescale, odd-count padding, patchify), run with torchvision's two kernels given as
torchvision defines them (tests/helpers/hf_reference.py: `hf_video_processor`).
"""

from __future__ import annotations

import copy
import numpy as np
import pytest
import torch

from helpers.hf_reference import hf_video_inputs, hf_video_processor
from mmserve.ipc.pixel_codes import pixel_values
from mmserve.multimodal.media import MediaError
from mmserve.multimodal.video import VideoLimits, decode_video, probe_video
from mmserve.multimodal.video_options import VideoOptions, resolve, sample_indices
from mmserve.multimodal.video_processor import QwenVideoProcessor
from helpers.tiny_models import make_qwen_checkpoint
from helpers.tiny_videos import audio_only_file, encode_video, make_frames

FAMILIES = ("qwen3_vl", "qwen2_5_vl")
CASES = [  # (frames, fps, (width, height), request options)
    (11, 4.0, (150, 100), {}),
    (9, 2.0, (40, 300), {}),  # odd count, thin: sized up to the merge factor
    (16, 8.0, (320, 240), {"max_pixels": 32 * 32 * 40}),  # over the pixel budget
    (12, 3.0, (64, 64), {"num_frames": 5}),
    (30, 10.0, (96, 64), {"fps": 1.0, "min_frames": 2}),
    (7, 30.0, (64, 48), {"do_sample_frames": False}),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path = make_qwen_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param)
    return request.param, path, hf_video_processor(path, request.param), QwenVideoProcessor(path, request.param)


def ours(processor: QwenVideoProcessor, frames: np.ndarray, fps: float, opts: VideoOptions):
    from mmserve.multimodal.video import VideoMetadata

    meta = VideoMetadata(len(frames), fps, frames.shape[2], frames.shape[1])
    indices = sample_indices(meta, opts, processor.family, processor.temporal_patch_size)
    return indices, processor.process(frames[indices], indices, fps, len(frames), opts)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}f-{c[2][0]}x{c[2][1]}-{'-'.join(c[3]) or 'defaults'}")
def test_pixels_equal_transformers(family, case):
    name, _, reference, processor = family
    count, fps, size, options = case
    frames = make_frames(count, count, size)
    opts = resolve(processor.defaults, options)
    hf_kwargs = {k: v for k, v in options.items() if k not in ("min_pixels", "max_pixels")}
    if "max_pixels" in options:
        hf_kwargs["size"] = {"shortest_edge": opts.min_pixels, "longest_edge": opts.max_pixels}
    if "num_frames" in options:
        hf_kwargs["fps"] = None
    reference = copy.copy(reference)  # Qwen3VLVideoProcessor.sample_frames reads min/max_frames from itself
    for key in ("min_frames", "max_frames"):
        if key in hf_kwargs:
            setattr(reference, key, hf_kwargs.pop(key))
    expected = hf_video_inputs(reference, frames, fps, **hf_kwargs)
    indices, got = ours(processor, frames, fps, opts)
    meta = expected["video_metadata"][0]
    picked = np.arange(count) if meta.frames_indices is None else np.asarray(meta.frames_indices)  # None: all
    assert list(indices) == list(picked)
    assert list(got.grid) == expected["video_grid_thw"][0].tolist()
    assert got.pixel_codes.dtype == torch.uint8
    assert torch.equal(pixel_values({"pixel_codes": got.pixel_codes, "pixel_lut": got.pixel_lut}),
                       expected["pixel_values_videos"])
    assert got.second_per_grid_ts == pytest.approx(processor.temporal_patch_size / meta.sampled_fps)


def test_groups_are_image_shaped_slices(family):
    _, _, _, processor = family
    _, video = ours(processor, make_frames(3, 8, (96, 64)), 2.0, processor.defaults)
    groups = [video.group(g) for g in range(video.grid[0])]
    assert torch.equal(torch.cat([g["pixel_codes"] for g in groups]), video.pixel_codes)
    assert all(g["pixel_lut"] is video.pixel_lut for g in groups)
    assert all(g["image_grid_thw"].tolist() == [1, *video.grid[1:]] for g in groups)


def test_lossless_video_decodes_bit_exact():
    frames = make_frames(5, 6)
    data = encode_video(frames, fps=3, codec="png")
    meta = probe_video(data)
    assert (meta.total_num_frames, meta.fps, meta.width, meta.height) == (6, 3.0, 64, 48)
    video = decode_video(data, lambda m: np.array([0, 2, 2, 5]), VideoLimits())
    assert np.array_equal(video.frames, frames[[0, 2, 2, 5]])


def test_h264_metadata_as_transformers_reads_it():
    data = encode_video(make_frames(6, 10), fps=5, codec="h264")
    meta = probe_video(data)
    assert (meta.total_num_frames, meta.fps) == (10, 5.0)
    video = decode_video(data, lambda m: np.arange(m.total_num_frames), VideoLimits())
    assert video.frames.shape == (10, 48, 64, 3)


@pytest.mark.parametrize("codec", ["ffv1", "libvpx-vp9"])
def test_containers_without_a_frame_count_are_counted(codec):
    """MKV / WebM headers carry no frame count (transformers' reader would see 0): packets are counted."""
    frames = make_frames(9, 7)
    data = encode_video(frames, fps=5, codec=codec)
    meta = probe_video(data)
    assert (meta.total_num_frames, meta.fps) == (7, 5.0)
    video = decode_video(data, lambda m: np.arange(m.total_num_frames), VideoLimits())
    assert video.frames.shape == frames.shape
    if codec == "ffv1":  # lossless
        assert np.array_equal(video.frames, frames)


@pytest.mark.parametrize("mutilate", ["garbage", "truncated", "empty", "audio_only"])
def test_broken_videos_are_media_errors(mutilate):
    data = encode_video(make_frames(7, 6), fps=3, codec="h264")
    data = {"garbage": b"\x00not a video" * 50, "truncated": data[: len(data) // 2], "empty": b"",
            "audio_only": audio_only_file()}[mutilate]
    with pytest.raises(MediaError):
        decode_video(data, lambda m: np.arange(m.total_num_frames), VideoLimits())


def test_limits_refuse_before_decoding():
    data = encode_video(make_frames(8, 8), fps=2, codec="png")
    every = lambda m: np.arange(m.total_num_frames)  # noqa: E731
    with pytest.raises(MediaError, match="--max-video-frames"):
        decode_video(data, every, VideoLimits(max_frames=4))
    with pytest.raises(MediaError, match="--max-video-duration-s"):
        decode_video(data, every, VideoLimits(max_duration_s=2.0))
    with pytest.raises(MediaError, match="--max-media-pixels"):
        decode_video(data, every, VideoLimits(max_pixels=64 * 47))


def test_options_validate_and_override_in_order():
    base = VideoOptions()
    assert resolve(base, {"num_frames": 8}).fps is None
    assert resolve(base, {"num_frames": 8}, {"fps": 1.0}) == resolve(base, {"fps": 1.0})
    for bad in ({"fps": 0}, {"num_frames": 2.5}, {"frames": 3}, {"min_frames": 9, "max_frames": 4},
                {"fps": 1.0, "num_frames": 4}):
        with pytest.raises(ValueError):
            resolve(base, bad)

