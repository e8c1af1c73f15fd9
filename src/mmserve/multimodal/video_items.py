"""P0: each video of a request -> its hash, its processed groups, and one item per temporal group.

Videos go through the item pipeline every modality shares (multimodal/items.py): read the source's
bytes (no decoding), hash them with the video options that change the pixels, look the hash up in
the processor cache, take a video another request is processing from that request (in-flight
dedup), and only on a miss size it and decode it (PyAV) and process it. Sizing comes first
(`VideoModality.plan`): the container's metadata gives the sampled frame indices, the target size
and so every group's token count, all checked (frames, pixels, encoder budget, max_model_len)
before a frame is decoded; decoding then keeps each sampled frame only at its target size.

The processor cache holds the whole processed video (`VideoEntry` tensors); the request then
carries one `MultiModalItem` per temporal group, keyed by the hash of that group's pixels (and
grid, model, salt), so the IPC / shm layers, the encoder cache and the prefix blocks all work per
group: a clip that shares its first frames with an earlier video, or a video re-sent with frames
appended, reuses every group already seen. Entries are committed with the request's images, so a
rejected request leaves none.
"""

from __future__ import annotations

import dataclasses
import uuid as uuid_lib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from mmserve.errors import ClientError
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.multimodal.budget import ItemBudget
from mmserve.multimodal.hasher import ItemHasher
from mmserve.multimodal.items import InFlight, ItemPipeline, ResolvedItem
from mmserve.multimodal.media import MediaError, MediaLimits, read_media_bytes
from mmserve.multimodal.processor_api import VideoItemProcessor
from mmserve.multimodal.processor_cache import ProcessorCache
from mmserve.multimodal.video import (FLAG_MAX_FRAMES, FLAG_MAX_TOTAL_PIXELS, VideoLimits, VideoMetadata,
                                      check_sampled, check_video, decode_frames, probe_video)
from mmserve.multimodal.video_options import REQUEST_KEYS, VideoOptions, resolve, sample_indices
from mmserve.multimodal.video_processor import ProcessedVideo, resize_like_torchvision

FLAG_MAX_VIDEO_BYTES = "--max-video-bytes"

RawVideo = bytes | tuple[np.ndarray, float | None]  # encoded bytes, or (frames [T, H, W, 3] uint8, fps)


@dataclass(frozen=True)
class VideoPlan:
    """A video sized before decoding: its metadata, the source frames to keep, their target size."""

    meta: VideoMetadata
    indices: np.ndarray
    height: int
    width: int


class VideoModality:
    """Videos for the item pipeline: `settings` are a `VideoOptions`; `data` is a `VideoEntry`
    dict; `num_tokens` counts one temporal group (the unit budgets and caches count in)."""

    kind = "video"

    def __init__(self, processor: VideoItemProcessor, media: MediaLimits, limits: VideoLimits,
                 budget: ItemBudget, hasher: ItemHasher, hashing: bool) -> None:
        self.processor = processor
        self.media = media
        self.limits = limits
        self.budget = budget
        self.hasher = hasher
        self.hashing = hashing
        self.num_decoded = 0  # videos decoded since start

    def settings(self, requested: Any) -> VideoOptions:
        assert isinstance(requested, VideoOptions), "videos are resolved with their VideoOptions"
        return requested

    def hashed_settings(self, settings: VideoOptions) -> dict[str, Any]:
        return settings.as_dict()

    def hash_key(self, raw: RawVideo) -> Any:
        return raw if isinstance(raw, bytes) else [raw[0], raw[1]]

    def num_tokens(self, data: dict[str, Any]) -> int:
        _, h, w = (int(v) for v in data["video_grid_thw"].tolist())
        return h * w // self.processor.merge_size**2

    def read(self, source: Any) -> RawVideo:
        """Encoded bytes (a URL, path or bytes) or (frames [T, H, W, 3] uint8, fps)."""
        if isinstance(source, str):
            return read_media_bytes(source, self.media, kind="video")
        if isinstance(source, (bytes, bytearray)):
            if len(source) > self.media.max_bytes:
                raise MediaError(f"the video has {len(source)} bytes, more than the limit of {self.media.max_bytes} "
                                 f"({FLAG_MAX_VIDEO_BYTES})")
            return bytes(source)
        if isinstance(source, dict) and set(source) <= {"frames", "fps"}:
            source = (source.get("frames"), source.get("fps"))
        if isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], np.ndarray):
            frames, fps = source
            if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or not len(frames):
                raise ClientError(f"video frames must be a non-empty T x H x W x 3 uint8 array; got {frames.dtype} "
                                 f"{tuple(frames.shape)}")
            if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0):
                raise ClientError(f"a video's fps must be a positive number; got {fps!r:.40}")
            return np.ascontiguousarray(frames), None if fps is None else float(fps)
        raise ClientError("a video is a URL / path string, encoded bytes, or (frames: T x H x W x 3 uint8 array, fps)")

    def plan(self, index: int, raw: RawVideo, opts: VideoOptions) -> VideoPlan:
        """The frames to keep and their target size, from the metadata alone; MediaError (or the
        budget's ValueError) for a video over a limit, before any frame is decoded."""
        if isinstance(raw, bytes):
            meta = probe_video(raw)
        else:
            meta = VideoMetadata(len(raw[0]), raw[1], raw[0].shape[2], raw[0].shape[1])
        check_video(meta, self.limits)
        video = self.processor.video
        try:
            indices = sample_indices(meta, opts, self.processor.family, video.temporal_patch_size)
            check_sampled(len(indices), self.limits, meta)
            height, width = video.target_size(len(indices), meta.height, meta.width, opts)
        except MediaError:
            raise
        except ValueError as e:
            raise MediaError(f"the video cannot be sampled or sized: {e}") from None
        patch, tp = video.patch_size, video.temporal_patch_size
        groups = -(-len(indices) // tp)
        self.budget.check_video(index, (height // patch) * (width // patch) // video.merge_size**2, groups)
        return VideoPlan(meta, np.asarray(indices, dtype=np.int64), height, width)

    def process(self, raw: RawVideo, opts: VideoOptions, plan: VideoPlan, salt: str | None) -> dict[str, Any]:
        """Decode the planned frames, each resized to the target size as it is decoded, then
        normalize and patchify them; the cache entry with its groups' (salted) hashes."""
        height, width = plan.height, plan.width

        def shrink(frame: np.ndarray) -> torch.Tensor:  # [H, W, 3] -> [3, height, width] uint8
            chw = torch.from_numpy(np.ascontiguousarray(frame)).permute(2, 0, 1).contiguous()
            return resize_like_torchvision(chw.unsqueeze(0), height, width)[0]

        if isinstance(raw, bytes):
            frames = decode_frames(raw, plan.indices, shrink)
            self.num_decoded += 1
        else:
            done: dict[int, torch.Tensor] = {}
            frames = [done.setdefault(int(i), shrink(raw[0][int(i)])) if int(i) not in done else done[int(i)]
                      for i in plan.indices]
        try:
            video = self.processor.video.process_resized(torch.stack(frames), plan.indices, plan.meta.fps,
                                                         plan.meta.total_num_frames)
        except ValueError as e:
            raise MediaError(f"the video cannot be sampled or sized: {e}") from None
        return self._entry(video, salt)

    def _entry(self, video: ProcessedVideo, salt: str | None) -> dict[str, torch.Tensor]:
        """The processor-cache entry: the video's tensors and each group's content hash."""
        groups = [video.group(g) for g in range(video.grid[0])]
        if self.hashing:
            hashes = [self.hasher.hash_item("video_group", g["pixel_codes"], salt,
                                            {"grid": g["image_grid_thw"].tolist()}) for g in groups]
        else:
            hashes = [uuid_lib.uuid4().hex for _ in groups]
        return {"pixel_codes": video.pixel_codes, "pixel_lut": video.pixel_lut,
                "video_grid_thw": torch.tensor(video.grid, dtype=torch.int64),
                "timestamps": torch.tensor(video.timestamps, dtype=torch.float64),
                "second_per_grid_ts": torch.tensor([video.second_per_grid_ts], dtype=torch.float64),
                "group_hashes": torch.tensor([list(bytes.fromhex(h)) for h in hashes], dtype=torch.uint8)}


class VideoResolver(ItemPipeline):
    """The video pipeline: `ItemPipeline` over `VideoModality`, with the request's options
    merged over the checkpoint's and the server's, and clamped to the server's limits."""

    def __init__(self, hasher: ItemHasher, processor: VideoItemProcessor, cache: ProcessorCache, media: MediaLimits,
                 video_limits: VideoLimits, max_video_bytes: int, server_options: Sequence[dict[str, Any] | None],
                 hashing: bool, budget: ItemBudget | None = None, inflight: InFlight | None = None) -> None:
        media = dataclasses.replace(media, max_bytes=max_video_bytes)
        self.video_modality = VideoModality(processor, media, video_limits, budget or ItemBudget(), hasher, hashing)
        super().__init__(self.video_modality, hasher, cache, hashing, inflight=inflight)
        self.limits = video_limits
        self.base = resolve(processor.video.defaults, *server_options)  # each applied in turn

    @property
    def num_decoded(self) -> int:
        """Videos decoded since start."""
        return self.video_modality.num_decoded

    def options(self, mm_kwargs: dict[str, Any] | None, media_io_kwargs: dict[str, Any] | None) -> VideoOptions:
        """The request's video options: the server's, then `media_io_kwargs["video"]`, then the
        video keys of `mm_processor_kwargs`; ValueError names a bad one, or the server limit a
        frame count or pixel budget goes beyond."""
        media_io = dict(media_io_kwargs or {})
        if set(media_io) - {"video"}:
            raise ClientError('media_io_kwargs takes only the key "video"')
        request = {k: v for k, v in (mm_kwargs or {}).items() if k in REQUEST_KEYS}
        opts = resolve(self.base, media_io.get("video"), request)
        for key in ("num_frames", "min_frames"):  # either may become the sampled count
            value = getattr(opts, key)
            if value is not None and value > self.limits.max_frames:
                raise MediaError(f"video option {key} ({value}) exceeds the server's limit of "
                                 f"{self.limits.max_frames} frames ({FLAG_MAX_FRAMES})")
        if opts.min_pixels > self.limits.max_total_pixels:
            raise MediaError(f"video option min_pixels ({opts.min_pixels}) exceeds the server's limit of "
                             f"{self.limits.max_total_pixels} pixels ({FLAG_MAX_TOTAL_PIXELS})")
        return opts


def as_processed(entry: dict[str, Any] | None) -> ProcessedVideo:
    """A processor-cache entry back as the processed video (a resolved video always has one)."""
    assert entry is not None, "a video item without its processed data"
    t, h, w = (int(v) for v in entry["video_grid_thw"].tolist())
    return ProcessedVideo(entry["pixel_codes"], entry["pixel_lut"], (t, h, w), entry["timestamps"].tolist(),
                          float(entry["second_per_grid_ts"][0]))


def group_items(processor: VideoItemProcessor, token_ids: list[int],
                videos: list[ResolvedItem]) -> list[MultiModalItem]:
    """One item per temporal group of each video, at its run of `<|video_pad|>` tokens in order."""
    positions = [i for i, token in enumerate(token_ids) if token == processor.video_token_id]
    items: list[MultiModalItem] = []
    taken = 0
    for video_index, resolved in enumerate(videos):
        video = as_processed(resolved.data)
        hashes = [bytes(row.tolist()).hex() for row in video_data(resolved)["group_hashes"]]
        per_group = video.grid[1] * video.grid[2] // processor.merge_size**2
        for g, mm_hash in enumerate(hashes):
            run = positions[taken:taken + per_group]
            if len(run) != per_group or run[-1] - run[0] + 1 != per_group:
                raise ClientError(f"the placeholder tokens of video {video_index} are not where its groups need them")
            taken += per_group
            data = video.group(g)
            place = processor.position_key(data, (g, video.second_per_grid_ts))
            items.append(MultiModalItem("video", mm_hash, data, PlaceholderRange(run[0], per_group),
                                        position_key=place))
    if taken != len(positions):
        raise ClientError(f"the prompt has {len(positions) - taken} {processor.video_token} token(s) no video fills")
    return items


def video_data(resolved: ResolvedItem) -> dict[str, Any]:
    assert resolved.data is not None, "a video item without its processed data"
    return resolved.data
