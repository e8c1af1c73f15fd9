"""Greedy reference outputs from Hugging Face transformers running the same weights."""

from __future__ import annotations

import torch
from PIL import Image


def hf_greedy(path: str, items: list[dict], max_new_tokens: int, dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> tuple[list[list[int]], list[int]]:
    """transformers' `generate` on each prompt dict alone: output token ids and prompt lengths
    (the model in `dtype` on `device`: the GPU kit runs it on CUDA)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device).eval()
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
                   device: str = "cpu") -> tuple[list[list[int]], list[int]]:
    """transformers' Qwen2.5-VL / Qwen3-VL `generate` on each prompt dict alone.

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
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    family = "qwen3_vl" if arch.startswith("Qwen3") else "qwen2_5_vl"
    video_processor = hf_video_processor(path, family)
    refs, lens = [], []
    for item in items:
        inputs = _qwen_inputs(item, tokenizer, image_processor, model.config.image_token_id)
        text = inputs.pop("text")
        if item.get("multi_modal_data", {}).get("video") is not None:
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
    """A video's prompt text as the families' processors write it: Qwen2.5-VL the wrapped pads;
    Qwen3-VL per group `<t seconds>` + wrapped pads, timestamps by transformers'
    `Qwen3VLProcessor._calculate_timestamps`, with no outer wrapper (transformers 4.57's form)."""
    t, h, w = out["video_grid_thw"][0].tolist()
    per_group = "<|video_pad|>" * (h * w // video_processor.merge_size**2)
    if family == "qwen2_5_vl":
        return "<|vision_start|>" + per_group * t + "<|vision_end|>"
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    meta = out["video_metadata"][0]
    times = Qwen3VLProcessor._calculate_timestamps(None, meta.frames_indices, meta.fps,
                                                   video_processor.temporal_patch_size)
    return "".join(f"<{s:.1f} seconds><|vision_start|>{per_group}<|vision_end|>" for s in times)


# ---- video: transformers' video processors, with torchvision's two kernels they call ------------


class _InterpolationMode(str):
    """Stands in for torchvision's InterpolationMode (an Enum of str values)."""

    @property
    def value(self) -> str:
        return str(self)


def _tv_resize(image, size, interpolation=None, antialias=True, **_):
    """torchvision.transforms.v2.functional.resize_image for a CPU tensor, bicubic or bilinear, as
    its source has it: uint8 stays uint8 (native kernel), an unchanged size returns the input."""
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    shape = image.shape
    flat = image.reshape(-1, *shape[-3:])
    out = torch.nn.functional.interpolate(flat, size=list(size), mode=interpolation.value, align_corners=False,
                                          antialias=antialias)
    return out.reshape(*shape[:-2], *size)


def _tv_normalize(tensor, mean, std, inplace=False):
    """torchvision's normalize: (x - mean) / std per channel."""
    tensor = tensor if inplace else tensor.clone()
    mean = torch.as_tensor(mean, dtype=tensor.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=tensor.dtype).view(-1, 1, 1)
    return tensor.sub_(mean).div_(std)


def hf_video_processor(path: str, family: str):
    """transformers' own `Qwen3VLVideoProcessor` / `Qwen2VLVideoProcessor` for a checkpoint.

    torchvision cannot be installed beside this torch; its `resize` and `normalize` (the only
    torchvision calls on this path) are given as its source defines them, everything else —
    sampling, sizing, the fused rescale, padding, patchify, the grid — is transformers' code."""
    import importlib.util
    import sys
    import types

    import transformers.image_processing_backends as backends
    import transformers.video_processing_utils as video_utils
    from transformers.image_utils import PILImageResampling

    shim = types.SimpleNamespace(resize=_tv_resize, normalize=_tv_normalize, grayscale_to_rgb=lambda v: v,
                                 InterpolationMode=types.SimpleNamespace(BICUBIC=_InterpolationMode("bicubic"),
                                                                         LANCZOS=_InterpolationMode("lanczos")))
    for module in (backends, video_utils):
        module.tvF = shim
    backends.pil_torch_interpolation_mapping = {PILImageResampling.BICUBIC: shim.InterpolationMode.BICUBIC}
    folder = "qwen3_vl" if family == "qwen3_vl" else "qwen2_vl"
    # the module may import torchvision at its top: load its source with the shim instead
    spec = importlib.util.find_spec(f"transformers.models.{folder}.video_processing_{folder}")
    source = spec.loader.get_source(spec.name).replace("import torchvision.transforms.v2.functional as tvF",
                                                       "tvF = None")
    module = types.ModuleType(spec.name)
    module.__package__, module.__file__ = f"transformers.models.{folder}", spec.origin
    saved = sys.modules.get(spec.name)
    sys.modules[spec.name] = module  # inspect (transformers' docstring decorator) looks the class up there
    try:
        exec(compile(source, spec.origin, "exec"), module.__dict__)
    finally:
        if saved is None:
            del sys.modules[spec.name]
        else:
            sys.modules[spec.name] = saved
    module.tvF = shim
    cls = module.Qwen3VLVideoProcessor if family == "qwen3_vl" else module.Qwen2VLVideoProcessor
    return cls.from_pretrained(path, cap_pixels_per_frame=False)


def hf_video_inputs(processor, frames, source_fps: float, **kwargs) -> dict:
    """transformers' processing of one video given as decoded frames [T, H, W, 3] uint8 and its
    fps: `pixel_values_videos`, `video_grid_thw`, and the sampling metadata."""
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=len(frames), fps=source_fps, width=frames.shape[2],
                         height=frames.shape[1])
    kwargs.setdefault("do_sample_frames", True)
    return processor(videos=[frames], video_metadata=[meta], return_tensors="pt", return_metadata=True, **kwargs)
