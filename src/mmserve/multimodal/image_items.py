"""P0: an image of a request -> its hash and processed tensors, through the item pipeline every
modality shares (multimodal/items.py): `ImageModality` says how an image is read (its encoded
bytes, or a PIL image as given), hashed, sized from its header and processed; `ItemResolver` is
the pipeline over it. Videos are multimodal/video_items.py's.
"""

from __future__ import annotations

from typing import Any, Callable

from PIL import Image

from mmserve.errors import ClientError
from mmserve.multimodal import png
from mmserve.multimodal.budget import ItemBudget
from mmserve.multimodal.hasher import ItemHasher
from mmserve.multimodal.items import ItemPipeline
from mmserve.multimodal.media import (FLAG_MAX_PIXELS, MediaLimits, check_pixels, decode_image, header_size,
                                     read_image_source)
from mmserve.multimodal.processor_api import ItemProcessor
from mmserve.multimodal.processor_cache import ProcessorCache


class ImageModality:
    """Images: the encoded bytes (or a PIL image) are hashed; the header's size, under the
    request's pixel budget, gives the token count before decoding."""

    kind = "image"

    def __init__(self, processor: ItemProcessor, limits: MediaLimits, budget: ItemBudget) -> None:
        self.processor = processor
        self.limits = limits
        self.budget = budget
        png.library()  # our PNG decoding built now (once per machine), not in the first PNG's request

    def settings(self, requested: Any) -> dict[str, Any]:
        """The processor's check of `mm_processor_kwargs`, then the server's pixel limit."""
        settings = self.processor.check_mm_kwargs(requested)
        for key in ("min_pixels", "max_pixels"):
            if settings.get(key, 0) > self.limits.max_pixels:
                raise ClientError(f"mm_processor_kwargs.{key} ({settings[key]}) exceeds the server's limit of "
                                 f"{self.limits.max_pixels} pixels ({FLAG_MAX_PIXELS})")
        return settings

    def hashed_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        return settings

    def read(self, source: Any) -> bytes | Image.Image:
        return read_image_source(source, self.limits)

    def hash_key(self, raw: bytes | Image.Image) -> bytes | Image.Image:
        return raw

    def plan(self, index: int, raw: bytes | Image.Image, settings: dict[str, Any]) -> None:
        """ValueError when the image, as its header sizes it, has more pixels than the server
        takes or (under the request's settings) would get more placeholder tokens than the budget
        holds (an unreadable header is left to the decoder's error)."""
        size = raw.size if isinstance(raw, Image.Image) else header_size(raw)
        if size is not None:
            check_pixels(size[0], size[1], self.limits)
        tokens = None if size is None else self.processor.image_tokens(size[0], size[1], settings)
        if tokens is not None:
            self.budget.check_image(index, tokens)

    def process(self, raw: bytes | Image.Image, settings: dict[str, Any], plan: None = None,
                salt: str | None = None) -> dict[str, Any]:
        image = raw if isinstance(raw, Image.Image) else decode_image(bytes(raw), self.limits)
        return self.processor.process_image(image, settings)

    def num_tokens(self, data: dict[str, Any]) -> int:
        return self.processor.num_placeholder_tokens(data)


class ItemResolver(ItemPipeline):
    """The image pipeline: `ItemPipeline` over `ImageModality` (its `hasher` the one every
    modality's items are hashed with)."""

    def __init__(self, model_id: str, processor: ItemProcessor, cache: ProcessorCache, limits: MediaLimits,
                 hashing: bool, known_tokens: Callable[[str], int | None] = lambda h: None,
                 fetch: Callable[[str], dict[str, Any] | None] = lambda h: None,
                 budget: ItemBudget | None = None) -> None:
        super().__init__(ImageModality(processor, limits, budget or ItemBudget()),
                         ItemHasher(model_id, processor.settings()),
                         cache, hashing, known_tokens, fetch)
        self.processor = processor
        self.limits = limits

