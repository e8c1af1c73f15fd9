"""P0: each video of a request -> its hash, its processed groups, and one item per temporal group.

Order per video, as for images (multimodal/items.py): read the source's bytes (no decoding), hash
them with the video options that change the pixels, look the hash up in the processor cache, and
only on a miss decode (PyAV) and process. A repeated video is therefore neither decoded nor
processed again. The processor cache holds the whole processed video (`VideoEntry` tensors);
the request then carries one `MultiModalItem` per temporal group, keyed by the hash of that
group's pixels (and grid, model, salt), so the IPC / shm layers, the encoder cache and the
prefix blocks all work per group: a clip that shares its first frames with an earlier video, or a
video re-sent with frames appended, reuses every group already seen.

Entries are committed to the processor cache with the request's images (`ItemResolver.commit`),
so a rejected request leaves none. Unlike images, a video being processed by another request's
thread is not waited for (a burst of one new video may process it more than once).
"""

from __future__ import annotations

import dataclasses
import uuid as uuid_lib
from typing import Any

import numpy as np
import torch

from mmserve.errors import ClientError
from mmserve.multimodal.processor_cache import ProcessorCache
from mmserve.multimodal.hasher import ItemHasher
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.multimodal.items import ResolvedItem
from mmserve.multimodal.media import MediaError, MediaLimits, read_media_bytes
from mmserve.multimodal.video import VideoLimits, VideoMetadata, check_sampled, check_video, decode_video
from mmserve.multimodal.video_options import REQUEST_KEYS, VideoOptions, resolve, sample_indices
from mmserve.multimodal.video_processor import ProcessedVideo

FLAG_MAX_VIDEO_BYTES = "--max-video-bytes"


class VideoResolver:
    """Video sources (+ uuids, salt, the request's options) -> `ResolvedItem`s whose `data` is
    a `VideoEntry` dict. `processor`: the Qwen P0 processor (its `video` and `expand_videos`)."""

    def __init__(self, hasher: ItemHasher, processor: Any, cache: ProcessorCache, media: MediaLimits,
                 video_limits: VideoLimits, max_video_bytes: int, server_options: dict[str, Any] | None,
                 hashing: bool) -> None:
        self.hasher = hasher
        self.processor = processor
        self.cache = cache
        self.media = dataclasses.replace(media, max_bytes=max_video_bytes)
        self.limits = video_limits
        self.hashing = hashing
        self.base = resolve(processor.video.defaults, server_options)
        self.num_decoded = 0  # videos decoded since start

    def options(self, mm_kwargs: dict[str, Any] | None, media_io_kwargs: dict[str, Any] | None) -> VideoOptions:
        """The request's video options: the server's, then `media_io_kwargs["video"]`, then the
        video keys of `mm_processor_kwargs` (ValueError names a bad one)."""
        media_io = dict(media_io_kwargs or {})
        if set(media_io) - {"video"}:
            raise ClientError('media_io_kwargs takes only the key "video"')
        request = {k: v for k, v in (mm_kwargs or {}).items() if k in REQUEST_KEYS}
        return resolve(self.base, media_io.get("video"), request)

    def resolve(self, sources: list[Any], uuids: list[str | None], salt: str | None,
                opts: VideoOptions, bypass: bool = False) -> list[ResolvedItem]:
        """Each video's entry; with `bypass` (a shadow run) decoded and processed again, the
        processor cache neither read nor written."""
        return [self._resolve_one(source, uid, salt, opts, bypass) for source, uid in zip(sources, uuids)]

    def _resolve_one(self, source: Any, uid: str | None, salt: str | None, opts: VideoOptions,
                     bypass: bool = False) -> ResolvedItem:
        settings = opts.as_dict()
        if uid is not None:
            mm_hash = self.hasher.hash_uuid("video", uid, salt, settings)
            if source is None and bypass:
                raise ClientError("a video given by uuid alone cannot be processed again")
            if source is None:
                data = self.cache.get(mm_hash) if self.cache.enabled else None
                if data is None:
                    raise ClientError(f"the video with uuid {uid!r} is not cached (any more): send the video again "
                                     "together with its uuid")
                return ResolvedItem(mm_hash, data, _num_tokens(data, self.processor), fresh=False, hit=True)
        raw = self._read(source)
        if uid is None:
            key = raw if isinstance(raw, bytes) else [raw[0], raw[1]]
            mm_hash = self.hasher.hash_item("video", key, salt, settings) if self.hashing else uuid_lib.uuid4().hex
        looked_up = self.cache.enabled and not bypass
        cached = self.cache.get(mm_hash) if looked_up else None
        data = cached if cached is not None else self._process(raw, opts, salt)
        return ResolvedItem(mm_hash, data, _num_tokens(data, self.processor), fresh=cached is None and not bypass,
                            hit=cached is not None if looked_up else None)

    def _read(self, source: Any) -> bytes | tuple[np.ndarray, float | None]:
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

    def _process(self, raw: bytes | tuple[np.ndarray, float | None], opts: VideoOptions,
                 salt: str | None) -> dict[str, torch.Tensor]:
        family, tp = self.processor.family, self.processor.video.temporal_patch_size
        try:
            if isinstance(raw, bytes):
                decoded = decode_video(raw, lambda meta: sample_indices(meta, opts, family, tp), self.limits)
                self.num_decoded += 1
                frames, indices, meta = decoded.frames, decoded.indices, decoded.metadata
            else:
                all_frames, fps = raw
                meta = VideoMetadata(len(all_frames), fps, all_frames.shape[2], all_frames.shape[1])
                check_video(meta, self.limits)
                indices = sample_indices(meta, opts, family, tp)
                check_sampled(len(indices), self.limits)
                frames = all_frames[indices]
            video = self.processor.video.process(frames, indices, meta.fps, meta.total_num_frames, opts)
        except MediaError:
            raise
        except ValueError as e:
            raise MediaError(f"the video cannot be sampled or sized: {e}") from None
        return self._entry(video, salt)

    def _entry(self, video: ProcessedVideo, salt: str | None) -> dict[str, torch.Tensor]:
        groups = [video.group(g) for g in range(video.grid[0])]
        if self.hashing:
            hashes = [self.hasher.hash_item("video_group", g["pixel_values"], salt,
                                            {"grid": g["image_grid_thw"].tolist()}) for g in groups]
        else:
            hashes = [uuid_lib.uuid4().hex for _ in groups]
        return {"pixel_values": video.pixel_values, "video_grid_thw": torch.tensor(video.grid, dtype=torch.int64),
                "timestamps": torch.tensor(video.timestamps, dtype=torch.float64),
                "second_per_grid_ts": torch.tensor([video.second_per_grid_ts], dtype=torch.float64),
                "group_hashes": torch.tensor([list(bytes.fromhex(h)) for h in hashes], dtype=torch.uint8)}


def as_processed(entry: dict[str, Any] | None) -> ProcessedVideo:
    """A processor-cache entry back as the processed video (a resolved video always has one)."""
    assert entry is not None, "a video item without its processed data"
    t, h, w = (int(v) for v in entry["video_grid_thw"].tolist())
    return ProcessedVideo(entry["pixel_values"], (t, h, w), entry["timestamps"].tolist(),
                          float(entry["second_per_grid_ts"][0]))


def group_items(processor: Any, token_ids: list[int], videos: list[ResolvedItem]) -> list[MultiModalItem]:
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


def _num_tokens(entry: dict[str, torch.Tensor], processor: Any) -> int:
    """Placeholder tokens of one temporal group (the unit budgets and caches count in)."""
    _, h, w = (int(v) for v in entry["video_grid_thw"].tolist())
    return h * w // processor.merge_size**2


def video_data(resolved: ResolvedItem) -> dict[str, Any]:
    assert resolved.data is not None, "a video item without its processed data"
    return resolved.data
