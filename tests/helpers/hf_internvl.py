"""transformers' InternVL reference: its own processor and `generate` on the same weights."""

from __future__ import annotations

import torch
from PIL import Image

from helpers.hf_reference import _greedy, _on


def hf_internvl_processor(path: str):
    """transformers' `InternVLProcessor` for the checkpoint at `path`, with its PIL image processor.
    Its video processor needs torchvision, which this CPU torch lacks: it is left out (no test here
    sends InternVL a video), so the constructor's class check is skipped for it."""
    from transformers import AutoTokenizer, InternVLProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    class WithoutVideo(InternVLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    import json
    import os

    with open(os.path.join(path, "processor_config.json")) as f:
        seq = json.load(f)["image_seq_length"]
    return WithoutVideo(image_processor=GotOcr2ImageProcessorPil.from_pretrained(path),
                        tokenizer=AutoTokenizer.from_pretrained(path), image_seq_length=seq)


def hf_internvl_greedy(path: str, items: list[dict], max_new_tokens: int, dtype: torch.dtype = torch.float32,
                       device: str = "cpu") -> tuple[list[list[int]], list[int]]:
    """transformers' InternVL `generate` on each prompt dict alone (its `mm_processor_kwargs`, in
    transformers' names, go to the processor): output token ids and prompt lengths."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device).eval()
    assert type(model).__name__ == "InternVLForConditionalGeneration"
    processor = hf_internvl_processor(path)
    refs, lens = [], []
    for item in items:
        images = item.get("multi_modal_data", {}).get("image")
        images = [images] if isinstance(images, Image.Image) else images
        inputs = processor(text=item["prompt"], images=images, return_tensors="pt",
                           **(item.get("mm_processor_kwargs") or {}))
        tokens, prompt_len = _greedy(model, _on(inputs, device, dtype), max_new_tokens)
        refs.append(tokens)
        lens.append(prompt_len)
    return refs, lens
