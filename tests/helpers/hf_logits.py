"""transformers' next-token logits along a given output (teacher forcing), for log-prob and
penalty references: row t is the distribution the t-th output token was sampled from; and along
the prompt itself (prompt log probabilities)."""

from __future__ import annotations

import functools

import torch
from PIL import Image


@functools.lru_cache(maxsize=2)
def _load(path: str):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    return (LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval(),
            AutoProcessor.from_pretrained(path))


def hf_prompt_logits(path: str, item: dict) -> tuple[list[int], torch.Tensor]:
    """A tiny LLaVA's prompt ids for the prompt dict `item` (placeholders expanded) and its logits
    [n, V] float32 at each prompt position (row p: the distribution of token p + 1)."""
    return _forward(path, item, [])


def hf_output_logits(path: str, item: dict, output_ids: list[int]) -> torch.Tensor:
    """[len(output_ids), V] float32 logits of a tiny LLaVA over the prompt dict `item`
    followed by `output_ids`, one forward pass."""
    prompt, logits = _forward(path, item, output_ids)
    n = len(prompt)
    return logits[n - 1:n - 1 + len(output_ids)]


def _forward(path: str, item: dict, output_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """(the prompt's ids, the logits [n + T, V] over the prompt then `output_ids`)."""
    model, processor = _load(path)
    images = item.get("multi_modal_data", {}).get("image")
    images = [images] if isinstance(images, Image.Image) else images
    inputs = processor(text=item["prompt"], images=images, return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    ids = torch.cat([inputs["input_ids"], torch.tensor([output_ids], dtype=torch.int64)], dim=1)
    inputs["input_ids"], inputs["attention_mask"] = ids, torch.ones_like(ids)
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()  # [n + T, V]
    return ids[0, :n].tolist(), logits
