"""vLLM's `truncate_prompt_tokens`: keep a prompt's last K tokens (the tokenizer's left truncation).

K is a request's `SamplingParams.truncate_prompt_tokens`: a positive count, or -1 for the most the
context takes. vLLM's -1 keeps `max_model_len` tokens; here it keeps `max_model_len - 1`, since
mmserve refuses a prompt that leaves no room for one output token. A K above `max_model_len` is
refused, as vLLM refuses it.

The count is of the prompt as the model reads it: images' and videos' tokens included (vLLM counts
the text's tokens with each image still one placeholder token). The cut may drop text only: a K that
would cut into an image or a video is refused, naming where the first one starts, and items
behind the cut keep their tokens, moved to their new offsets.
"""

from __future__ import annotations

from msgspec import structs

from mmserve.errors import ClientError
from mmserve.ipc.items import MultiModalItem, PlaceholderRange


def kept_tokens(k: int | None, max_model_len: int) -> int | None:
    """How many of a prompt's last tokens `truncate_prompt_tokens` `k` keeps (None: all of them)."""
    if k is None:
        return None
    if k > max_model_len:
        raise ClientError(f"truncate_prompt_tokens ({k}) is greater than max_model_len ({max_model_len}); "
                          "please select a smaller truncation size")
    return max_model_len - 1 if k == -1 else k


def truncate(token_ids: list[int], ranges: list[PlaceholderRange], groups: list[MultiModalItem],
             keep: int) -> tuple[list[int], list[PlaceholderRange], list[MultiModalItem]]:
    """The prompt's last `keep` tokens, with its image `ranges` and video `groups` moved to their
    offsets in it; a ClientError where the cut would reach an item's tokens."""
    cut = len(token_ids) - keep
    if cut <= 0:
        return token_ids, ranges, groups
    first = min([r.offset for r in ranges] + [g.placeholder.offset for g in groups], default=None)
    if first is not None and cut > first:
        raise ClientError(f"truncate_prompt_tokens ({keep}) would cut into an image or a video: the prompt has "
                          f"{len(token_ids)} tokens and its first item starts at token {first}, so at most "
                          f"{first} tokens of text may be dropped (keep {len(token_ids) - first} or more)")
    moved = [PlaceholderRange(r.offset - cut, r.length) for r in ranges]
    shifted = [structs.replace(g, placeholder=PlaceholderRange(g.placeholder.offset - cut, g.placeholder.length))
               for g in groups]
    return token_ids[cut:], moved, shifted
