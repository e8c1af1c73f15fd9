"""P0's input processing: prompt (+ images) -> an `EngineCoreRequest`.

Everything a user can get wrong is checked here, before the engine core sees the request:
the prompt's shape, the number and kind of images, the prompt's length.
"""

from __future__ import annotations

import time
from typing import Any

from mmserve.config import EngineConfig
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.multimodal.media import load_image
from mmserve.multimodal.processing import MultiModalProcessor
from mmserve.sampling_params import SamplingParams

_PROMPT_KEYS = {"prompt", "multi_modal_data"}


class InputProcessor:
    def __init__(self, config: EngineConfig, model_dir: str, max_model_len: int, eos_token_id: int | None) -> None:
        self.config = config
        self.processor = MultiModalProcessor(model_dir)
        self.tokenizer = self.processor.tokenizer
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.media_limits = config.multimodal.media_limits()

    def process(self, request_id: str, prompt: str | dict[str, Any], params: SamplingParams) -> EngineCoreRequest:
        text, images = self._split_prompt(prompt)
        limit = self.config.multimodal.max_images
        if len(images) > limit:
            raise ValueError(f"the prompt has {len(images)} images, more than the limit of {limit} "
                             f"(--limit-mm-per-prompt)")
        processed = self.processor.process(text, [load_image(img, self.media_limits) for img in images])
        n = len(processed.prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens (images included), but max_model_len is "
                             f"{self.max_model_len}, which must also leave room for at least one output token")
        return EngineCoreRequest(request_id, processed.prompt_token_ids, processed.mm_items, params,
                                 self.eos_token_id, time.time())

    @staticmethod
    def _split_prompt(prompt: str | dict[str, Any]) -> tuple[str, list[Any]]:
        if isinstance(prompt, str):
            return prompt, []
        if not isinstance(prompt, dict) or not isinstance(prompt.get("prompt"), str):
            raise ValueError("a prompt is a string or a dict with a string 'prompt' and optional 'multi_modal_data'")
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(f"unknown prompt field(s): {', '.join(sorted(unknown))}")
        mm = prompt.get("multi_modal_data") or {}
        if not isinstance(mm, dict) or set(mm) - {"image"}:
            raise ValueError("multi_modal_data takes only the key 'image' (an image or a list of images)")
        images = mm.get("image", [])
        return prompt["prompt"], list(images) if isinstance(images, (list, tuple)) else [images]
