"""What one item may cost, known before it is processed: the size-first checks' limits.

An item (an image, or one temporal group of a video) is encoded in one piece, so its placeholder
tokens must fit the encoder's compute budget and cache (`item_tokens`); all of an item's tokens
must fit the prompt (`prompt_tokens`: max_model_len less one output token). The pipeline
(multimodal/items.py) checks both from a header size or a video's metadata, before decoding; the
input processor checks the same limits again on the processed items (a cached item is not sized).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ItemBudget:
    """`item_tokens`: most placeholder tokens of one encoder item; `prompt_tokens`: most
    placeholder tokens one request's item may add to its prompt (None: unbounded)."""

    item_tokens: int | None = None
    prompt_tokens: int | None = None

    def check_image(self, index: int, tokens: int) -> None:
        """ValueError when image `index` would get more tokens than one item or the prompt holds."""
        if self.item_tokens is not None and tokens > self.item_tokens:
            raise ValueError(f"image {index} needs {tokens} embedding tokens, more than the encoder cache and "
                             f"budget hold ({self.item_tokens}); send a smaller image or lower max_pixels")
        self._check_prompt(f"image {index}", tokens)

    def check_video(self, index: int, group_tokens: int, num_groups: int) -> None:
        """ValueError when a temporal group of video `index`, or the whole video, would get more
        tokens than one item or the prompt holds."""
        if self.item_tokens is not None and group_tokens > self.item_tokens:
            raise ValueError(f"a temporal group of video {index} needs {group_tokens} embedding tokens, more than "
                             f"the encoder cache and budget hold ({self.item_tokens}); lower the video's max_pixels "
                             "(media_io_kwargs.video)")
        self._check_prompt(f"video {index}", group_tokens * num_groups)

    def _check_prompt(self, what: str, tokens: int) -> None:
        if self.prompt_tokens is not None and tokens > self.prompt_tokens:
            raise ValueError(f"{what} needs {tokens} placeholder tokens, more than the prompt can hold: "
                             f"max_model_len is {self.prompt_tokens + 1}, which must also leave room for one "
                             "output token")
