"""A Hugging Face image processor split in two (P0): its geometry, and a table of its arithmetic.

`geometry` runs the processor with rescaling and normalizing turned off: the pixels it lays out
are whole values 0..255, the item's `pixel_codes` (ipc/pixel_codes.py). `processor_lut` runs the
processor on a small RGB image in which every channel holds every value 0..255, once with its
arithmetic off and once on, and pairs them up: the item's `pixel_lut`, the processor's own
numbers for each code, whichever backend (PIL or torchvision) it runs on.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

from mmserve.ipc.pixel_codes import CODES, codes_of, lut_from

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
