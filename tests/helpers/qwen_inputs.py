"""P0's input processing for a Qwen checkpoint without an engine: the prompts with one image or one
video, an `InputProcessor` under given engine arguments, and a PNG as a data URL."""

from __future__ import annotations

import base64
import io

from PIL import Image

from mmserve.config import EngineConfig
from mmserve.frontend.input_processor import InputProcessor

IMAGE_PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"
VIDEO_PROMPT = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"


def input_processor(path: str, max_model_len: int = 2048, **engine_args) -> InputProcessor:
    """The checkpoint's P0 input processing under `engine_args` (EngineConfig's fields)."""
    return InputProcessor(EngineConfig.from_kwargs(model=path, **engine_args), path, max_model_len, None)


def png_url(size: tuple[int, int] = (64, 64)) -> str:
    """A one-colour RGB PNG of `size` as a data URL."""
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
