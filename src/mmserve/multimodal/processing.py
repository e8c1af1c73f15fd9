"""Input processing (P0): prompt text + images -> prompt token ids and multimodal items.

Each image goes through the Hugging Face image processor on its own, so that every item's
tensors can be cached and moved by themselves: its geometry only (resize, crop), the pixels kept
as uint8 codes beside the table of its arithmetic (multimodal/pixel_table.py); the prompt's
`<image>` tokens are expanded to each item's placeholder count and tokenized exactly as
`LlavaProcessor` does, so the token ids equal `processor(text=prompt, images=images)["input_ids"][0]`.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from mmserve.errors import ClientError
from mmserve.multimodal.chat_templates import ChatTemplateOptions, pick_chat_template, render_chat
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.multimodal import placeholders
from mmserve.multimodal.media import check_image, to_rgb
from mmserve.multimodal.pixel_table import Geometry, processor_lut

if TYPE_CHECKING:
    from mmserve.multimodal.processor_api import ItemProcessor
    from mmserve.multimodal.video_processor import QwenVideoProcessor


@dataclass
class ProcessedPrompt:
    """A prompt ready for the engine: token ids with expanded placeholders, and its items."""

    prompt_token_ids: list[int]
    mm_items: list[MultiModalItem] = field(default_factory=list)


class MultiModalProcessor:
    """Wraps a checkpoint's Hugging Face processor (LLaVA-style: one `<image>` token per image);
    an `ItemProcessor` (multimodal/processor_api.py) with no video input.

    Stateless after construction: `process` keeps nothing between calls, so a call that raises
    leaves nothing behind.
    """

    def __init__(self, model_path: str) -> None:
        from transformers import AutoProcessor

        # transformers 5 picks the PIL image-processor backend itself when torchvision is absent.
        self._hf = AutoProcessor.from_pretrained(model_path)
        _fill_missing_llava_fields(self._hf, model_path)
        self.tokenizer = self._hf.tokenizer
        self.image_token: str = self._hf.image_token
        self.image_token_id: int = self._hf.image_token_id
        self.video: QwenVideoProcessor | None = None  # LLaVA takes no video
        self.lut = processor_lut(self._hf.image_processor, 1, lambda images: images.flatten(2))  # [C, 256]
        self.geometry = Geometry(self._hf.image_processor)

    def check_mm_kwargs(self, mm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """The request's `mm_processor_kwargs`, validated: LLaVA's fixed-size processor takes none."""
        if mm_kwargs:
            raise ClientError(f"this model takes no mm_processor_kwargs; got {', '.join(sorted(mm_kwargs))}")
        return {}

    def process_image(self, image: Image.Image, mm_kwargs: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """Runs the image processor's geometry on one image: `{"pixel_codes": Tensor[3, H, W] uint8,
        "pixel_lut": Tensor[3, 256]}`, its `pixel_values` as codes and their values (ipc/pixel_codes.py)."""
        check_image(image)
        codes = self.geometry(to_rgb(image))["pixel_values"][0]
        return {"pixel_codes": codes, "pixel_lut": self.lut}

    def num_placeholder_tokens(self, data: dict[str, torch.Tensor]) -> int:
        """Placeholder tokens of one processed item, with `LlavaProcessor`'s formula."""
        height, width = data["pixel_codes"].shape[-2:]
        patch = self._hf.patch_size
        count = (height // patch) * (width // patch) + self._hf.num_additional_image_tokens
        if self._hf.vision_feature_select_strategy == "default":
            count -= 1
        return count

    def image_tokens(self, width: int, height: int, mm_kwargs: dict[str, Any]) -> int | None:
        """Placeholder tokens of any image: the processor crops every image to one fixed size
        (None when this checkpoint's processor keeps the image's own size)."""
        processor = self._hf.image_processor
        crop = getattr(processor, "crop_size", None)
        if not getattr(processor, "do_center_crop", False) or not crop:
            return None
        shape = torch.empty(0, 0, int(crop["height"]), int(crop["width"]))
        return self.num_placeholder_tokens({"pixel_codes": shape})

    def position_key(self, data: dict[str, torch.Tensor],
                     group: tuple[int, float] | None = None) -> tuple[int | float, ...]:
        """What the decoder's positions read of an item (`MultiModalItem.position_key`): nothing,
        LLaVA's positions are 1-D and its image features depend on the pixels alone."""
        return ()

    def process(self, prompt: str, images: list[Any]) -> ProcessedPrompt:
        """Processes each image, expands each `<image>` in `prompt` and tokenizes.

        Raises `ValueError` when the number of `<image>` tokens differs from `len(images)` or an
        image is not a PIL image.
        """
        self._validate(prompt, images)
        datas = [self.process_image(image) for image in images]
        token_ids, ranges = self.expand(prompt, [self.num_placeholder_tokens(data) for data in datas])
        items = [
            MultiModalItem(modality="image", mm_hash=uuid.uuid4().hex, data=data, placeholder=rng)
            for data, rng in zip(datas, ranges)
        ]
        return ProcessedPrompt(prompt_token_ids=token_ids, mm_items=items)

    def check_image_count(self, prompt: str, num_images: int) -> None:
        """ValueError unless the prompt has exactly one `<image>` per image."""
        placeholders.check_image_count(prompt, self.image_token, num_images)

    def expand(self, prompt: str, counts: list[int]) -> tuple[list[int], list[PlaceholderRange]]:
        """The token ids `LlavaProcessor` gets by tokenizing `prompt` with its i-th `<image>`
        expanded to `counts[i]` placeholders, and each item's placeholder range
        (`placeholders.expand`)."""
        return placeholders.expand(self.tokenizer, self.image_token, self.image_token_id, prompt, counts)

    def settings(self) -> dict[str, Any]:
        """The image processor's settings (what changes its output), for the item hash."""
        return {"image_processor": self._hf.image_processor.to_dict(), "patch_size": self._hf.patch_size,
                "strategy": self._hf.vision_feature_select_strategy,
                "extra_tokens": self._hf.num_additional_image_tokens}

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            options: ChatTemplateOptions | None = None) -> str:
        """Renders a conversation with the model's chat template (wherever it is published:
        multimodal/chat_templates.py) or `options.template`, ending as `options` say (default:
        with the reply prompt); ClientError for what the template refuses."""
        options = options or ChatTemplateOptions()
        own, processors = self.tokenizer.chat_template, self._hf.chat_template  # str, a dict of named ones, or None
        template = options.template or pick_chat_template(processors if isinstance(processors, str) else None,
                                                          own if isinstance(own, str) else None, bool(tools))
        return render_chat(self._hf.apply_chat_template, template, conversation, tools, options,
                           {"image": self.image_token})

    def _validate(self, prompt: str, images: list[Any]) -> None:
        if not isinstance(images, (list, tuple)):
            raise ClientError(f"images must be a list, not {type(images).__name__}")
        for image in images:
            check_image(image)
        self.check_image_count(prompt, len(images))


def create_processor(model_path: str) -> ItemProcessor:
    """The P0 processor for a checkpoint: LLaVA's (this module), InternVL's
    (multimodal/internvl_processor.py) or the Qwen-VL families' (multimodal/qwen_processor.py),
    chosen by `config.json`'s architectures."""
    from mmserve.models.hf_config import LlavaModelConfig, load_model_config
    from mmserve.models.internvl_config import InternVLModelConfig

    config = load_model_config(model_path)
    if isinstance(config, LlavaModelConfig):
        return MultiModalProcessor(model_path)
    if isinstance(config, InternVLModelConfig):
        from mmserve.multimodal.internvl_processor import InternVLItemProcessor

        return InternVLItemProcessor(model_path)
    from mmserve.multimodal.qwen_processor import QwenVLProcessor

    return QwenVLProcessor(model_path)


def _fill_missing_llava_fields(processor: Any, model_path: str) -> None:
    """Old checkpoints (a `preprocessor_config.json` and no processor config) leave the
    LlavaProcessor without `patch_size`; take it and the strategy from `config.json`."""
    if getattr(processor, "patch_size", None) is not None:
        return
    config_file = os.path.join(model_path, "config.json")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    processor.patch_size = config.get("vision_config", {}).get("patch_size", 14)
    processor.vision_feature_select_strategy = config.get("vision_feature_select_strategy", "default")
    processor.num_additional_image_tokens = 1  # CLIP's CLS token
