"""Greedy reference outputs from Hugging Face transformers running the same weights."""

from __future__ import annotations

import torch
from PIL import Image


def hf_greedy(path: str, items: list[dict], max_new_tokens: int) -> tuple[list[list[int]], list[int]]:
    """transformers' `generate` on each prompt dict alone: output token ids and prompt lengths."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    refs, lens = [], []
    for item in items:
        images = item.get("multi_modal_data", {}).get("image")
        images = [images] if isinstance(images, Image.Image) else images
        inputs = processor(text=item["prompt"], images=images, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        refs.append(out[0, inputs["input_ids"].shape[1]:].tolist())
        lens.append(inputs["input_ids"].shape[1])
    return refs, lens
