"""A request's prompt, typed: its text, the media it names, and the settings for processing them.

The OpenAI handlers build a `Prompt` once (`ChatInputs.prompt` for messages, `Prompt(text, ...)`
for a completion's text) and pass it through to `InputProcessor.process`; `LLM.generate` and
`AsyncLLM.generate` also take vLLM's dict form (`TextPrompt`'s keys: `prompt`, `multi_modal_data`,
`multi_modal_uuids`, `mm_processor_kwargs`, `media_io_kwargs`, `cache_salt`), which `Prompt.parse`
checks field by field. Either way a `Prompt` is checked where it is made (ValueError naming the field).
A prompt of token ids (vLLM's `TokensPrompt`: `{"prompt_token_ids": [...]}`; a completion's `prompt`
as a list of ints) is text-only: its `token_ids` go to the engine as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmserve.errors import ClientError

PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data", "multi_modal_uuids", "cache_salt",
               "mm_processor_kwargs", "media_io_kwargs")


@dataclass(frozen=True)
class PromptSettings:
    """What a request sets about its prompt besides text and media (vLLM's names, None: absent)."""

    cache_salt: str | None = None  # isolates the request's tenant in every cache
    mm_processor_kwargs: dict[str, Any] | None = None  # the processor's settings (min_pixels, fps, ...)
    media_io_kwargs: dict[str, Any] | None = None  # loading options: {"video": {...}}

    def __post_init__(self) -> None:
        if self.mm_processor_kwargs is not None and not isinstance(self.mm_processor_kwargs, dict):
            raise ClientError("mm_processor_kwargs must be an object of processor settings")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ClientError("cache_salt must be a non-empty string")
        if self.media_io_kwargs is not None and not isinstance(self.media_io_kwargs, dict):
            raise ClientError("media_io_kwargs must be an object")


@dataclass(frozen=True)
class Prompt:
    """The prompt `InputProcessor.process` takes: rendered text, media sources in prompt order; or
    `token_ids` (then no text and no media).

    Invariant: one uuid per source, and a source is None only where its uuid names an item sent before."""

    text: str
    images: list[Any] = field(default_factory=list)  # URL / path strings, bytes or PIL images
    image_uuids: list[str | None] = field(default_factory=list)  # [] or one per image
    videos: list[Any] = field(default_factory=list)  # URL / path strings, bytes or (frames, fps)
    video_uuids: list[str | None] = field(default_factory=list)  # [] or one per video
    settings: PromptSettings = field(default_factory=PromptSettings)
    token_ids: list[int] | None = None
    continuation: tuple[int, ...] = ()  # tokens after the prompt's own (a beam's so far: `beam_search.py`)

    def __post_init__(self) -> None:
        if self.continuation:
            check_token_ids(list(self.continuation))
        if self.token_ids is not None:
            check_token_ids(self.token_ids)
            if self.text or self.images or self.videos:
                raise ClientError("a prompt of token ids has no text, images or videos")
        if not self.image_uuids:
            object.__setattr__(self, "image_uuids", [None] * len(self.images))
        if not self.video_uuids:
            object.__setattr__(self, "video_uuids", [None] * len(self.videos))
        check_uuids(self.images, self.image_uuids, "image")
        check_uuids(self.videos, self.video_uuids, "video")

    @classmethod
    def parse(cls, prompt: str | dict[str, Any] | Prompt) -> Prompt:
        """A prompt in any form `generate` takes: a `Prompt` as it is, a string as its text, or
        vLLM's dict form, checked (ValueError for a malformed or unknown field)."""
        if isinstance(prompt, Prompt):
            return prompt
        if isinstance(prompt, str):
            return cls(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt and "prompt" not in prompt:
            unknown = set(prompt) - {"prompt_token_ids", "cache_salt"}
            if unknown:
                raise ClientError(f"a prompt of token ids takes only 'prompt_token_ids' and 'cache_salt'; got "
                                  f"{', '.join(sorted(unknown))}")
            return cls("", settings=PromptSettings(prompt.get("cache_salt")), token_ids=prompt["prompt_token_ids"])
        if not isinstance(prompt, dict) or not isinstance(prompt.get("prompt"), str):
            raise ClientError("a prompt is a string or a dict with a string 'prompt' (or 'prompt_token_ids') and "
                              "optional 'multi_modal_data'")
        unknown = set(prompt) - set(PROMPT_KEYS) | ({"prompt_token_ids"} & set(prompt))
        if unknown:
            raise ClientError(f"unknown prompt field(s): {', '.join(sorted(unknown))}")
        images = _image_list(prompt.get("multi_modal_data"), "multi_modal_data")
        uuids = _image_list(prompt.get("multi_modal_uuids"), "multi_modal_uuids")
        videos, video_uuids = _videos(prompt)
        settings = PromptSettings(prompt.get("cache_salt"), prompt.get("mm_processor_kwargs"),
                                  prompt.get("media_io_kwargs"))
        return cls(prompt["prompt"], images, uuids, videos, video_uuids, settings)

    @property
    def shown_text(self) -> str | None:
        """The prompt as outputs give it back (`RequestOutput.prompt`): its text, None for token ids."""
        return None if self.token_ids is not None else self.text

    def to_dict(self) -> dict[str, Any]:
        """vLLM's dict form of this prompt (what `LLM.generate` takes); `parse` reads it back equal."""
        if self.token_ids is not None:
            tokens: dict[str, Any] = {"prompt_token_ids": list(self.token_ids)}
            if self.settings.cache_salt is not None:
                tokens["cache_salt"] = self.settings.cache_salt
            return tokens
        out: dict[str, Any] = {"prompt": self.text, "multi_modal_data": {"image": self.images}}
        if any(u is not None for u in self.image_uuids):
            out["multi_modal_uuids"] = {"image": self.image_uuids}
        if self.videos:
            out["multi_modal_data"]["video"] = self.videos
            if any(u is not None for u in self.video_uuids):
                out.setdefault("multi_modal_uuids", {})["video"] = self.video_uuids
        for key in ("cache_salt", "mm_processor_kwargs", "media_io_kwargs"):
            if (value := getattr(self.settings, key)) is not None:
                out[key] = value
        return out


def check_token_ids(token_ids: Any) -> None:
    """ValueError unless `token_ids` is a non-empty list of non-negative integers (the model's
    vocabulary is checked where it is known: `InputProcessor.process`)."""
    if not isinstance(token_ids, list) or not token_ids or \
            not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63 for t in token_ids):
        raise ClientError("prompt token ids must be a non-empty list of non-negative integers")


def check_uuids(sources: list[Any], uuids: list[Any], kind: str) -> None:
    """ValueError unless there is one uuid (a non-empty string or None) per source, and a source
    is None only where its uuid is given."""
    if len(uuids) != len(sources):
        raise ClientError(f"multi_modal_uuids has {len(uuids)} {kind} uuid(s) for {len(sources)} {kind}(s)")
    if not all(u is None or (isinstance(u, str) and u) for u in uuids):
        raise ClientError(f"each {kind} uuid must be a non-empty string (or None)")
    if any(source is None and u is None for source, u in zip(sources, uuids)):
        raise ClientError(f"each {kind} may be None only when its uuid is given")


def _image_list(mm: Any, name: str) -> list[Any]:
    if mm is None:
        return []
    if not isinstance(mm, dict) or set(mm) - {"image", "video"}:
        raise ClientError(f"{name} takes only the keys 'image' and 'video' (one value or a list each)")
    value = mm.get("image", [])
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _videos(prompt: dict[str, Any]) -> tuple[list[Any], list[str | None]]:
    """The dict form's video sources and their uuids (a `(frames, fps)` tuple is one video)."""
    data = prompt.get("multi_modal_data") or {}
    value = data.get("video", []) if isinstance(data, dict) else []
    videos = list(value) if isinstance(value, list) else [value]
    ids = prompt.get("multi_modal_uuids") or {}
    uuids = ids.get("video") if isinstance(ids, dict) else None
    if uuids is None:
        return videos, [None] * len(videos)
    return videos, list(uuids) if isinstance(uuids, list) else [uuids]
