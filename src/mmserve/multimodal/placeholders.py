"""Image placeholders in a prompt: counted before any work, expanded in token space after.

Shared by every family's processor (multimodal/processing.py, multimodal/qwen_processor.py): each
writes one image token per image, and the pipeline expands it to the item's placeholder count.
"""

from __future__ import annotations

from typing import Any

from mmserve.errors import ClientError
from mmserve.ipc.items import PlaceholderRange


def check_image_count(prompt: str, image_token: str, num_images: int) -> None:
    """ValueError unless the prompt has exactly one `image_token` per image."""
    if not isinstance(prompt, str):
        raise ClientError(f"the prompt must be a string, not {type(prompt).__name__}")
    num_tokens = prompt.count(image_token)
    if num_tokens != num_images:
        raise ClientError(
            f"the prompt has {num_tokens} {image_token} token(s) but {num_images} "
            f"image(s) were given; each image needs exactly one {image_token} in the prompt"
        )


def expand(tokenizer: Any, image_token: str, image_token_id: int, prompt: str, counts: list[int],
           wrap: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> tuple[list[int], list[PlaceholderRange]]:
    """The token ids the HF processor gets by tokenizing `prompt` with its i-th image token
    expanded to `counts[i]` placeholders, and each item's placeholder range. `wrap`: token ids
    the processor writes before and after each image's placeholders (InternVL's `<img>`, `</img>`).

    Tokenized with one image token per image, then expanded in token space: a tokenizer splits
    its added tokens out of the text before anything else, so the text between them tokenizes
    the same either way (tested against the text expansion), and a large image costs no
    tokenizer time."""
    token_ids = list(tokenizer(prompt)["input_ids"])
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(positions) != len(counts):
        raise ClientError(f"expected {len(counts)} {image_token} tokens in the prompt, the tokenizer "
                         f"produced {len(positions)}")
    expanded: list[int] = []
    ranges: list[PlaceholderRange] = []
    done = 0
    for position, count in zip(positions, counts):
        expanded += token_ids[done:position] + list(wrap[0])
        ranges.append(PlaceholderRange(offset=len(expanded) if count else 0, length=count))
        expanded += [image_token_id] * count + list(wrap[1])
        done = position + 1
    return expanded + token_ids[done:], ranges


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` spells (added tokens included): a text of
    more than `n * max_token_chars` characters has more than `n` tokens."""
    longest = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
    added = getattr(tokenizer, "all_special_tokens", []) or []
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    longest = max([longest, *(len(t) for t in added), *(len(str(t)) for t in decoder.values())])
    return max(longest, 1)


PREFIX_CHARS_PER_TOKEN = 8  # a long text's prefix of this many characters per allowed token is tokenized first
_MARGIN = 16  # tokens that absorb the cut's effect on the last few tokens (and a BOS)


def tokens_past(tokenizer: Any, text: str, limit: int) -> tuple[int, int] | None:
    """(tokens, characters) of a prefix of `text` that alone has more than `limit` tokens, when
    one does: tokenizing stops there. None when `text` is short enough to tokenize whole, or
    its prefix does not prove it too long. The prefix ends at a whitespace where one is near, so
    the words before the cut tokenize as they do in the whole text."""
    cut = (limit + _MARGIN) * PREFIX_CHARS_PER_TOKEN
    if len(text) <= cut:
        return None
    space = max(text.rfind(" ", cut - 1024, cut), text.rfind("\n", cut - 1024, cut))
    end = space if space > 0 else cut
    count = len(tokenizer(text[:end])["input_ids"])
    return (count, end) if count > limit + _MARGIN else None
