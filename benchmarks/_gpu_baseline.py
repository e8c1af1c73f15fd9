"""The GPU benchmark's baseline (`gpu_serving.py`; the leading underscore keeps `mmserve bench
components` from running it): transformers' `generate` on the same checkpoint, device and dtype,
its inputs built as its Qwen2.5-VL processor builds them (from the PIL image processor: the
processor classes need torchvision)."""

from __future__ import annotations

import time
from typing import Any

import torch

from _gpu_limits import sync


def hf_inputs(path: str, prompt: str, images: list[Any], device: torch.device,
              dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """transformers' inputs for `prompt` (one `<|image_pad|>`) once per image, batched: the images
    share a size, so every row has the same length and needs no padding."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer, processor = AutoTokenizer.from_pretrained(path), Qwen2VLImageProcessorPil.from_pretrained(path)
    pixels = processor(images=images, return_tensors="pt")
    rows = []
    for grid in pixels["image_grid_thw"]:
        count = int(grid.prod()) // processor.merge_size**2
        rows.append(tokenizer(prompt.replace("<|image_pad|>", "<|image_pad|>" * count))["input_ids"])
    if len({len(r) for r in rows}) != 1:
        raise ValueError("the batch's images must share a size")
    ids = torch.tensor(rows)
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "mm_token_type_ids": (ids == image_token).long().to(device),
            "pixel_values": pixels["pixel_values"].to(device, dtype),
            "image_grid_thw": pixels["image_grid_thw"].to(device)}


def transformers_ttft(path: str, prompt: str, warm: Any, one: Any, batch: list[Any], device: torch.device,
                      dtype: torch.dtype) -> dict[str, float]:
    """Seconds to the first token of one new image, and of `batch` new images in one `generate`
    (inputs built outside the timing); the model is freed after."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device).eval()
    try:
        _first_token(model, path, prompt, [warm], device, dtype)
        return {"one_s": _first_token(model, path, prompt, [one], device, dtype),
                "batch_s": _first_token(model, path, prompt, batch, device, dtype)}
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _first_token(model: Any, path: str, prompt: str, images: list[Any], device: torch.device,
                 dtype: torch.dtype) -> float:
    """Seconds of one `generate` of one new token for `prompt` once per image (inputs made before)."""
    inputs = hf_inputs(path, prompt, images, device, dtype)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
    sync(device)
    return time.perf_counter() - start
