"""Placeholder expansion in token space equals tokenizing the expanded text (what the Hugging Face
processors do), for any text around the images: LLaVA's and Qwen-VL's tokenizers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.multimodal.processing import MultiModalProcessor
from mmserve.multimodal.qwen_processor import QwenVLProcessor
from helpers.tiny_models import make_checkpoint, make_qwen_checkpoint

TEXT = st.lists(st.sampled_from(list("ab Z\n\t.,!?é漢<>|_-") + [" the", "image", "<image", "pad|>", "  "]),
                max_size=12).map("".join)


@pytest.fixture(scope="module", params=["llava", "qwen3_vl"])
def processor(request, tmp_path_factory) -> MultiModalProcessor:
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "llava":
        return MultiModalProcessor(make_checkpoint(tmp))
    return QwenVLProcessor(make_qwen_checkpoint(tmp, family=request.param))


def text_expansion(p: MultiModalProcessor, prompt: str, counts: list[int]) -> list[int]:
    """The reference: the prompt with the i-th image token written `counts[i]` times, tokenized."""
    pieces = prompt.split(p.image_token)
    text = pieces[0] + "".join(p.image_token * n + piece for n, piece in zip(counts, pieces[1:]))
    return list(p.tokenizer(text)["input_ids"])


# an image has at least one placeholder token: with none, the text around it would be tokenized
# as one piece ("a" + "b" -> "ab"), which is not what a prompt with an image in it means
@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(TEXT, min_size=1, max_size=5), counts=st.lists(st.integers(1, 40), max_size=4))
def test_token_space_expansion_equals_the_text_expansion(processor, pieces, counts):
    counts = counts[:len(pieces) - 1]
    prompt = pieces[0] + "".join(processor.image_token + piece for piece in pieces[1:len(counts) + 1])
    if prompt.count(processor.image_token) != len(counts):
        return  # the random text spelled an image token itself
    ids, ranges = processor.expand(prompt, counts)
    assert ids == text_expansion(processor, prompt, counts)
    for rng, n in zip(ranges, counts):
        assert rng.length == n and ids[rng.offset:rng.offset + n] == [processor.image_token_id] * n
