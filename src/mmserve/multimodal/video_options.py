"""How a video is sampled and sized: one options schema, decided in one place.

`VideoOptions` holds every setting that changes a video's processed pixels. Its defaults come from
the checkpoint's video processor settings (`video_processor.py: video_config`); they are
overridden, in this order, by the server's `--media-io-kwargs '{"video": {...}}'`, the request's
`media_io_kwargs.video` and the request's `mm_processor_kwargs` (video keys only: `fps`,
`num_frames`, `min_frames`, `max_frames`; its `min_pixels` / `max_pixels` size images). `resolve`
validates the merged result; the item hash covers `as_dict()`, so a cached video is never reused
under other settings (vLLM #55203).

`sample_indices` is the family's frame sampler, exactly as transformers has it:
`Qwen2VLVideoProcessor.sample_frames` (Qwen2-VL, Qwen2.5-VL) and `Qwen3VLVideoProcessor.sample_frames`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmserve.errors import ClientError
from mmserve.multimodal.video import VideoMetadata

KEYS = ("fps", "num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels", "do_sample_frames")
REQUEST_KEYS = ("fps", "num_frames", "min_frames", "max_frames")  # also taken from mm_processor_kwargs
_MAX_INT = 1 << 31


@dataclass(frozen=True)
class VideoOptions:
    """`fps` / `num_frames`: the sampling target (at most one given); `min_frames` / `max_frames`
    clamp an fps-derived count; `min_pixels` / `max_pixels` (the processor's `size`) bound one
    frame's (Qwen2(.5)-VL) or the whole clip's t*h*w (Qwen3-VL) resized pixels."""

    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    do_sample_frames: bool = True

    def __post_init__(self) -> None:
        for key in ("num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels"):
            value = getattr(self, key)
            if value is not None and (type(value) is not int or not 0 < value <= _MAX_INT):
                raise ClientError(f"video option {key} must be an integer in [1, {_MAX_INT}]; got {value!r:.40}")
        if self.fps is not None and (type(self.fps) not in (int, float) or not 0 < self.fps <= 1000):
            raise ClientError(f"video option fps must be a number in (0, 1000]; got {self.fps!r:.40}")
        if type(self.do_sample_frames) is not bool:
            raise ClientError("video option do_sample_frames must be true or false")
        if self.min_frames > self.max_frames:
            raise ClientError(f"video option min_frames ({self.min_frames}) exceeds max_frames ({self.max_frames})")
        if self.min_pixels > self.max_pixels:
            raise ClientError(f"video option min_pixels ({self.min_pixels}) exceeds max_pixels ({self.max_pixels})")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VideoOptions:
        """The defaults of a `video_preprocessor_config.json` (as transformers reads it)."""
        size = config.get("size") or {}
        fields: dict[str, Any] = {"fps": config.get("fps"), "num_frames": config.get("num_frames"),
                  "min_frames": config.get("min_frames"), "max_frames": config.get("max_frames"),
                  "min_pixels": size.get("shortest_edge", config.get("min_pixels")),
                  "max_pixels": size.get("longest_edge", config.get("max_pixels")),
                  "do_sample_frames": config.get("do_sample_frames")}
        if fields["num_frames"] is not None:
            fields["fps"] = None
        return cls(**{k: v for k, v in fields.items() if v is not None or k in ("fps", "num_frames")})


def resolve(base: VideoOptions, *overrides: dict[str, Any] | None) -> VideoOptions:
    """`base` with each override applied in turn (later wins); ValueError names a bad key or value.
    Giving `num_frames` clears an inherited `fps` and vice versa (they are exclusive)."""
    fields = base.as_dict()
    for override in overrides:
        if not override:
            continue
        if not isinstance(override, dict):
            raise ClientError("video options must be an object")
        unknown = sorted(set(override) - set(KEYS))
        if unknown:
            raise ClientError(f"unknown video option(s) {', '.join(unknown)}; known: {', '.join(KEYS)}")
        if "num_frames" in override and "fps" not in override:
            fields["fps"] = None
        if "fps" in override and "num_frames" not in override:
            fields["num_frames"] = None
        fields.update(override)
    if fields["fps"] is not None and fields["num_frames"] is not None:
        raise ClientError("video options fps and num_frames are exclusive: give one")
    return VideoOptions(**fields)


def sample_indices(meta: VideoMetadata, opts: VideoOptions, family: str, temporal_patch: int) -> np.ndarray:
    """The source frame indices to keep (sorted; repeats possible), as the family's transformers
    video processor picks them. ValueError when the options ask for more frames than exist."""
    total = meta.total_num_frames
    if not opts.do_sample_frames:
        return np.arange(total)
    if family == "qwen3_vl":
        return _sample_qwen3(meta, opts)
    return _sample_qwen2(meta, opts, temporal_patch)


def _sample_qwen3(meta: VideoMetadata, opts: VideoOptions) -> np.ndarray:
    total, num_frames = meta.total_num_frames, opts.num_frames
    if num_frames is None and opts.fps is not None:
        source_fps = meta.fps if meta.fps is not None else 24  # transformers' default
        num_frames = int(total / source_fps * opts.fps)
        num_frames = min(max(num_frames, opts.min_frames), opts.max_frames, total)
    if num_frames is None:
        num_frames = min(max(total, opts.min_frames), opts.max_frames)
    return np.linspace(0, total - 1, num_frames).round().astype(int)


def _sample_qwen2(meta: VideoMetadata, opts: VideoOptions, temporal_patch: int) -> np.ndarray:
    import torch

    total, num_frames = meta.total_num_frames, opts.num_frames
    if num_frames is not None:
        num_frames = round(num_frames / temporal_patch) * temporal_patch
    elif opts.fps is not None:
        if meta.fps is None:
            raise ClientError("sampling by fps needs the video's frame rate; give num_frames instead")
        max_frames = math.floor(min(opts.max_frames, total) / temporal_patch) * temporal_patch
        count = min(max(total / meta.fps * opts.fps, opts.min_frames), max_frames, total)
        num_frames = math.floor(count / temporal_patch) * temporal_patch
    if num_frames is None:
        return np.arange(total)
    if num_frames > total:
        raise ClientError(f"the video has {total} frames, fewer than the {num_frames} to sample; lower num_frames "
                         "or fps")
    if num_frames <= 0:
        raise ClientError(f"the video has {total} frame(s): too few to sample for this model")
    return torch.arange(0, total, total / num_frames).int().numpy().astype(np.int64)
