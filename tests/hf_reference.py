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


def hf_qwen_greedy(path: str, items: list[dict], max_new_tokens: int) -> tuple[list[list[int]], list[int]]:
    """transformers' Qwen2.5-VL / Qwen3-VL `generate` on each prompt dict alone.

    The Qwen processor classes need torchvision, so the inputs are built the way they build
    them, from transformers' own pieces: `Qwen2VLImageProcessorPil` for pixels and grids, each
    `<|image_pad|>` repeated t*h*w/merge² times, the checkpoint's tokenizer, and
    `mm_token_type_ids` (1 on image pads; without it generate silently drops M-RoPE).
    A prompt's `mm_processor_kwargs` (min_pixels / max_pixels) go to the image processor.
    """
    import json
    import os

    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    with open(os.path.join(path, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    assert type(model).__name__ == arch
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    refs, lens = [], []
    for item in items:
        inputs = _qwen_inputs(item, tokenizer, image_processor, model.config.image_token_id)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        refs.append(out[0, inputs["input_ids"].shape[1]:].tolist())
        lens.append(inputs["input_ids"].shape[1])
    return refs, lens


def _qwen_inputs(item: dict, tokenizer, image_processor, image_token_id: int) -> dict:
    images = item.get("multi_modal_data", {}).get("image") or []
    images = [images] if isinstance(images, Image.Image) else list(images)
    text = item["prompt"]
    inputs: dict = {}
    if images:
        kwargs = dict(item.get("mm_processor_kwargs") or {})
        if kwargs:
            kwargs = {"size": {"shortest_edge": kwargs.get("min_pixels", image_processor.size["shortest_edge"]),
                               "longest_edge": kwargs.get("max_pixels", image_processor.size["longest_edge"])}}
        pixels = image_processor(images=[im.convert("RGB") for im in images], return_tensors="pt", **kwargs)
        merge = image_processor.merge_size ** 2
        pieces = text.split("<|image_pad|>")
        counts = [int(g.prod()) // merge for g in pixels["image_grid_thw"]]
        text = pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:]))
        inputs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids),
                  mm_token_type_ids=(ids == image_token_id).long())
    return inputs
