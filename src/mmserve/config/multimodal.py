"""The multimodal layer's config: media limits, the item caches, the processor's defaults."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmserve.config.fields import comma_list, opt

if TYPE_CHECKING:
    from mmserve.multimodal.media import MediaLimits
    from mmserve.multimodal.video import VideoLimits

# the keys of mm_processor_kwargs (qwen_processor.MM_KWARGS, video_options.REQUEST_KEYS): an image's
# pixel budget, a video's sampling
IMAGE_KWARGS = ("min_pixels", "max_pixels")
VIDEO_KWARGS = ("fps", "num_frames", "min_frames", "max_frames")


@dataclass(frozen=True)
class MultiModalConfig:
    limit_mm_per_prompt: dict[str, int] = opt(
        {"image": 4}, 'Most items per prompt by modality, as JSON: {"image": 4, "video": 1} (video defaults '
        'to 1).', parse=json.loads)
    allowed_local_media_path: str | None = opt(
        None, "Directory under which file:// images may be read (default: none may).")
    max_media_bytes: int = opt(20 << 20, "Largest encoded image in bytes.")
    mm_processor_cache_gb: float = opt(4.0, "P0's processed-item cache in GiB (0 turns it off).")
    mm_ipc_cache_gb: float = opt(4.0, "P0 -> P1 item cache in GiB, mirrored on both sides (0 turns it off).")
    mm_cache_type: str | None = opt(
        None, "How processed items reach P1: lru (the IPC cache) or shm (shared memory). Default: shm with "
        "--api-server-count > 1 when /dev/shm holds --mm-shm-cache-gb (one store for the node), else lru.",
        choices=("lru", "shm"))
    mm_shm_cache_gb: float = opt(4.0, "Shared-memory object store size in GiB (with --mm-cache-type shm).")
    mm_shm_max_object_mb: float = opt(128.0, "Largest item the shared-memory store takes, in MiB.")
    max_media_pixels: int = opt(40_000_000, "Largest decoded image in pixels (width x height).")
    allowed_media_domains: list[str] = opt(
        [], "Hosts http(s) images may be fetched from, comma-separated or repeated (default: none).",
        parse=lambda text: comma_list(text), action="extend")
    allow_private_media_addresses: bool = opt(
        False, "Let an allowed media host resolve to loopback, link-local or private addresses (default: such "
        "a fetch is refused, so a request cannot reach this machine or its network through an image URL).")
    max_video_bytes: int = opt(256 << 20, "Largest encoded video in bytes.")
    max_video_frames: int = opt(768, "Most frames a video may keep after sampling.")
    max_video_duration_s: float = opt(3600.0, "Longest video in seconds.")
    max_video_pixels: int = opt(1 << 28, "Most pixels a video's sampled frames may hold together (frames x width "
                                "x height at the source size), checked from the container's metadata before "
                                "decoding.")
    media_io_kwargs: dict[str, Any] = opt(
        {}, 'Server-wide media loading options, as JSON: {"video": {"fps": 1, "num_frames": 16, "min_frames": 4, '
        '"max_frames": 64, "min_pixels": 4096, "max_pixels": 65536}} (a request\'s media_io_kwargs and '
        'mm_processor_kwargs override them).', parse=json.loads)
    mm_processor_kwargs: dict[str, Any] = opt(
        {}, 'Server-wide processor settings, as JSON (vLLM\'s): an image\'s pixel budget {"min_pixels": 3136, '
        '"max_pixels": 1003520} and a video\'s sampling {"fps": 1, "num_frames": 16, "min_frames": 4, '
        '"max_frames": 64}, for the models that take them (Qwen-VL); a request\'s own mm_processor_kwargs (and, '
        'for videos, media_io_kwargs) override them key by key.', parse=json.loads)

    def __post_init__(self) -> None:
        if isinstance(self.allowed_media_domains, str):
            object.__setattr__(self, "allowed_media_domains", comma_list(self.allowed_media_domains))
        if not isinstance(self.limit_mm_per_prompt, dict):
            raise ValueError(f'limit_mm_per_prompt must be a JSON object such as {{"image": 4}}; '
                             f"got {self.limit_mm_per_prompt!r}")
        limits = {m: _item_limit(m, v) for m, v in self.limit_mm_per_prompt.items()}
        object.__setattr__(self, "limit_mm_per_prompt", limits)
        if self.max_media_bytes < 1 or self.max_media_pixels < 1:
            raise ValueError("max_media_bytes and max_media_pixels must be positive")
        if (self.max_video_bytes < 1 or self.max_video_frames < 1 or self.max_video_duration_s <= 0
                or self.max_video_pixels < 1):
            raise ValueError("max_video_bytes, max_video_frames, max_video_duration_s and max_video_pixels must be "
                             "positive")
        if not isinstance(self.media_io_kwargs, dict) or set(self.media_io_kwargs) - {"video"}:
            raise ValueError('media_io_kwargs takes only the key "video" (an object of video options)')
        _check_processor_kwargs(self.mm_processor_kwargs)
        for name in ("mm_processor_cache_gb", "mm_ipc_cache_gb", "mm_shm_cache_gb", "mm_shm_max_object_mb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative; got {getattr(self, name)}")
        if self.mm_cache_type not in (None, "lru", "shm"):
            raise ValueError(f"mm_cache_type must be lru or shm; got {self.mm_cache_type!r}")

    def media_limits(self) -> MediaLimits:
        from mmserve.multimodal.media import MediaLimits

        return MediaLimits(max_bytes=self.max_media_bytes, max_pixels=self.max_media_pixels,
                           allowed_local_media_path=self.allowed_local_media_path,
                           allowed_media_domains=tuple(self.allowed_media_domains),
                           allow_private_addresses=self.allow_private_media_addresses)

    @property
    def image_processor_kwargs(self) -> dict[str, Any]:
        """The image keys of `mm_processor_kwargs`: each request's, unless it gives its own."""
        return {k: v for k, v in self.mm_processor_kwargs.items() if k in IMAGE_KWARGS}

    @property
    def video_processor_kwargs(self) -> dict[str, Any]:
        """The video keys of `mm_processor_kwargs`: the server's video options, over `media_io_kwargs`'."""
        return {k: v for k, v in self.mm_processor_kwargs.items() if k in VIDEO_KWARGS}

    @property
    def max_images(self) -> int:
        return self.limit_mm_per_prompt.get("image", 4)

    @property
    def max_videos(self) -> int:
        return self.limit_mm_per_prompt.get("video", 1)

    def video_limits(self) -> VideoLimits:
        from mmserve.multimodal.video import VideoLimits

        return VideoLimits(max_frames=self.max_video_frames, max_duration_s=self.max_video_duration_s,
                           max_pixels=self.max_media_pixels, max_total_pixels=self.max_video_pixels)

    # ---- the item transport, decided once: P0 and P1 both read these ----------------------------

    @property
    def uses_shm(self) -> bool:
        """Items reach P1 (and TP workers) through the shared-memory store, not the IPC cache (an
        unset `mm_cache_type` is lru here; `deployment_defaults.py` decides it for a server)."""
        return self.mm_cache_type == "shm" and self.mm_shm_cache_gb > 0

    @property
    def ipc_cache_bytes(self) -> int:
        """Capacity of the mirrored IPC cache, the same on both sides: 0 under shm (P1 keeps no
        receiver entries then, neither inline items nor views of shared memory)."""
        return 0 if self.mm_cache_type == "shm" else int(self.mm_ipc_cache_gb * (1 << 30))


def _check_processor_kwargs(kwargs: Any) -> None:
    """The server's `mm_processor_kwargs`: an object of known keys, each a positive integer (`fps`: a
    positive finite number). Whether the model takes them is the processor's to say (at start)."""
    if not isinstance(kwargs, dict):
        raise ValueError("mm_processor_kwargs must be an object of processor settings")
    unknown = sorted(set(kwargs) - set(IMAGE_KWARGS) - set(VIDEO_KWARGS))
    if unknown:
        raise ValueError(f"mm_processor_kwargs: unknown key(s) {', '.join(unknown)}; known: "
                         f"{', '.join(IMAGE_KWARGS + VIDEO_KWARGS)}")
    for key, value in kwargs.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value <= 0 or (key != "fps" and not isinstance(value, int)):
            kind = "a positive finite number" if key == "fps" else "a positive integer"
            raise ValueError(f"mm_processor_kwargs.{key} must be {kind}; got {value!r:.40}")


def _item_limit(modality: str, limit: Any) -> int:
    """One modality's limit: a count, or vLLM's `{"count": N, "width": ..., "height": ...}` (its
    sizes are vLLM's memory-profiling hints: the count is what limits a prompt here)."""
    if modality not in ("image", "video"):
        raise ValueError(f"limit_mm_per_prompt: unknown modality {modality!r} (image or video)")
    if isinstance(limit, dict) and set(limit) <= {"count", "width", "height", "num_frames"}:
        limit = limit.get("count")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be a non-negative integer (or vLLM's "
                         f'{{"count": N, ...}}); got {limit!r}')
    return limit
