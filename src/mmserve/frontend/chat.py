"""OpenAI-style chat messages to a chat-template conversation plus the images it names."""

from __future__ import annotations

from typing import Any

from PIL import Image

from mmserve.multimodal.media import MediaError, MediaLimits, load_image

ROLES = ("system", "user", "assistant")
PART_TYPES = ("text", "image_url", "image_pil", "image")


def parse_chat_messages(
    messages: list[dict[str, Any]], limits: MediaLimits
) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """Turn OpenAI-style chat messages into a conversation for `apply_chat_template` and images.

    A message is `{"role": "system" | "user" | "assistant", "content": ...}` where content is a
    string (kept as a string) or a list of parts: `{"type": "text", "text": str}`,
    `{"type": "image_url", "image_url": {"url": str}}` (or `"image_url": str`),
    `{"type": "image_pil", "image_pil": PIL.Image}` or `{"type": "image", "image": PIL.Image | str}`.
    In the conversation every text part becomes `{"type": "text", "text": ...}` and every image
    part `{"type": "image"}`; the images come back loaded (RGB) in the order they appear.

    Malformed messages raise `ValueError` naming the offending field; refused or unreadable media
    raise `MediaError` (a `ValueError`) prefixed with where the item was.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    conversation: list[dict[str, Any]] = []
    images: list[Image.Image] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        role = _role(message, where)
        content = message.get("content")
        if isinstance(content, str):
            conversation.append({"role": role, "content": content})
        elif isinstance(content, list):
            parts = [_part(part, f"{where}.content[{i}]", limits, images) for i, part in enumerate(content)]
            conversation.append({"role": role, "content": parts})
        else:
            raise ValueError(f"{where}.content must be a string or a list of content parts; "
                             f"got {type(content).__name__}")
    return conversation, images


def _role(message: object, where: str) -> str:
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object with 'role' and 'content'; got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
    return role


def _part(part: object, where: str, limits: MediaLimits, images: list[Image.Image]) -> dict[str, Any]:
    """Normalise one content part; an image part's loaded image is appended to `images`."""
    if not isinstance(part, dict):
        raise ValueError(f"{where} must be an object with a 'type'; got {type(part).__name__}")
    kind = part.get("type")
    if kind not in PART_TYPES:
        raise ValueError(f"{where}.type must be one of {', '.join(PART_TYPES)}; got {kind!r}")
    if kind not in part:
        raise ValueError(f"{where} has type {kind!r} but no {kind!r} field")
    value = part[kind]
    if kind == "text":
        if not isinstance(value, str):
            raise ValueError(f"{where}.text must be a string; got {type(value).__name__}")
        return {"type": "text", "text": value}
    if kind == "image_url":
        value = _image_url(value, where)
    elif kind == "image_pil" and not isinstance(value, Image.Image):
        raise ValueError(f"{where}.image_pil must be a PIL image; got {type(value).__name__}")
    try:
        images.append(load_image(value, limits))
    except MediaError as exc:
        raise MediaError(f"{where}: {exc}") from exc
    return {"type": "image"}


def _image_url(value: object, where: str) -> str:
    if isinstance(value, dict):
        value = value.get("url")
        where = f"{where}.image_url.url"
    else:
        where = f"{where}.image_url"
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty URL string; got {value!r:.80}")
    return value
