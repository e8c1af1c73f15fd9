"""Input processing (P0) for InternVL 3 / 3.5: an image cut into tiles, placeholders expanded here.

transformers' `InternVLProcessor` runs the `GotOcr2ImageProcessor` with `crop_to_patches` on: the
image is resized to the grid of tiles whose aspect ratio is nearest its own (between
`min_patches` and `max_patches` tiles), cut into them, and, when there is more than one, followed
by a thumbnail of the whole image. As for Qwen-VL, the pixels are the PIL class's
(`GotOcr2ImageProcessorPil`) whichever class the file names, on every machine: the torchvision
class resizes with its own bicubic, whose pixels may differ in the last bits. Each `<IMG_CONTEXT>` of the prompt becomes
`<img>` + `image_seq_length` x tiles `<IMG_CONTEXT>` + `</img>`. Here the image processor's
geometry runs with its arithmetic off (its uint8 pixels are the item's codes, its arithmetic a
table: multimodal/pixel_table.py) and the prompt is expanded in token space, so the token ids and
the pixel values equal the processor's.

A request may set the tiling (`mm_processor_kwargs`): transformers' names `crop_to_patches`,
`min_patches`, `max_patches`, or vLLM's InternVL names `dynamic_image_size`, `min_dynamic_patch`,
`max_dynamic_patch`; at most the checkpoint's own `max_patches` (what the memory profile sized).
It changes the processed item, so it is part of the item's hash. Video input is not supported.

InternVL's own layout (`InternVLChatModel`) tiles the same way, with the settings config.json holds
(`min_dynamic_patch`, `max_dynamic_patch`; vLLM's processor reads the same), and its prompts name an
image `<image>` (vLLM's placeholder for it), expanded to the same tokens.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from PIL import Image

from mmserve.errors import ClientError
from mmserve.ipc.items import PlaceholderRange
from mmserve.models.tokenizer import load_tokenizer
from mmserve.multimodal import placeholders
from mmserve.multimodal.chat_templates import ChatTemplateOptions, processor_chat_template, render_with_tokenizer
from mmserve.multimodal.media import check_image, to_rgb
from mmserve.multimodal.pixel_table import geometry, processor_lut

# vLLM's InternVL names for transformers' (the request may use either)
VLLM_NAMES = {"dynamic_image_size": "crop_to_patches", "min_dynamic_patch": "min_patches",
              "max_dynamic_patch": "max_patches"}
MM_KWARGS = ("crop_to_patches", "min_patches", "max_patches")


class InternVLItemProcessor:
    """The checkpoint's tokenizer, chat template and tiling image processor: an `ItemProcessor`
    (multimodal/processor_api.py) with no video input, a sibling of the LLaVA and Qwen-VL ones.

    Stateless after construction: a call that raises leaves nothing."""

    def __init__(self, model_path: str) -> None:
        from mmserve.models.hf_config import load_model_config
        from mmserve.models.internvl_config import CHAT, InternVLModelConfig

        config = load_model_config(model_path)
        if not isinstance(config, InternVLModelConfig):
            raise ValueError(f"{model_path!r} is not an InternVL checkpoint")
        self.tokenizer: Any = load_tokenizer(model_path)
        self.own_layout = config.layout == CHAT
        self.image_processor = _own_image_processor(config) if self.own_layout else _hf_image_processor(model_path)
        self.chat_template = None if self.own_layout else processor_chat_template(model_path)
        self.context_token = "<IMG_CONTEXT>"  # what each of an image's placeholders is
        self.image_token = "<image>" if self.own_layout else self.context_token  # the prompt's token for an image
        self.image_token_id = config.image_token_id
        self.wrap = ((self._token_id("<img>"),), (self._token_id("</img>"),))
        if self._token_id(self.context_token) != self.image_token_id:
            raise ValueError(f"{model_path!r}: the tokenizer's {self.context_token} is not config.json's "
                             f"image_token_id {self.image_token_id}")
        self.tile_tokens = config.tile_tokens
        seq = _processor_config(model_path).get("image_seq_length", self.tile_tokens)
        if seq != self.tile_tokens and not self.own_layout:
            raise ValueError(f"{model_path!r}: processor_config.json's image_seq_length {seq} is not the "
                             f"{self.tile_tokens} tokens the model makes of a tile")
        size = self.image_processor.size
        side = config.vision.image_size
        if (int(size["height"]), int(size["width"])) != (side, side):
            raise ValueError(f"{model_path!r}: the image processor's tiles of {size['height']}x{size['width']} "
                             f"pixels are not the vision tower's {side}x{side}")
        self.video = None  # InternVL's video input is not supported
        self.defaults: dict[str, Any] = {"crop_to_patches": True,  # InternVLProcessor's default
                                         "min_patches": int(self.image_processor.min_patches),
                                         "max_patches": int(self.image_processor.max_patches)}
        self.lut = processor_lut(self.image_processor, 1, lambda images: images.flatten(2))  # [C, 256]

    def _token_id(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == self.tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {token} token, which InternVL's prompts need")
        return token_id

    def check_mm_kwargs(self, mm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """The request's tiling, validated (ClientError) and normalised to transformers' names: only
        the keys whose value differs from the default, so that a default setting hashes as none."""
        given = dict(mm_kwargs or {})
        unknown = sorted(set(given) - set(MM_KWARGS) - set(VLLM_NAMES))
        if unknown:
            raise ClientError(f"unsupported mm_processor_kwargs {', '.join(unknown)}; this model takes "
                              f"{', '.join(MM_KWARGS + tuple(VLLM_NAMES))}")
        settings: dict[str, Any] = {}
        for key, value in given.items():
            name = VLLM_NAMES.get(key, key)
            if name in settings:
                raise ClientError(f"mm_processor_kwargs sets {name} twice (as {key} and its other name)")
            settings[name] = value
        limit = self.defaults["max_patches"]
        for key in ("min_patches", "max_patches"):
            value = settings.get(key)
            if value is not None and (type(value) is not int or not 1 <= value <= limit):
                raise ClientError(f"mm_processor_kwargs.{key} must be an integer in [1, {limit}] (this "
                                  f"checkpoint's max_patches); got {value!r:.40}")
        if "crop_to_patches" in settings and type(settings["crop_to_patches"]) is not bool:
            raise ClientError("mm_processor_kwargs.crop_to_patches must be true or false")
        tiling = {**self.defaults, **settings}
        if tiling["min_patches"] > tiling["max_patches"]:
            raise ClientError(f"mm_processor_kwargs: min_patches ({tiling['min_patches']}) exceeds max_patches "
                              f"({tiling['max_patches']})")
        return {k: v for k, v in settings.items() if v != self.defaults[k]}

    def process_image(self, image: Image.Image, mm_kwargs: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """One image -> `{"pixel_codes": Tensor[N, C, S, S] uint8, "pixel_lut": Tensor[C, 256]}`: its
        N tiles (thumbnail last) as the image processor lays them out, as codes and their values
        (ipc/pixel_codes.py). `mm_kwargs`: the request's tiling, checked as `check_mm_kwargs` does."""
        check_image(image)
        tiling = {**self.defaults, **self.check_mm_kwargs(mm_kwargs)}
        codes = geometry(self.image_processor, to_rgb(image), **tiling)["pixel_values"]
        return {"pixel_codes": codes, "pixel_lut": self.lut}

    def image_tokens(self, width: int, height: int, mm_kwargs: dict[str, Any]) -> int:
        """Placeholder tokens of a width x height image under the request's tiling, from the image
        processor's own count of tiles (no pixel touched)."""
        tiles = self.image_processor.get_number_of_image_patches(height, width, {**self.defaults, **mm_kwargs})
        return int(tiles) * self.tile_tokens

    def num_placeholder_tokens(self, data: dict[str, torch.Tensor]) -> int:
        """`image_seq_length` per tile."""
        return int(data["pixel_codes"].shape[0]) * self.tile_tokens

    def position_key(self, data: dict[str, torch.Tensor],
                     group: tuple[int, float] | None = None) -> tuple[int | float, ...]:
        """Nothing: InternVL's positions are 1-D and its image features depend on the pixels alone."""
        return ()

    def settings(self) -> dict[str, Any]:
        """The image processor's settings (what changes its output), for the item hash."""
        return {"image_processor": self.image_processor.to_dict(), "tiling": self.defaults,
                "tile_tokens": self.tile_tokens}

    def check_image_count(self, prompt: str, num_images: int) -> None:
        """ClientError unless the prompt has exactly one image token per image."""
        placeholders.check_image_count(prompt, self.image_token, num_images)

    def expand(self, prompt: str, counts: list[int]) -> tuple[list[int], list[PlaceholderRange]]:
        """Token ids with the i-th image token (`<IMG_CONTEXT>`; InternVL's own layout: `<image>`)
        expanded to `<img>`, `counts[i]` `<IMG_CONTEXT>`, `</img>`, and each image's range (its
        `<IMG_CONTEXT>` tokens)."""
        if self.own_layout:  # `<image>` is text to the tokenizer; `<IMG_CONTEXT>` one token
            prompt = prompt.replace(self.image_token, self.context_token)
        return placeholders.expand(self.tokenizer, self.context_token, self.image_token_id, prompt, counts, self.wrap)

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            options: ChatTemplateOptions | None = None) -> str:
        """Renders a conversation with the checkpoint's chat template (wherever it is published:
        multimodal/chat_templates.py) or `options.template`, ending as `options` say (default:
        with the reply prompt); ClientError for what the template refuses."""
        return render_with_tokenizer(self.tokenizer, self.chat_template, conversation, tools, options,
                                     {"image": self.image_token})


def _processor_config(model_path: str) -> dict[str, Any]:
    path = os.path.join(model_path, "processor_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _hf_image_processor(model_path: str) -> Any:
    """transformers' layout: the checkpoint's `GotOcr2ImageProcessor` settings, in the PIL class."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    path = os.path.join(model_path, "preprocessor_config.json")
    kind = ""
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            kind = json.load(f).get("image_processor_type") or ""
    if not kind.startswith("GotOcr2ImageProcessor"):
        raise ValueError(f"{model_path!r}: an InternVL image processor of type {kind or 'unnamed'!r} is not supported "
                         "(only GotOcr2ImageProcessor's tiling)")
    return GotOcr2ImageProcessorPil.from_pretrained(model_path)


def _own_image_processor(config: Any) -> Any:
    """InternVL's own layout: its `dynamic_preprocess` (tiles of the tower's size, the grid nearest the
    image's aspect ratio, a thumbnail after several, bicubic) and `ToTensor` + `Normalize` by
    ImageNet's mean and std, which are `GotOcr2ImageProcessorPil`'s with these settings."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    low, high, thumbnail = config.tiling
    if not thumbnail and high > 1:
        raise ValueError("an InternVL checkpoint with use_thumbnail false is not supported")
    side = config.vision.image_size
    return GotOcr2ImageProcessorPil(size={"height": side, "width": side}, min_patches=low, max_patches=high,
                                    image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],
                                    resample=3, crop_to_patches=False)
