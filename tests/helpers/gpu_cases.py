"""The GPU kit's models and prompts: both built-in families, the test checkpoints, and a few
prompts with images (one repeated, so every cache layer has something to hit)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from mmserve import LLM
from mmserve.models.builtin import resolve_model
from helpers.tiny_models import make_checkpoint, make_image, make_internvl_checkpoint, make_qwen_checkpoint

LLAVA_TEXT = "USER: {image}\n{question} ASSISTANT:"
QWEN_TEXT = "<|im_start|>user\n{image}{question}<|im_end|>\n<|im_start|>assistant\n"
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)
CHECKPOINTS = ("builtin:tiny-llava", "builtin:tiny-qwen3-vl", "llava-gqa", "llava-mha", "qwen2_vl", "qwen2_5_vl",
               "qwen3_vl", "internvl3", "internvl3.5")
IMAGE_TOKENS = {"llava": "<image>", "internvl": "<IMG_CONTEXT>", "qwen": "<|vision_start|><|image_pad|><|vision_end|>"}


def checkpoint(name: str, tmp_dir: Path) -> str:
    """A checkpoint directory by kit name (built-ins come from mmserve's cache)."""
    if name.startswith("builtin:"):
        return resolve_model(name)
    if name == "llava-gqa":
        return make_checkpoint(tmp_dir, text_config=dict(num_attention_heads=4, num_key_value_heads=2))
    if name == "llava-mha":
        return make_checkpoint(tmp_dir, text_config=dict(num_attention_heads=4, num_key_value_heads=4),
                               vision_config=dict(image_size=56, patch_size=14))
    if name == "internvl3":
        return make_internvl_checkpoint(tmp_dir)
    if name == "internvl3.5":
        return make_internvl_checkpoint(tmp_dir, text_model_type="qwen3", tie_word_embeddings=False)
    return make_qwen_checkpoint(tmp_dir, family=name)


def family(name: str) -> str:
    """"llava", "internvl" or "qwen": the kit name's prompt format and transformers reference."""
    return "internvl" if name.startswith("internvl") else "qwen" if "qwen" in name else "llava"


def prompts(name: str) -> list[dict[str, Any]]:
    """Text only, a long text, two images (the first twice): the same for every checkpoint."""
    template = LLAVA_TEXT if family(name) == "llava" else QWEN_TEXT
    image = IMAGE_TOKENS[family(name)]
    a, b = make_image(0, (64, 48)), make_image(1, (40, 40))
    return [
        {"prompt": template.format(image="", question="hello there")},
        {"prompt": template.format(image="", question=LONG)},
        {"prompt": template.format(image=image, question="What is this?"), "multi_modal_data": {"image": a}},
        {"prompt": template.format(image=image, question="Describe it."), "multi_modal_data": {"image": b}},
        {"prompt": template.format(image=image, question="What is this?"), "multi_modal_data": {"image": a}},
    ]


def hf_tokens(name: str, path: str, items: list[dict[str, Any]], max_new: int, dtype: torch.dtype,
              device: str = "cuda", **extra: Any) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, on `device` in `dtype` (`extra`: e.g. `prepare`)."""
    from helpers.hf_internvl import hf_internvl_greedy
    from helpers.hf_reference import hf_greedy, hf_qwen_greedy

    reference = {"llava": hf_greedy, "internvl": hf_internvl_greedy, "qwen": hf_qwen_greedy}[family(name)]
    return reference(path, items, max_new, dtype=dtype, device=device, **extra)[0]


def release_llms() -> int:
    """Shut down every `LLM` still alive in this process (a failed test's traceback keeps its
    locals alive) and empty torch's CUDA cache: the next test gets the whole GPU. Returns how many."""
    # type(), not isinstance(): isinstance reads each object's __class__, and a deprecated torch
    # object warns on that read
    live = [obj for obj in gc.get_objects() if issubclass(type(obj), LLM)]
    for llm in live:
        llm.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return len(live)
