"""transformers' next-token logits along a given output (teacher forcing), for log-prob and
penalty references: row t is the distribution the t-th output token was sampled from."""

from __future__ import annotations

import functools

import torch
from PIL import Image


@functools.lru_cache(maxsize=2)
def _load(path: str):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    return (LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval(),
            AutoProcessor.from_pretrained(path))


def hf_output_logits(path: str, item: dict, output_ids: list[int]) -> torch.Tensor:
    """[len(output_ids), V] float32 logits of a tiny LLaVA over the prompt dict `item`
    followed by `output_ids`, one forward pass."""
    model, processor = _load(path)
    images = item.get("multi_modal_data", {}).get("image")
    images = [images] if isinstance(images, Image.Image) else images
    inputs = processor(text=item["prompt"], images=images, return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    ids = torch.cat([inputs["input_ids"], torch.tensor([output_ids])], dim=1)
    inputs["input_ids"], inputs["attention_mask"] = ids, torch.ones_like(ids)
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()  # [n + T, V]
    return logits[n - 1:n - 1 + len(output_ids)]
