"""The GPU benchmark's requests (`gpu_serving.py`, `_gpu_quant.py`; the leading underscore keeps
`mmserve bench components` from running it): the image prompt, new random 1024x768 images, and
the seconds an offline `LLM` takes to give prompts their first token."""

from __future__ import annotations

import time
from typing import Any

import torch

from _gpu_limits import sync

PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this picture.<|im_end|>\n" \
         "<|im_start|>assistant\n"
IMAGE_SIZE = (1024, 768)


def images(n: int, seed: int = 0) -> list[Any]:
    """`n` random RGB images of IMAGE_SIZE (new to every cache: no two alike)."""
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    return [Image.fromarray(torch.randint(0, 256, (IMAGE_SIZE[1], IMAGE_SIZE[0], 3), generator=gen,
                                          dtype=torch.uint8).numpy()) for _ in range(n)]


def with_image(image: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "multi_modal_data": {"image": image}}


def first_token_s(llm: Any, prompts: list[Any], device: torch.device) -> tuple[float, list[int]]:
    """Seconds until every prompt has its first token (one `generate` call), and the prompts' lengths."""
    from mmserve import SamplingParams

    sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    sync(device)
    return time.perf_counter() - start, [len(o.prompt_token_ids) for o in outs]


def host_s(llm: Any, image: Any) -> float:
    """Seconds of P0's work on one new image's prompt (hash, image processor, placeholders, the
    request's checks): the host's part of its first token; nothing of it is kept."""
    from mmserve import SamplingParams

    inputs, pending = llm.engine.input_processor, []
    start = time.perf_counter()
    inputs.process("host-probe", with_image(image), SamplingParams(max_tokens=1), pending)
    seconds = time.perf_counter() - start
    inputs.reject(pending)
    return seconds
