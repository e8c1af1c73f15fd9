"""The typed prompt (issue 48 item 2): built once, checked where it is made, the dict form read back equal."""

from __future__ import annotations

import pytest

from mmserve.frontend.request.chat import parse_chat_messages
from mmserve.frontend.request.prompt import Prompt, PromptSettings


def test_the_dict_form_reads_back_equal():
    prompt = Prompt("<image> a <video>", ["a.png"], ["img"], [("frames", 2.0)], [None],
                    PromptSettings("tenant", {"max_pixels": 4096}, {"video": {"fps": 1}}))
    assert Prompt.parse(prompt.to_dict()) == prompt
    assert Prompt.parse(prompt) is prompt
    assert Prompt.parse("plain") == Prompt("plain")


def test_a_chat_prompt_carries_the_requests_settings():
    inputs = parse_chat_messages([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}, "uuid": "a"},
        {"type": "text", "text": "hi"}]}])
    prompt = inputs.prompt("rendered", PromptSettings(cache_salt="tenant", mm_processor_kwargs={"max_pixels": 1}))
    assert (prompt.images, prompt.image_uuids) == (["data:image/png;base64,AAAA"], ["a"])
    assert prompt.settings.cache_salt == "tenant" and prompt.settings.mm_processor_kwargs == {"max_pixels": 1}


@pytest.mark.parametrize("make, message", [
    (lambda: PromptSettings(cache_salt=""), "cache_salt must be a non-empty string"),
    (lambda: PromptSettings(mm_processor_kwargs=[1]), "mm_processor_kwargs must be an object"),  # type: ignore[arg-type]
    (lambda: PromptSettings(media_io_kwargs="fps"), "media_io_kwargs must be an object"),  # type: ignore[arg-type]
    (lambda: Prompt("x", ["a.png", "b.png"], ["one"]), "1 image uuid"),
    (lambda: Prompt("x", [None]), "None only when its uuid is given"),
    (lambda: Prompt.parse({"prompt": "x", "images": []}), "unknown prompt field"),
    (lambda: Prompt.parse({"text": "x"}), "a string 'prompt'"),
])
def test_a_malformed_prompt_is_refused_where_it_is_made(make, message):
    with pytest.raises(ValueError, match=message):
        make()
