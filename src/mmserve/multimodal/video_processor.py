"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL video pixels (P0), the same values as transformers' video processors.

transformers' `Qwen2VLVideoProcessor` and `Qwen3VLVideoProcessor` need torchvision, which this
CPU torch lacks; this module does what their `_preprocess` does, step for step:

1. sized by the family's `smart_resize` (imported from transformers): Qwen2(.5)-VL per frame
   (`min_pixels <= h*w <= max_pixels`), Qwen3-VL over the clip (`t*h*w`, t = sampled frames);
2. resized as torchvision's `resize` does a uint8 [T, C, H, W] tensor on the CPU (bicubic,
   antialias, uint8 in and out: torch's native uint8 kernel; an unchanged size is not resampled);
3. an odd frame count padded with the last frame, then patchified into rows
   [t * h * w, C * Tp * p * p] in (group, merge-block row, merge-block column, row, column) order;
4. rescaled and normalized fused, as `TorchvisionBackend.rescale_and_normalize`: float32
   `(x - mean / r) / (std / r)` with r the rescale factor. This step is elementwise, so it is a
   table (`lut`) the worker applies on its device: the rows stay uint8 codes (ipc/pixel_codes.py).

The result is split per temporal group (Tp frames): each group is an item of its own for every
cache layer (see `qwen_processor.py`), with the data an image has (`pixel_codes`, `pixel_lut`,
`image_grid_thw` = (1, h, w)).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmserve.errors import ClientError
from mmserve.ipc.pixel_codes import lut_from
from mmserve.multimodal.video_options import VideoOptions

_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)
_FAMILY_DEFAULTS = {  # the transformers classes' defaults, where the checkpoint's config is silent
    "qwen2_vl": dict(image_mean=_CLIP_MEAN, image_std=_CLIP_STD, patch_size=14),
    "qwen2_5_vl": dict(image_mean=_CLIP_MEAN, image_std=_CLIP_STD, patch_size=14),
    "qwen3_vl": dict(image_mean=_HALF, image_std=_HALF, patch_size=16),
}


@dataclass(frozen=True)
class ProcessedVideo:
    """One video's processed pixels, split per temporal group.

    `pixel_codes`: [G * h * w, C * Tp * p * p] uint8 (group g's rows are [g * h * w, (g + 1) * h * w)),
    `pixel_lut`: [C, 256] float32, their values (ipc/pixel_codes.py); `grid`: (G, h, w) in patches;
    `timestamps`: each group's time in seconds (the mean of its first and last frame times, as
    Qwen3-VL's processor writes it); `second_per_grid_ts`: seconds per group (Qwen2.5-VL's temporal position scale)."""

    pixel_codes: torch.Tensor
    pixel_lut: torch.Tensor
    grid: tuple[int, int, int]
    timestamps: list[float]
    second_per_grid_ts: float

    def group(self, g: int) -> dict[str, torch.Tensor]:
        """Group g as an item's data: the same keys as an image's."""
        _, h, w = self.grid
        return {"pixel_codes": self.pixel_codes[g * h * w:(g + 1) * h * w], "pixel_lut": self.pixel_lut,
                "image_grid_thw": torch.tensor([1, h, w], dtype=torch.int64)}


def video_config(model_path: str) -> dict[str, Any]:
    """The video processor's settings as transformers' `BaseVideoProcessor.get_video_processor_dict`
    finds them: `processor_config.json`'s nested `video_processor`, else
    `video_preprocessor_config.json`, else `preprocessor_config.json` (Qwen2-VL's and Qwen2.5-VL's
    published repos have no video file: their videos take the image processor's pixel budget,
    `min_pixels` / `max_pixels`), else nothing (the class defaults)."""
    nested = _read_json(os.path.join(model_path, "processor_config.json")).get("video_processor")
    if isinstance(nested, dict):
        return nested
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        path = os.path.join(model_path, name)
        if os.path.isfile(path):
            return _read_json(path)
    return {}


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        loaded = json.load(f)
    return loaded if isinstance(loaded, dict) else {}


class QwenVideoProcessor:
    """The checkpoint's video processor settings, from the file transformers reads them from
    (`video_config`)."""

    def __init__(self, model_path: str, family: str) -> None:
        config = video_config(model_path)
        defaults = _FAMILY_DEFAULTS[family]
        self.family = family
        self.patch_size = int(config.get("patch_size", defaults["patch_size"]))
        self.temporal_patch_size = int(config.get("temporal_patch_size", 2))
        self.merge_size = int(config.get("merge_size", 2))
        self.rescale_factor = float(config.get("rescale_factor", 1 / 255))
        self.image_mean = tuple(config.get("image_mean", defaults["image_mean"]))
        self.image_std = tuple(config.get("image_std", defaults["image_std"]))
        self.defaults = VideoOptions.from_config(config)
        codes = torch.arange(256, dtype=torch.uint8).expand(3, 256)  # [C, 256]: every code per channel
        self.lut = lut_from(codes[None], self._normalize(codes[None, :, None])[:, :, 0])  # [C, 256] float32

    def settings(self) -> dict[str, Any]:
        """What changes the pixels besides the options (for the item hash)."""
        return {"family": self.family, "patch": self.patch_size, "temporal_patch": self.temporal_patch_size,
                "merge": self.merge_size, "rescale": self.rescale_factor, "mean": list(self.image_mean),
                "std": list(self.image_std)}

    def target_size(self, num_frames: int, height: int, width: int, opts: VideoOptions) -> tuple[int, int]:
        """(height, width) after resizing, by the family's `smart_resize` (ValueError on an
        aspect ratio over 200)."""
        factor = self.patch_size * self.merge_size
        if self.family == "qwen3_vl":
            from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as video_resize

            return video_resize(max(num_frames, self.temporal_patch_size), height, width, self.temporal_patch_size,
                                factor, opts.min_pixels, opts.max_pixels)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        return smart_resize(height, width, factor, opts.min_pixels, opts.max_pixels)

    def process(self, frames: np.ndarray, indices: np.ndarray, source_fps: float | None,
                total_frames: int, opts: VideoOptions) -> ProcessedVideo:
        """frames: [T, H, W, 3] uint8 RGB, the sampled frames at source `indices`."""
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
            raise ClientError(f"video frames must be a non-empty T x H x W x 3 uint8 array; got {frames.dtype} "
                             f"{tuple(frames.shape)}")
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()  # [T, C, H, W]
        height, width = self.target_size(len(frames), video.shape[-2], video.shape[-1], opts)
        return self.process_resized(resize_like_torchvision(video, height, width), indices, source_fps, total_frames)

    def process_resized(self, video: torch.Tensor, indices: np.ndarray, source_fps: float | None,
                        total_frames: int) -> ProcessedVideo:
        """video: [T, C, H, W] uint8, the sampled frames already at `target_size` (the serving
        path resizes each frame as it is decoded: multimodal/video_items.py)."""
        codes, grid = patchify(video, self.temporal_patch_size, self.patch_size, self.merge_size)
        fps = source_fps if source_fps else 24.0
        sampled_fps = len(indices) / total_frames * fps if total_frames else fps
        return ProcessedVideo(codes, self.lut, grid, self.timestamps(indices, fps),
                              self.temporal_patch_size / sampled_fps)

    def timestamps(self, indices: np.ndarray, fps: float) -> list[float]:
        """Qwen3VLProcessor._calculate_timestamps: per group, the mean of its first and last
        frame's time (an odd count padded with the last index)."""
        idx = [int(i) for i in indices]
        tp = self.temporal_patch_size
        idx += [idx[-1]] * (-len(idx) % tp)
        times = [i / fps for i in idx]
        return [(times[i] + times[i + tp - 1]) / 2 for i in range(0, len(times), tp)]

    def _normalize(self, video: torch.Tensor) -> torch.Tensor:
        """[T, C, H, W] uint8 -> float32, as the transformers class computes it."""
        mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)  # float32, fused as transformers does
        std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
        return video.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))


def patchify(video: torch.Tensor, tp: int, p: int, m: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[T, C, H, W] -> rows [G * h * w, C * tp * p * p] and the grid (G, h, w), as the Qwen-VL
    processors lay them out (an odd frame count padded with the last frame; an image is one
    frame, repeated)."""
    frames, channels, height, width = video.shape
    gh, gw = height // p, width // p
    if frames == 1:  # an image: its patches laid out once, then repeated over tp (the cheaper copy)
        patches = video[0].reshape(channels, gh // m, m, p, gw // m, m, p)
        patches = patches.permute(1, 4, 2, 5, 0, 3, 6).contiguous()  # [gh/m, gw/m, m, m, C, p, p]
        patches = patches.unsqueeze(5).expand(*patches.shape[:5], tp, p, p)  # [..., C, tp, p, p], no copy
        return patches.reshape(gh * gw, channels * tp * p * p), (1, gh, gw)
    if pad := -frames % tp:
        video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)))
    gt = video.shape[0] // tp
    patches = video.reshape(gt, tp, channels, gh // m, m, p, gw // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gt * gh * gw, channels * tp * p * p), (gt, gh, gw)


def resize_like_torchvision(video: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision.transforms.v2.functional.resize of a uint8 [T, C, H, W] CPU tensor with
    bicubic interpolation and antialias (its default): torch's native uint8 kernel on the CPU
    (`_do_native_uint8_resize_on_cpu` is true for bicubic); the same size returns the input."""
    if tuple(video.shape[-2:]) == (height, width):
        return video
    return torch.nn.functional.interpolate(video, size=[height, width], mode="bicubic", align_corners=False,
                                           antialias=True)
