"""The P0 processor interface: what the item pipeline and the prompt expansion ask of a family.

`ItemProcessor` is what every checkpoint family provides (LLaVA: multimodal/processing.py;
Qwen2.5-VL / Qwen3-VL: multimodal/qwen_processor.py; siblings, neither built on the other).
A family declares video input by `video` (its video processor, or None); `VideoItemProcessor`
adds what the video path reads, and `video_support` is the one place that narrows to it.

`position_key` is what the decoder's positions read of an item: it is part of the item's
`MultiModalItem.position_key` and so of the prefix cache's block keys (see ipc/items.py and
engine/block_hash.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from mmserve.ipc.items import PlaceholderRange
    from mmserve.multimodal.chat_templates import ChatTemplateOptions
    from mmserve.multimodal.video_processor import ProcessedVideo, QwenVideoProcessor


class ItemProcessor(Protocol):
    """A family's P0 processor: images in, tensors and placeholder counts out; prompts expanded."""

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer."""
        ...

    @property
    def image_token(self) -> str:
        """The prompt's token for one image."""
        ...

    @property
    def image_token_id(self) -> int:
        ...

    @property
    def video(self) -> QwenVideoProcessor | None:
        """The family's video processor; None: the family takes no video input."""
        ...

    def check_mm_kwargs(self, mm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """The request's `mm_processor_kwargs`, validated (ValueError) and normalised for hashing."""
        ...

    def image_tokens(self, width: int, height: int, mm_kwargs: dict[str, Any]) -> int | None:
        """Placeholder tokens an image of this size will get, from its header size alone (None:
        not known before processing)."""
        ...

    def process_image(self, image: Image.Image, mm_kwargs: dict[str, Any] | None = None
                      ) -> dict[str, torch.Tensor]:
        """One image -> its item tensors."""
        ...

    def num_placeholder_tokens(self, data: dict[str, torch.Tensor]) -> int:
        """Placeholder tokens of one processed item."""
        ...

    def position_key(self, data: dict[str, torch.Tensor],
                     group: tuple[int, float] | None = None) -> tuple[int | float, ...]:
        """What the decoder's positions read of an item (a video group also gets its `group`)."""
        ...

    def check_image_count(self, prompt: str, num_images: int) -> None:
        """ValueError unless the prompt has one image token per image."""
        ...

    def expand(self, prompt: str, counts: list[int]) -> tuple[list[int], list[PlaceholderRange]]:
        """Token ids with the i-th image token expanded to `counts[i]` placeholders, and the ranges."""
        ...

    def settings(self) -> dict[str, Any]:
        """What changes the processed output, for the item hash."""
        ...

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            options: ChatTemplateOptions | None = None) -> str:
        """A conversation rendered with the checkpoint's chat template, or `options.template`, ending
        as `options` say (`multimodal/chat_templates.py`)."""
        ...


class VideoItemProcessor(ItemProcessor, Protocol):
    """A family with video input: what the video path reads besides `ItemProcessor`."""

    @property
    def video(self) -> QwenVideoProcessor:
        ...

    @property
    def family(self) -> str:
        ...

    @property
    def merge_size(self) -> int:
        ...

    @property
    def video_token(self) -> str:
        ...

    @property
    def video_token_id(self) -> int:
        ...

    def check_video_count(self, prompt: str, num_videos: int) -> None:
        """ValueError unless the prompt has one video token per video."""
        ...

    def expand_videos(self, prompt: str, videos: list[ProcessedVideo]) -> str:
        """The prompt with each video's placeholder text written out."""
        ...


def video_support(processor: ItemProcessor) -> VideoItemProcessor | None:
    """The processor as a video processor when it declares video input (`video` not None)."""
    return cast("VideoItemProcessor", processor) if processor.video is not None else None
