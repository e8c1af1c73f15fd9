"""OpenAI-style chat messages to a chat-template conversation plus the images it names.

Images are not loaded here: their sources (a URL / path string or a PIL image) go on to input
processing, which hashes a source's bytes first and decodes only on a processor-cache miss.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from mmserve.errors import ClientError
from mmserve.frontend.request.prompt import Prompt, PromptSettings

ROLES = ("system", "developer", "user", "assistant", "tool")
PART_TYPES = ("text", "image_url", "image_pil", "image", "video_url", "video")


@dataclass
class ChatInputs:
    """A conversation for `apply_chat_template`, and its images in order of appearance."""

    conversation: list[dict[str, Any]]
    images: list[Any] = field(default_factory=list)  # URL / path strings or PIL images; None: by uuid
    uuids: list[str | None] = field(default_factory=list)  # the client's id per image, if given
    videos: list[Any] = field(default_factory=list)  # URL strings or (frames, fps); None: by uuid
    video_uuids: list[str | None] = field(default_factory=list)

    def prompt(self, text: str, settings: PromptSettings | None = None) -> Prompt:
        """The request's prompt, for the rendered `text`: this conversation's media and `settings`."""
        return Prompt(text, self.images, self.uuids, self.videos, self.video_uuids, settings or PromptSettings())


def parse_chat_messages(messages: list[dict[str, Any]]) -> ChatInputs:
    """Turn OpenAI-style chat messages into a template conversation and image sources.

    A message is `{"role": "system" | "developer" | "user" | "assistant" | "tool", "content": ...}`
    ("developer" is rendered as "system"; an assistant turn may carry `tool_calls`, with content
    None, and its `reasoning_content`; a "tool" turn names the call it answers in `tool_call_id`) where content is a
    string (kept as a string) or a list of parts: `{"type": "text", "text": str}`,
    `{"type": "image_url", "image_url": {"url": str}, "uuid"?: str}` (or `"image_url": str`; with a
    `uuid`, the url may be left out to reuse an image sent before), `{"type": "image_pil",
    "image_pil": PIL.Image}` or `{"type": "image", "image": PIL.Image | str}`; videos alike:
    `{"type": "video_url", "video_url": {"url": str}, "uuid"?: str}` or `{"type": "video", "video":
    a URL string or (frames, fps)}`. In the conversation every text part becomes `{"type": "text",
    "text": ...}`, every image part `{"type": "image"}` and every video part `{"type": "video"}`.

    Malformed messages raise `ValueError` naming the offending field.
    """
    if not isinstance(messages, list) or not messages:
        raise ClientError("messages must be a non-empty list")
    inputs = ChatInputs([])
    call_ids: set[str] = set()
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        role = _role(message, where)
        content = message.get("content")
        turn: dict[str, Any] = {"role": "system" if role == "developer" else role}
        if isinstance(content, str):
            turn["content"] = content
        elif isinstance(content, list):
            turn["content"] = [_part(part, f"{where}.content[{i}]", inputs) for i, part in enumerate(content)]
        elif not (content is None and role == "assistant" and message.get("tool_calls")):
            raise ClientError(f"{where}.content must be a string or a list of content parts; "
                             f"got {type(content).__name__}")
        if role == "assistant" and isinstance(message.get("reasoning_content"), str):
            turn["reasoning_content"] = message["reasoning_content"]  # a reasoning model's template may show it
        if role == "assistant" and message.get("tool_calls") is not None:
            turn["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls", call_ids)
        if role == "tool":
            turn["tool_call_id"] = _tool_call_id(message.get("tool_call_id"), f"{where}.tool_call_id", call_ids)
        inputs.conversation.append(turn)
    return inputs


def check_tools(tools: object) -> list[dict[str, Any]]:
    """OpenAI function `tools`, checked, as the chat template takes them.

    OpenAI `tools` (function tools), as the chat template takes them; ValueError naming the
    offending field otherwise."""
    if not isinstance(tools, list) or not tools:
        raise ClientError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ClientError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ClientError(f"tools[{i}].function.parameters must be a JSON schema object")
        if fn["name"] in names:
            raise ClientError(f"tools[{i}].function.name {fn['name']!r} is given twice")
        names.add(fn["name"])
    return tools


def _tool_calls(calls: object, where: str, call_ids: set[str]) -> list[dict[str, Any]]:
    """An assistant turn's tool calls as the chat template takes them.

    An assistant turn's calls for the template: arguments as an object (templates render it
    with `tojson`), the way transformers' templates expect them."""
    if not isinstance(calls, list):
        raise ClientError(f"{where} must be a list")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ClientError(f"{where}[{i}] must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
        arguments = fn.get("arguments", {})
        try:
            arguments = json.loads(arguments or "{}") if isinstance(arguments, str) else arguments
        except ValueError as exc:
            raise ClientError(f"{where}[{i}].function.arguments is not valid JSON: {exc}") from exc
        if isinstance(call.get("id"), str):
            call_ids.add(call["id"])
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _tool_call_id(value: object, where: str, call_ids: set[str]) -> str:
    if not isinstance(value, str) or value not in call_ids:
        raise ClientError(f"{where} must name a tool call of an earlier assistant message; got {value!r:.60}")
    return value


def _role(message: object, where: str) -> str:
    if not isinstance(message, dict):
        raise ClientError(f"{where} must be an object with 'role' and 'content'; got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ClientError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
    return role


def _part(part: object, where: str, inputs: ChatInputs) -> dict[str, Any]:
    """Normalise one content part; an image part's source (and uuid) is appended to `inputs`."""
    if not isinstance(part, dict):
        raise ClientError(f"{where} must be an object with a 'type'; got {type(part).__name__}")
    kind = part.get("type")
    if kind not in PART_TYPES:
        raise ClientError(f"{where}.type must be one of {', '.join(PART_TYPES)}; got {kind!r}")
    uid = part.get("uuid")
    if uid is not None and (not isinstance(uid, str) or not uid):
        raise ClientError(f"{where}.uuid must be a non-empty string")
    if kind not in part and not (kind in ("image_url", "video_url") and uid is not None):
        raise ClientError(f"{where} has type {kind!r} but no {kind!r} field")
    value = part.get(kind)
    if kind == "text":
        if not isinstance(value, str):
            raise ClientError(f"{where}.text must be a string; got {type(value).__name__}")
        return {"type": "text", "text": value}
    if kind in ("video_url", "video"):
        inputs.videos.append(_media_url(value, where, uid, kind) if kind == "video_url" else value)
        inputs.video_uuids.append(uid)
        return {"type": "video"}
    if kind == "image_url":
        value = _media_url(value, where, uid, kind)
    elif kind == "image_pil" and not isinstance(value, Image.Image):
        raise ClientError(f"{where}.image_pil must be a PIL image; got {type(value).__name__}")
    elif kind == "image" and not isinstance(value, (Image.Image, str)):
        raise ClientError(f"{where}.image must be a PIL image or a URL/path string; got {type(value).__name__}")
    inputs.images.append(value)
    inputs.uuids.append(uid)
    return {"type": "image"}


def _media_url(value: object, where: str, uid: str | None, kind: str) -> str | None:
    if uid is not None and (value is None or (isinstance(value, dict) and not value.get("url"))):
        return None  # an item sent before, named by its uuid
    if isinstance(value, dict):
        value = value.get("url")
        where = f"{where}.{kind}.url"
    else:
        where = f"{where}.{kind}"
    if not isinstance(value, str) or not value:
        raise ClientError(f"{where} must be a non-empty URL string; got {value!r:.80}")
    return value
