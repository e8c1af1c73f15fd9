"""The item hash covers everything processing reads of a PIL image (issue 14, case 3): two
images differing only in `info["transparency"]` were one `mm_hash` though processing composites
with it. This test fails if processing (`to_rgb` and each model family's image processor) starts
reading an `info` key the hasher leaves out, and if two images it processes differently hash
alike."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmserve.ipc.pixel_codes import pixel_values
from mmserve.multimodal.hasher import HASHED_INFO_KEYS, ItemHasher
from mmserve.multimodal.processing import create_processor
from helpers.tiny_models import make_checkpoint, make_qwen_checkpoint

MODES = ("RGB", "RGBA", "P", "L", "LA", "1", "I;16", "I", "F", "CMYK", "PA", "RGBa", "YCbCr")
INFO = {"transparency": 3, "background": 7, "gamma": 0.45, "dpi": (72, 72), "icc_profile": b"x", "duration": 5}


class RecordingInfo(dict):
    """An `Image.info` that records the keys read from it one by one."""

    read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        RecordingInfo.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        RecordingInfo.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        RecordingInfo.read.add(str(key))
        return super().__contains__(key)


def images() -> list[Image.Image]:
    base = Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 24, 3), dtype=np.uint8))
    out = []
    for mode in MODES:
        image = base.convert(mode)
        image.info = RecordingInfo({k: v for k, v in INFO.items() if k != "transparency" or mode in ("P", "L")})
        out.append(image)
    return out


@pytest.fixture(scope="module", params=["llava", "qwen3_vl"])
def processor(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hash_covers")
    return create_processor(make_checkpoint(tmp) if request.param == "llava" else make_qwen_checkpoint(tmp))


def test_processing_reads_no_info_key_the_hash_leaves_out(processor):
    RecordingInfo.read = set()
    for image in images():
        processor.process_image(image)
    assert RecordingInfo.read, "the recorder saw nothing: the test no longer watches processing"
    assert RecordingInfo.read <= set(HASHED_INFO_KEYS), RecordingInfo.read - set(HASHED_INFO_KEYS)


def test_images_processed_differently_hash_differently(processor):
    hasher = ItemHasher("m", {})
    variants = []
    for image in images():
        for transparency in (None, 0, 3):
            if transparency is not None and image.mode not in ("P", "L"):
                continue
            v = image.copy()
            v.info = {} if transparency is None else {"transparency": transparency}
            variants.append(v)
    processed = [pixel_values(processor.process_image(v)) for v in variants]
    for i in range(len(variants)):
        for j in range(i + 1, len(variants)):
            if processed[i].shape != processed[j].shape or not bool((processed[i] == processed[j]).all()):
                assert hasher.hash_item("image", variants[i]) != hasher.hash_item("image", variants[j])
