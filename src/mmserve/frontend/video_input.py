"""The video half of P0's input processing (`InputProcessor.process` calls it).

A prompt dict may carry videos as `multi_modal_data["video"]` (one or a list: a URL / path string,
encoded bytes, or `(frames, fps)` with frames a T x H x W x 3 uint8 array), their ids as
`multi_modal_uuids["video"]`, and loading options as `media_io_kwargs["video"]`. Videos are
resolved through the processor cache (multimodal/video_items.py); the prompt is expanded with
images and videos together, and every video becomes one item per temporal group.
"""

from __future__ import annotations

from typing import Any

from mmserve.config import EngineConfig
from mmserve.multimodal.processor_cache import ProcessorCache
from mmserve.multimodal.hasher import ItemHasher
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.multimodal.budget import ItemBudget
from mmserve.multimodal.items import InFlight, ResolvedItem
from mmserve.multimodal.processor_api import ItemProcessor, video_support
from mmserve.multimodal.video_items import VideoResolver, group_items


class VideoInputs:
    """Checks, resolves and places a request's videos; without videos, `expand` is the
    processor's own image expansion. Video input is what the processor declares
    (`ItemProcessor.video`); the video pipeline shares the images' in-flight table."""

    def __init__(self, config: EngineConfig, processor: ItemProcessor, cache: ProcessorCache, hasher: ItemHasher,
                 budget: ItemBudget | None = None, inflight: InFlight | None = None) -> None:
        mm = config.multimodal
        self.processor = processor
        self.max_videos = mm.max_videos
        self.resolver: VideoResolver | None = None
        self.video_processor = video_support(processor)
        if self.video_processor is not None:
            self.resolver = VideoResolver(hasher, self.video_processor, cache, mm.media_limits(), mm.video_limits(),
                                          mm.max_video_bytes, mm.media_io_kwargs.get("video"),
                                          config.needs_item_hash, budget, inflight)

    def resolve(self, prompt: str | dict[str, Any], text: str, salt: str | None,
                mm_kwargs: dict[str, Any] | None, bypass: bool = False) -> list[ResolvedItem]:
        """The prompt's videos, resolved (ValueError / MediaError for anything refused)."""
        videos, uuids, media_io = _split_videos(prompt)
        if not videos:
            return []
        if self.resolver is None or self.video_processor is None:
            raise ValueError("this model takes no video input")
        if len(videos) > self.max_videos:
            raise ValueError(f"the prompt has {len(videos)} videos, more than the limit of {self.max_videos} "
                             f"(--limit-mm-per-prompt)")
        self.video_processor.check_video_count(text, len(videos))
        opts = self.resolver.options(mm_kwargs, media_io)
        return self.resolver.resolve(videos, uuids, salt, opts, bypass)

    def check_sizes(self, videos: list[ResolvedItem], limit: int) -> None:
        """ValueError when a video's temporal group has more embedding tokens than the encoder's
        budget and cache hold (a whole video never has to fit: groups are encoded one by one)."""
        for index, video in enumerate(videos):
            if video.num_tokens > limit:
                raise ValueError(f"a temporal group of video {index} needs {video.num_tokens} embedding tokens, more "
                                 f"than the encoder cache and budget hold ({limit}); lower the video's max_pixels "
                                 "(media_io_kwargs.video)")

    def expand(self, text: str, image_counts: list[int], videos: list[ResolvedItem]
               ) -> tuple[list[int], list[PlaceholderRange], list[MultiModalItem]]:
        """Token ids, each image's placeholder range, and the videos' group items."""
        if not videos or self.video_processor is None:
            return (*self.processor.expand(text, image_counts), [])
        from mmserve.multimodal.video_items import as_processed

        text = self.video_processor.expand_videos(text, [as_processed(v.data) for v in videos])
        token_ids, ranges = self.processor.expand(text, image_counts)
        return token_ids, ranges, group_items(self.video_processor, token_ids, videos)


def _split_videos(prompt: str | dict[str, Any]) -> tuple[list[Any], list[str | None], dict[str, Any] | None]:
    """(video sources, per-video uuids, media_io_kwargs); ValueError for a malformed field."""
    if not isinstance(prompt, dict):
        return [], [], None
    data = prompt.get("multi_modal_data") or {}
    value = data.get("video", []) if isinstance(data, dict) else []
    videos = list(value) if isinstance(value, list) else [value]
    ids = prompt.get("multi_modal_uuids") or {}
    uuids = ids.get("video") if isinstance(ids, dict) else None
    uuids = [None] * len(videos) if uuids is None else (list(uuids) if isinstance(uuids, list) else [uuids])
    check_uuids(videos, uuids, "video")
    media_io = prompt.get("media_io_kwargs")
    if media_io is not None and not isinstance(media_io, dict):
        raise ValueError("media_io_kwargs must be an object")
    return videos, uuids, media_io


def check_uuids(sources: list[Any], uuids: list[Any], kind: str) -> None:
    """ValueError unless there is one uuid (a non-empty string or None) per source, and a source
    is None only where its uuid is given."""
    if len(uuids) != len(sources):
        raise ValueError(f"multi_modal_uuids has {len(uuids)} {kind} uuid(s) for {len(sources)} {kind}(s)")
    if not all(u is None or (isinstance(u, str) and u) for u in uuids):
        raise ValueError(f"each {kind} uuid must be a non-empty string (or None)")
    if any(source is None and u is None for source, u in zip(sources, uuids)):
        raise ValueError(f"each {kind} may be None only when its uuid is given")
