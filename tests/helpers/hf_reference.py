"""Greedy reference outputs from Hugging Face transformers running the same weights."""

from __future__ import annotations

from collections.abc import Callable

import torch
from PIL import Image

from helpers.hf_video import hf_video_inputs, hf_video_processor

__all__ = ["hf_greedy", "hf_qwen_greedy", "hf_video_inputs", "hf_video_processor"]


def hf_greedy(path: str, items: list[dict], max_new_tokens: int, dtype: torch.dtype = torch.float32,
              device: str = "cpu", prepare: Callable[[torch.nn.Module], None] | None = None,
              ) -> tuple[list[list[int]], list[int]]:
    """transformers' `generate` on each prompt dict alone: output token ids and prompt lengths
    (the model in `dtype` on `device`: the GPU kit runs it on CUDA; `prepare` is called on it
    once loaded, e.g. to quantize its activations as W8A8 does)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device).eval()
    if prepare is not None:
        prepare(model)
    processor = AutoProcessor.from_pretrained(path)
    refs, lens = [], []
    for item in items:
        images = item.get("multi_modal_data", {}).get("image")
        images = [images] if isinstance(images, Image.Image) else images
        inputs = processor(text=item["prompt"], images=images, return_tensors="pt")
        tokens, prompt_len = _greedy(model, _on(inputs, device, dtype), max_new_tokens)
        refs.append(tokens)
        lens.append(prompt_len)
    return refs, lens


def hf_qwen_greedy(path: str, items: list[dict], max_new_tokens: int, dtype: torch.dtype = torch.float32,
                   device: str = "cpu", prepare: Callable[[torch.nn.Module], None] | None = None,
                   ) -> tuple[list[list[int]], list[int]]:
    """transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL `generate` on each prompt dict alone.

    The Qwen processor classes need torchvision, so the inputs are built the way they build
    them, from transformers' own pieces: `Qwen2VLImageProcessorPil` for pixels and grids, each
    `<|image_pad|>` repeated t*h*w/merge² times, the checkpoint's tokenizer, and
    `mm_token_type_ids` (1 on image pads, 2 on video pads; without it generate silently drops
    M-RoPE). A prompt's `mm_processor_kwargs` (min_pixels / max_pixels) go to the image processor.
    Videos (`multi_modal_data["video"]`: encoded bytes, decoded here by PyAV as the server does, or
    `(frames, fps)`) go through transformers' video processor (`hf_video_processor`) and are
    written into the prompt as `_video_text` says.
    """
    import json
    import os

    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    with open(os.path.join(path, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device).eval()
    assert type(model).__name__ == arch
    if prepare is not None:
        prepare(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    family = {"Qwen3VLForConditionalGeneration": "qwen3_vl", "Qwen2VLForConditionalGeneration": "qwen2_vl"}.get(
        arch, "qwen2_5_vl")
    video_processor = None  # built at the first video
    refs, lens = [], []
    for item in items:
        inputs = _qwen_inputs(item, tokenizer, image_processor, model.config.image_token_id)
        text = inputs.pop("text")
        if item.get("multi_modal_data", {}).get("video") is not None:
            video_processor = video_processor or hf_video_processor(path, family)
            inputs = _with_videos(inputs, text, item, tokenizer, video_processor, family, model.config)
        tokens, prompt_len = _greedy(model, _on(inputs, device, dtype), max_new_tokens)
        refs.append(tokens)
        lens.append(prompt_len)
    return refs, lens


def _greedy(model, inputs, max_new_tokens: int) -> tuple[list[int], int]:
    """`generate`'s greedy new tokens for one prompt's inputs, and the prompt's length."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt_len = inputs["input_ids"].shape[1]
    return out[0, prompt_len:].tolist(), prompt_len


def _on(inputs, device: str, dtype: torch.dtype) -> dict:
    """Processor outputs on `device`, pixel values in `dtype`; as they are on the CPU in float32."""
    if device == "cpu" and dtype == torch.float32:
        return inputs
    return {k: (v.to(device, dtype) if k.startswith("pixel_values") else v.to(device))
            if isinstance(v, torch.Tensor) else v for k, v in dict(inputs).items()}


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
                  mm_token_type_ids=(ids == image_token_id).long(), text=text)
    return inputs


def _with_videos(inputs: dict, text: str, item: dict, tokenizer, video_processor, family: str, config) -> dict:
    """`inputs` (from `_qwen_inputs`) with the item's videos written into the prompt and added."""
    videos = item["multi_modal_data"]["video"]
    videos = videos if isinstance(videos, list) else [videos]
    options = {k: v for k, v in (item.get("mm_processor_kwargs") or {}).items() if k in ("fps", "num_frames")}
    if "num_frames" in options:
        options["fps"] = None
    outs = [hf_video_inputs(video_processor, *_frames_of(v), **options) for v in videos]
    wrapped = "<|vision_start|><|video_pad|><|vision_end|>"
    pieces = text.split(wrapped)
    assert len(pieces) == len(outs) + 1, "each video needs its wrapped <|video_pad|>"
    text = pieces[0] + "".join(_video_text(out, family, video_processor) + p for out, p in zip(outs, pieces[1:]))
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    types = (ids == config.image_token_id).long() + 2 * (ids == config.video_token_id).long()
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                  pixel_values_videos=torch.cat([o["pixel_values_videos"] for o in outs]),
                  video_grid_thw=torch.cat([o["video_grid_thw"] for o in outs]))
    if family == "qwen2_5_vl":  # Qwen2_5_VLProcessor._process_videos
        fps = [o["video_metadata"][0].sampled_fps for o in outs]
        inputs["second_per_grid_ts"] = torch.tensor([video_processor.temporal_patch_size / f for f in fps])
    return inputs


def _frames_of(video) -> tuple:
    """(frames, fps) of a test video: given so, or PyAV's decoding of its bytes."""
    if isinstance(video, tuple):
        return video
    from helpers.tiny_videos import decoded_frames

    return decoded_frames(video)


def _video_text(out: dict, family: str, video_processor) -> str:
    """A video's prompt text as the families' processors write it: Qwen2(.5)-VL the wrapped pads;
    Qwen3-VL per group `<t seconds>` + wrapped pads, timestamps by transformers'
    `Qwen3VLProcessor._calculate_timestamps`, with no outer wrapper (transformers 4.57's form)."""
    t, h, w = out["video_grid_thw"][0].tolist()
    per_group = "<|video_pad|>" * (h * w // video_processor.merge_size**2)
    if family != "qwen3_vl":
        return "<|vision_start|>" + per_group * t + "<|vision_end|>"
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    meta = out["video_metadata"][0]
    times = Qwen3VLProcessor._calculate_timestamps(None, meta.frames_indices, meta.fps,
                                                   video_processor.temporal_patch_size)
    return "".join(f"<{s:.1f} seconds><|vision_start|>{per_group}<|vision_end|>" for s in times)
