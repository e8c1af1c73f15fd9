"""The video half of P0's input processing (`InputProcessor.process` calls it).

A `Prompt` may carry videos (a URL / path string, encoded bytes, or `(frames, fps)` with frames a
T x H x W x 3 uint8 array), their uuids, and loading options as `media_io_kwargs["video"]`. Videos are
resolved through the processor cache (multimodal/video_items.py); the prompt is expanded with
images and videos together, and every video becomes one item per temporal group.
"""

from __future__ import annotations


from mmserve.errors import ClientError
from mmserve.frontend.request.prompt import Prompt
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
            try:  # the server's video options: --media-io-kwargs, then --mm-processor-kwargs' video keys
                self.resolver = VideoResolver(hasher, self.video_processor, cache, mm.media_limits(),
                                              mm.video_limits(), mm.max_video_bytes,
                                              (mm.media_io_kwargs.get("video"), mm.video_processor_kwargs),
                                              config.needs_item_hash, budget, inflight)
                self.resolver.options(None, None)  # within the server's limits
            except ClientError as e:
                raise ValueError(f"--media-io-kwargs / --mm-processor-kwargs: {e}") from None

    def resolve(self, prompt: Prompt, bypass: bool = False) -> list[ResolvedItem]:
        """The prompt's videos, resolved (ValueError / MediaError for anything refused)."""
        videos, settings = prompt.videos, prompt.settings
        if not videos:
            return []
        if self.resolver is None or self.video_processor is None:
            raise ClientError("this model takes no video input")
        if len(videos) > self.max_videos:
            raise ClientError(f"the prompt has {len(videos)} videos, more than the limit of {self.max_videos} "
                             f"(--limit-mm-per-prompt)")
        self.video_processor.check_video_count(prompt.text, len(videos))
        opts = self.resolver.options(settings.mm_processor_kwargs, settings.media_io_kwargs)
        return self.resolver.resolve(videos, prompt.video_uuids, settings.cache_salt, opts, bypass)

    def check_sizes(self, videos: list[ResolvedItem], limit: int) -> None:
        """ValueError when a video's temporal group has more embedding tokens than the encoder's
        budget and cache hold (a whole video never has to fit: groups are encoded one by one)."""
        for index, video in enumerate(videos):
            if video.num_tokens > limit:
                raise ClientError(f"a temporal group of video {index} needs {video.num_tokens} embedding tokens, more "
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
