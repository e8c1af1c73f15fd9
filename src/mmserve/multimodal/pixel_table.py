"""A Hugging Face image processor split in two (P0): its geometry, and a table of its arithmetic.

`geometry` runs the processor with rescaling and normalizing turned off: the pixels it lays out
are whole values 0..255, the item's `pixel_codes` (ipc/pixel_codes.py). `processor_lut` runs the
processor on a small RGB image in which every channel holds every value 0..255, once with its
arithmetic off and once on, and pairs them up: the item's `pixel_lut`, the processor's own
numbers for each code, whichever backend (PIL or torchvision) it runs on. `Geometry` is
`geometry` with a PIL-backend processor's resize done by our loops (multimodal/resample.py),
which give Pillow's bytes.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

from mmserve.ipc.pixel_codes import CODES, codes_of, lut_from
from mmserve.multimodal import resample

logger = logging.getLogger(__name__)

NO_ARITHMETIC = {"do_rescale": False, "do_normalize": False}
NO_GEOMETRY = {"do_resize": False, "do_center_crop": False}


def processor_lut(image_processor: Any, multiple: int,
                  as_acb: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The processor's [C, 256] table. `multiple`: a side length its layout divides (Qwen-VL's
    patch x merge); `as_acb`: its `pixel_values` viewed [A, C, B] (the channel at dim 1)."""
    side = multiple * math.ceil(16 / multiple)  # >= 16: at least 256 pixels, every code in each channel
    index = np.arange(side * side).reshape(side, side, 1)
    pixels = ((index + 85 * np.arange(3)) % CODES).astype(np.uint8)  # [side, side, 3], shifted per channel
    sample = [Image.fromarray(pixels, "RGB")]
    codes = image_processor(images=sample, return_tensors="pt", **NO_GEOMETRY, **NO_ARITHMETIC)["pixel_values"]
    values = image_processor(images=sample, return_tensors="pt", **NO_GEOMETRY)["pixel_values"]
    return lut_from(as_acb(codes_of(codes)), as_acb(values.to(torch.float32)))


def geometry(image_processor: Any, image: Image.Image, **kwargs: Any) -> dict[str, torch.Tensor]:
    """The processor's output for one RGB image with its arithmetic off: `pixel_values` as
    uint8 codes (ValueError if they are not whole 0..255), the rest as it returns them."""
    out = image_processor(images=[image], return_tensors="pt", **kwargs, **NO_ARITHMETIC)
    return {**out, "pixel_values": codes_of(out["pixel_values"])}


class Geometry:
    """`geometry` of one processor, its resize by our loops where that is the processor's own
    resize: a PIL-backend processor (CPU machines; CLIP's) that resizes to a shortest edge with a
    convolution filter, with neither step overridden. The size is the processor's own function's,
    then the processor runs with its resize off (crop, layout). Checked against the processor at
    construction on two small images; any difference leaves the processor doing all of it."""

    def __init__(self, image_processor: Any) -> None:
        self.image_processor = image_processor
        self.shortest_edge = _own_shortest_edge(image_processor)
        if self.shortest_edge is not None and not self._agrees():
            logger.warning("our resize differs from %s's; it resizes every image", type(image_processor).__name__)
            self.shortest_edge = None

    def __call__(self, image: Image.Image) -> dict[str, torch.Tensor]:
        """`geometry(image_processor, image)` for an RGB image."""
        if self.shortest_edge is None:
            return geometry(self.image_processor, image)
        from transformers.image_transforms import get_resize_output_image_size

        shape = np.broadcast_to(np.uint8(0), (3, image.height, image.width))  # the size alone, no pixels
        height, width = get_resize_output_image_size(shape, size=self.shortest_edge, default_to_square=False,
                                                     input_data_format="channels_first")
        resized = resample.resize_rgb(image, (width, height), int(self.image_processor.resample))
        return geometry(self.image_processor, Image.fromarray(resized), do_resize=False)

    def _agrees(self) -> bool:
        rng = np.random.default_rng(0)
        for size in ((61, 47), (45, 83)):
            image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
            if not torch.equal(self(image)["pixel_values"], geometry(self.image_processor, image)["pixel_values"]):
                return False
        return True


def _own_shortest_edge(image_processor: Any) -> int | None:
    """The shortest edge a PIL-backend processor resizes to by PIL's resize, or None."""
    try:
        from transformers.image_processing_backends import PilBackend
    except ImportError:
        return None
    kind, size = type(image_processor), getattr(image_processor, "size", None)
    if (not isinstance(image_processor, PilBackend) or kind.resize is not PilBackend.resize
            or kind._preprocess is not PilBackend._preprocess or not getattr(image_processor, "do_resize", False)
            or int(getattr(image_processor, "resample", -1)) not in resample.SUPPORTS or resample.library() is None):
        return None
    edge = getattr(size, "shortest_edge", None)
    others = ("longest_edge", "height", "width", "max_height", "max_width", "min_pixels", "max_pixels")
    return int(edge) if edge and not any(getattr(size, name, None) for name in others) else None
