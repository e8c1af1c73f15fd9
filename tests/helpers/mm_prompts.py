"""Prompts with images as data URLs, shared by the multimodal cache tests."""

from __future__ import annotations

import asyncio
import base64
import io

from mmserve import SamplingParams
from helpers.tiny_models import make_image

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
TWO = "USER: <image> and <image>? ASSISTANT:"
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def url(seed: int) -> str:
    buf = io.BytesIO()
    make_image(seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def one(seed: int, **extra) -> dict:
    return {"prompt": PROMPT, "multi_modal_data": {"image": url(seed)}, **extra}


def generate(engine, prompt: dict, request_id: str) -> list[int]:
    """Run one request through an `AsyncLLM` to the end: its greedy output token ids."""
    async def run() -> list[int]:
        final = None
        async for out in engine.generate(request_id, prompt, PARAMS):
            final = out
        return final.outputs[0].token_ids
    return asyncio.run(run())
