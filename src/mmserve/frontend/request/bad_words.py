"""`SamplingParams.bad_words` as token sequences, the way vLLM reads them.

A word is banned where it would start the text and where it would follow a space: it is tokenized
as written (leading spaces dropped) and with one space before it, and the spaced form is kept too
when its tokens differ (a tokenizer whose words carry their space, GPT-2's and Qwen's byte-level
BPE, spells " cat" as one token other than "cat"). vLLM keeps the spaced form only when it has as
many tokens as the plain one, so a word that is one token after a space but several without (a
rarer word) is not banned mid-text there; here it is. The sampler masks a sequence's last token
wherever the output so far ends with the tokens before it (`worker/logits_processors.py`).
"""

from __future__ import annotations

from typing import Any


def bad_word_sequences(tokenizer: Any, words: list[str], vocab_size: int) -> list[list[int]]:
    """Each word's token sequences (`tokenizer.encode`, no special tokens); a ValueError when a
    word tokenizes to nothing or outside the model's vocabulary."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words: {word!r} has no tokens")
        sequences.append(plain)
        if spaced and spaced != plain:
            sequences.append(spaced)
    outside = [t for seq in sequences for t in seq if not 0 <= t < vocab_size]
    if outside:
        raise ValueError(f"bad_words tokenize to ids {outside[:3]} outside this model's vocabulary ({vocab_size})")
    return sequences
