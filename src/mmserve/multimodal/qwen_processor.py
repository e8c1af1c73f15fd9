"""Input processing (P0) for Qwen2-VL, Qwen2.5-VL and Qwen3-VL: dynamic resolution, placeholders expanded here.

transformers' Qwen-VL processor classes need torchvision, which this CPU torch lacks; as vLLM
does, the pixels are `Qwen2VLImageProcessorPil`'s (the same values as the HF processor): its
geometry done here on uint8, its arithmetic a table it computed (multimodal/pixel_table.py), and
each `<|image_pad|>` in the prompt is repeated t*h*w/merge² times before tokenizing, exactly as
`Qwen2_5_VLProcessor` / `Qwen3VLProcessor` do. A request may bring its own pixel budget
(`mm_processor_kwargs`: `min_pixels`, `max_pixels`, vLLM's names); it changes the processed item,
so it is part of the item's hash.

Videos: `video` (multimodal/video_processor.py) makes the pixels; `expand_videos` writes each
video's placeholders as the family's processor does (see there); the request's video keys of
`mm_processor_kwargs` (`fps`, `num_frames`, `min_frames`, `max_frames`) are validated here and
applied by multimodal/video_items.py.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from mmserve.ipc.items import PlaceholderRange
from mmserve.models.tokenizer import load_tokenizer
from mmserve.multimodal import placeholders
from mmserve.multimodal import resample
from mmserve.multimodal.media import MediaError, check_image, to_rgb
from mmserve.multimodal.pixel_table import processor_lut
from mmserve.multimodal.chat_templates import ChatTemplateOptions, processor_chat_template, render_with_tokenizer
from mmserve.errors import ClientError
from mmserve.models.qwen_config import QWEN3_VL
from mmserve.multimodal.video_options import REQUEST_KEYS
from mmserve.multimodal.video_processor import ProcessedVideo, QwenVideoProcessor, patchify

MM_KWARGS = ("min_pixels", "max_pixels")
_MAX_PIXELS_LIMIT = 1 << 31  # beyond any image a server would accept


class QwenVLProcessor:
    """The checkpoint's tokenizer and chat template, and its image and video processor settings:
    a `VideoItemProcessor` (multimodal/processor_api.py), a sibling of the LLaVA processor.

    Stateless after construction (as the LLaVA processor): a call that raises leaves nothing."""

    def __init__(self, model_path: str) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer: Any = load_tokenizer(model_path)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_path)
        self.chat_template = processor_chat_template(model_path)  # chat_template.jinja / .json, else None
        self.image_token = "<|image_pad|>"
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(self.image_token))
        self.merge_size: int = self.image_processor.merge_size
        self.patch_size, self.temporal_patch_size = int(self.image_processor.patch_size), \
            int(self.image_processor.temporal_patch_size)
        if not self.image_processor.do_resize:
            raise ValueError(f"{model_path!r}: an image processor with do_resize false is not supported")
        self.lut = processor_lut(self.image_processor, self.patch_size * self.merge_size,
                                 lambda rows: rows.view(rows.shape[0], 3, -1))  # [C, 256]: the pixel values
        resample.library()  # built and checked against Pillow now, not in the first request
        size = self.image_processor.size
        self.default_pixels = {"min_pixels": int(size["shortest_edge"]), "max_pixels": int(size["longest_edge"])}
        from mmserve.models.hf_config import load_model_config

        from mmserve.models.qwen_config import QwenVLModelConfig

        config = load_model_config(model_path)
        if not isinstance(config, QwenVLModelConfig):
            raise ValueError(f"{model_path!r} is not a Qwen-VL checkpoint")
        self.family = config.family
        self.video: QwenVideoProcessor = QwenVideoProcessor(model_path, self.family)
        self.video_token = "<|video_pad|>"
        self.video_token_id = int(self.tokenizer.convert_tokens_to_ids(self.video_token))

    def check_mm_kwargs(self, mm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """The request's image pixel budget, validated (a ValueError names the fault) and normalised:
        only the image keys given whose value differs from the processor's default, so that a
        setting equal to the default hashes (and hits) as no setting does. Video keys are allowed
        and checked where videos are sampled."""
        mm_kwargs = dict(mm_kwargs or {})
        unknown = sorted(set(mm_kwargs) - set(MM_KWARGS) - set(REQUEST_KEYS))
        if unknown:
            raise ClientError(f"unsupported mm_processor_kwargs {', '.join(unknown)}; this model takes "
                             f"{', '.join(MM_KWARGS + REQUEST_KEYS)}")
        mm_kwargs = {k: v for k, v in mm_kwargs.items() if k in MM_KWARGS}
        for key, value in mm_kwargs.items():
            if type(value) is not int or not 0 < value <= _MAX_PIXELS_LIMIT:
                raise ClientError(f"mm_processor_kwargs.{key} must be an integer in [1, {_MAX_PIXELS_LIMIT}]; "
                                 f"got {value!r:.40}")
        budget = {**self.default_pixels, **mm_kwargs}
        if budget["min_pixels"] > budget["max_pixels"]:
            raise ClientError(f"mm_processor_kwargs: min_pixels ({budget['min_pixels']}) exceeds max_pixels "
                             f"({budget['max_pixels']})")
        return {k: v for k, v in mm_kwargs.items() if v != self.default_pixels[k]}

    def process_image(self, image: Image.Image, mm_kwargs: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """One image -> `{"pixel_codes": Tensor[P, C * p * p] uint8, "pixel_frames": Tensor[] int64
        (Tp), "pixel_lut": Tensor[C, 256], "image_grid_thw": Tensor[3] int64}` (P = t * h * w patches
        in merge-block order, each row one frame of the Tp identical ones the processor lays out;
        the values are `Qwen2VLImageProcessorPil`'s `pixel_values`, looked up and repeated over
        the frames: ipc/pixel_codes.py).
        `mm_kwargs`: the request's pixel budget, checked as `check_mm_kwargs` does (ValueError).

        The processor's geometry, done here on uint8: PIL's resize of the RGB image to
        `smart_resize`'s size with the processor's filter (what its PIL backend calls; by our loops,
        which give its bytes: multimodal/resample.py), then the rows in merge-block order (the
        repeat over the temporal patch left to the lookup)."""
        check_image(image)
        budget = {**self.default_pixels, **self.check_mm_kwargs(mm_kwargs)}
        height, width = self._resized(image.width, image.height, budget)
        resized = resample.resize_rgb(to_rgb(image), (width, height), int(self.image_processor.resample))  # [H, W, C]
        frame = torch.from_numpy(resized).permute(2, 0, 1).unsqueeze(0)  # [1, C, H, W] uint8
        codes, grid = patchify(frame, 1, self.patch_size, self.merge_size)  # one frame
        return {"pixel_codes": codes, "pixel_frames": torch.tensor(self.temporal_patch_size),
                "pixel_lut": self.lut, "image_grid_thw": torch.tensor(grid, dtype=torch.int64)}

    def _resized(self, width: int, height: int, budget: dict[str, int]) -> tuple[int, int]:
        """(height, width) after the processor's resize: `smart_resize` (MediaError for an aspect
        ratio it refuses)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        try:
            return smart_resize(height, width, factor, budget["min_pixels"], budget["max_pixels"])
        except ValueError as e:
            raise MediaError(f"the image cannot be sized: {e}") from None

    def image_tokens(self, width: int, height: int, mm_kwargs: dict[str, Any]) -> int:
        """Placeholder tokens of a width x height image under the request's pixel budget, from the
        processor's `smart_resize` alone (no pixel touched); MediaError for an aspect ratio the
        processor refuses."""
        h, w = self._resized(width, height, {**self.default_pixels, **mm_kwargs})
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def num_placeholder_tokens(self, data: dict[str, torch.Tensor]) -> int:
        """t * h * w / merge²: one embedding per merged block of patches."""
        return int(data["image_grid_thw"].prod()) // self.merge_size**2

    def position_key(self, data: dict[str, torch.Tensor],
                     group: tuple[int, float] | None = None) -> tuple[int | float, ...]:
        """What M-RoPE reads of an item (`MultiModalItem.position_key`): its grid (t, h, w); for a
        Qwen2-VL or Qwen2.5-VL video group also `group` = (its index in the video, seconds per group), its
        temporal place. Qwen3-VL places a group as an image (its timestamp text carries time)."""
        t, h, w = (int(v) for v in data["image_grid_thw"].reshape(3).tolist())
        if group is None or self.family == QWEN3_VL:
            return (t, h, w)
        return (t, h, w, group[0], float(group[1]))

    def settings(self) -> dict[str, Any]:
        """The image processor's settings (what changes its output), for the item hash."""
        return {"image_processor": self.image_processor.to_dict(), "merge_size": self.merge_size,
                "video_processor": self.video.settings()}

    def check_image_count(self, prompt: str, num_images: int) -> None:
        """ValueError unless the prompt has exactly one `<|image_pad|>` per image."""
        placeholders.check_image_count(prompt, self.image_token, num_images)

    def expand(self, prompt: str, counts: list[int]) -> tuple[list[int], list[PlaceholderRange]]:
        """Token ids with the i-th `<|image_pad|>` expanded to `counts[i]` pads, and the ranges."""
        return placeholders.expand(self.tokenizer, self.image_token, self.image_token_id, prompt, counts)

    def check_video_count(self, prompt: str, num_videos: int) -> None:
        """ValueError unless the prompt has exactly one `<|video_pad|>` per video."""
        found = prompt.count(self.video_token)
        if found != num_videos:
            raise ClientError(f"the prompt has {found} {self.video_token} token(s) but {num_videos} video(s) were "
                             f"given; each video needs exactly one {self.video_token} in the prompt")

    def video_text(self, video: ProcessedVideo) -> str:
        """What replaces a video's `<|vision_start|><|video_pad|><|vision_end|>` in the prompt.

        Qwen2(.5)-VL (`Qwen2VLProcessor`, `Qwen2_5_VLProcessor`): the wrapper with t*h*w/merge²
        pads. Qwen3-VL, as its processor in transformers 4.57 (the model's release) writes it: per temporal group
        `<{t:.1f} seconds>` then `<|vision_start|>` + h*w/merge² pads + `<|vision_end|>`, with no
        outer wrapper (transformers 5.x keeps one: 2 tokens more; vLLM follows 4.57, as we do)."""
        groups, h, w = video.grid
        per_group = self.video_token * (h * w // self.merge_size**2)
        if self.family != QWEN3_VL:
            return f"<|vision_start|>{per_group * groups}<|vision_end|>"
        return "".join(f"<{t:.1f} seconds><|vision_start|>{per_group}<|vision_end|>" for t in video.timestamps)

    def expand_videos(self, prompt: str, videos: list[ProcessedVideo]) -> str:
        """The prompt with the i-th video's wrapped `<|video_pad|>` replaced by `video_text`."""
        wrapped = f"<|vision_start|>{self.video_token}<|vision_end|>"
        pieces = prompt.split(wrapped)
        if len(pieces) - 1 != len(videos):
            raise ClientError(f"each video needs its {wrapped} in the prompt (as the chat template writes it)")
        return pieces[0] + "".join(self.video_text(v) + piece for v, piece in zip(videos, pieces[1:]))

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            options: ChatTemplateOptions | None = None) -> str:
        """Renders a conversation with the checkpoint's chat template (wherever it is published:
        multimodal/chat_templates.py) or `options.template`, ending as `options` say (default:
        with the reply prompt); ClientError for what the template refuses."""
        return render_with_tokenizer(self.tokenizer, self.chat_template, conversation, tools, options,
                                     {"image": f"<|vision_start|>{self.image_token}<|vision_end|>",
                                      "video": f"<|vision_start|>{self.video_token}<|vision_end|>"})
