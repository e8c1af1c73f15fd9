"""Tests for turning OpenAI-style chat messages into a template conversation and images."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from mmserve.frontend.request.chat import parse_chat_messages
from mmserve.frontend.request.prompt import PromptSettings
from mmserve.multimodal.media import MediaError, MediaLimits, load_image


def png_url(color: tuple[int, int, int], size: tuple[int, int] = (4, 4)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


LIMITS = MediaLimits()


def parse(messages, limits=LIMITS):
    """The conversation, and the images loaded as input processing would load them."""
    inputs = parse_chat_messages(messages)
    return inputs.conversation, [load_image(src, limits) for src in inputs.images]


def test_string_content_is_kept() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}]
    conversation, images = parse(messages)
    assert conversation == messages and images == []


def test_parts_are_normalised_and_images_kept_in_order() -> None:
    red, green, gray = Image.new("RGB", (2, 2), (255, 0, 0)), (0, 255, 0), Image.new("L", (3, 3), 9)
    messages = [{"role": "user", "name": "ann", "content": [
        {"type": "text", "text": "compare"},
        {"type": "image_pil", "image_pil": red},
        {"type": "image_url", "image_url": {"url": png_url(green), "detail": "low"}},
        {"type": "image_url", "image_url": png_url((0, 0, 255), (5, 5))},
        {"type": "image", "image": gray},
    ]}]
    conversation, images = parse(messages)
    assert conversation == [{"role": "user", "content": [
        {"type": "text", "text": "compare"}, {"type": "image"}, {"type": "image"}, {"type": "image"},
        {"type": "image"}]}]
    assert [image.size for image in images] == [(2, 2), (4, 4), (5, 5), (3, 3)]
    assert images[1].getpixel((0, 0)) == (0, 255, 0)
    assert all(image.mode == "RGB" for image in images)


def test_image_part_with_path(tmp_path: Path) -> None:
    Image.new("RGB", (6, 6)).save(tmp_path / "a.png")
    limits = MediaLimits(allowed_local_media_path=str(tmp_path))
    _, images = parse([{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "a.png")}]}], limits)
    assert images[0].size == (6, 6)


def test_multi_turn_images_across_messages() -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url((1, 2, 3))}}]},
                {"role": "assistant", "content": [{"type": "text", "text": "a dot"}]},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url((4, 5, 6))}},
                                             {"type": "text", "text": "and this?"}]}]
    conversation, images = parse(messages)
    assert [image.getpixel((0, 0)) for image in images] == [(1, 2, 3), (4, 5, 6)]
    assert conversation[1] == {"role": "assistant", "content": [{"type": "text", "text": "a dot"}]}


@pytest.mark.parametrize("messages, words", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    (["hi"], "messages[0] must be an object"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "critic", "content": "hi"}], "'critic'"),
    ([{"role": "tool", "content": "hi"}], "tool_call_id"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": ["hi"]}], "messages[0].content[0] must be an object"),
    ([{"role": "user", "content": [{"type": "audio_url", "audio_url": "x"}]}], "'audio_url'"),
    ([{"role": "user", "content": [{"text": "hi"}]}], "content[0].type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "no 'text' field"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "text must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url.url must be"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}], "image_url must be"),
    ([{"role": "user", "content": [{"type": "image_pil", "image_pil": "x.png"}]}], "must be a PIL image"),
])
def test_malformed_messages(messages: object, words: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_chat_messages(messages)  # type: ignore[arg-type]
    assert words in str(info.value)


def test_refused_media_is_a_media_error_when_loaded() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"},
                                             {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    with pytest.raises(MediaError, match="--allowed-media-domains"):
        parse(messages)
    with pytest.raises(ValueError, match="PIL image"):
        parse_chat_messages([{"role": "user", "content": [{"type": "image", "image": 3}]}])


def test_uuid_parts_may_leave_out_the_url() -> None:
    inputs = parse_chat_messages([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_url((1, 1, 1))}, "uuid": "a"},
        {"type": "image_url", "uuid": "b"},
        {"type": "image_url", "image_url": {}, "uuid": "c"},
        {"type": "image_url", "image_url": {"url": png_url((2, 2, 2))}}]}])
    assert inputs.uuids == ["a", "b", "c", None]
    assert inputs.images[1:3] == [None, None]
    prompt = inputs.prompt("text", PromptSettings(cache_salt="tenant")).to_dict()
    assert prompt["multi_modal_uuids"] == {"image": ["a", "b", "c", None]} and prompt["cache_salt"] == "tenant"
    with pytest.raises(ValueError, match="uuid"):
        parse_chat_messages([{"role": "user", "content": [{"type": "image_url", "uuid": ""}]}])


def test_video_parts_become_video_sources():
    inputs = parse_chat_messages([{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
        {"type": "video_url", "video_url": None, "uuid": "clip"}, {"type": "text", "text": "hi"}]}])
    assert inputs.conversation[0]["content"][:2] == [{"type": "video"}, {"type": "video"}]
    prompt = inputs.prompt("rendered").to_dict()
    assert prompt["multi_modal_data"]["video"] == ["data:video/mp4;base64,AAAA", None]
    assert prompt["multi_modal_uuids"] == {"video": [None, "clip"]}


def test_an_assistant_turns_reasoning_content_reaches_the_template() -> None:
    """Qwen3's templates show (or drop) an earlier answer's thinking from `reasoning_content`."""
    inputs = parse_chat_messages([{"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"},
                                  {"role": "user", "content": "Bye", "reasoning_content": "not an answer's"}])
    assert inputs.conversation[1] == {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"}
    assert "reasoning_content" not in inputs.conversation[2]
