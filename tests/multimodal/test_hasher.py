"""The framed item hash: what must never collide, and what must be equal."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from mmserve.multimodal.hasher import ItemHasher, hash_object


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


RGB = Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3))


def palette_image(palette_shift: int) -> Image.Image:
    img = Image.new("P", (4, 4), 1)
    img.putpalette([(i + palette_shift) % 256 for i in range(768)])
    return img


@pytest.mark.parametrize("a, b", [
    (RGB, RGB.convert("RGBA")),  # mode
    (palette_image(0), palette_image(1)),  # same indices, other palette
    (torch.arange(6.0).view(2, 3), torch.arange(6.0).view(3, 2)),  # shape
    (torch.arange(6.0).view(2, 3), torch.arange(6.0).view(2, 3).T),  # transpose
    (torch.zeros(4, dtype=torch.float32), torch.zeros(2, dtype=torch.float64)),  # dtype, same bytes
    (torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.float16)),
    (np.zeros((2, 2), np.uint8), np.zeros(4, np.uint8)),
    ([[1, 2], 3], [1, [2, 3]]),  # nested vs flat
    ([1, 2, 3], [[1, 2, 3]]),
    (None, b""),  # None vs empty
    (b"", []),
    ("", b""),
    (["ab", "c"], ["a", "bc"]),  # concatenations equal
    ([b"ab", b"c"], [b"a", b"bc"]),
    ({"a": 1}, {"a": "1"}),
    (1, True),
    (1, 1.0),
    ({"a": [1]}, {"a": 1}),
])
def test_structurally_different_inputs_do_not_collide(a, b):
    assert hash_object(a) != hash_object(b)


@pytest.mark.parametrize("a, b", [
    ({"a": 1, "b": [2, {"c": 3, "d": 4}]}, {"b": [2, {"d": 4, "c": 3}], "a": 1}),  # key order
    (torch.arange(6.0).view(2, 3).T, torch.arange(6.0).view(2, 3).T.contiguous()),  # non-contiguous
    (np.arange(6).reshape(2, 3)[:, ::2], np.ascontiguousarray(np.arange(6).reshape(2, 3)[:, ::2])),
    (RGB, Image.open(io.BytesIO(png_bytes(RGB)))),  # same pixels through another path
])
def test_equal_content_hashes_equal(a, b):
    assert hash_object(a) == hash_object(b)


def test_item_hash_scopes_model_settings_salt_and_kind():
    h = ItemHasher("model-a", {"size": 336})
    raw = png_bytes(RGB)
    base = h.hash_item("image", raw)
    assert base == ItemHasher("model-a", {"size": 336}).hash_item("image", raw)
    assert base != ItemHasher("model-b", {"size": 336}).hash_item("image", raw)
    assert base != ItemHasher("model-a", {"size": 224}).hash_item("image", raw)
    assert base != h.hash_item("image", raw, salt="tenant-1")
    assert h.hash_item("image", raw, salt="tenant-1") != h.hash_item("image", raw, salt="tenant-2")
    assert base != h.hash_item("video", raw)
    assert base != h.hash_item("image", RGB)  # encoded bytes vs pixels are different items
    assert h.hash_uuid("image", "cat") != h.hash_uuid("image", "cat", salt="t")
    assert h.hash_uuid("image", "cat") != h.hash_item("image", "cat".encode())


def test_unhashable_types_are_refused():
    with pytest.raises(TypeError):
        hash_object(object())
    with pytest.raises(TypeError):
        hash_object({1: "a"})


def _variants() -> list[Image.Image]:
    """Images that differ in one property processing might read (mode, palette, transparency
    as a palette index, a colour or per-entry alphas, an unrelated info key, pixels)."""
    base = Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3)).convert("P")
    out = [base, base.convert("RGB"), base.convert("L"), base.convert("RGBA"), palette_image(3)]
    for transparency in (0, 1, bytes([0, 128, 255])):
        t = base.copy()
        t.info["transparency"] = transparency
        out.append(t)
    grey = base.convert("L")
    grey.info["transparency"] = 5
    rgb = base.convert("RGB")
    rgb.info["transparency"] = (0, 1, 2)
    dpi = base.copy()
    dpi.info["dpi"] = (72, 72)  # nothing reads it: it may hash alike
    return out + [grey, rgb, dpi]


def test_transparency_alone_changes_the_hash():
    """Regression: two images differing only in info['transparency'] got one mm_hash, though
    processing composites with it, so the second was answered with the first one's output."""
    from mmserve.multimodal.media import to_rgb

    plain = palette_image(0)
    clear = palette_image(0)
    clear.info["transparency"] = 1
    assert to_rgb(plain).tobytes() != to_rgb(clear).tobytes()
    hasher = ItemHasher("m", {})
    assert hasher.hash_item("image", plain) != hasher.hash_item("image", clear)


def test_whatever_changes_the_processed_pixels_changes_the_hash():
    """Processing sees an image only through `to_rgb`: any two inputs it turns into different
    pixels must hash differently (fails if to_rgb starts reading a property the hasher skips)."""
    from mmserve.multimodal.media import to_rgb

    hasher = ItemHasher("m", {})
    images = _variants()
    for i, a in enumerate(images):
        for b in images[i + 1:]:
            if to_rgb(a).tobytes() != to_rgb(b).tobytes() or to_rgb(a).size != to_rgb(b).size:
                assert hasher.hash_item("image", a) != hasher.hash_item("image", b), (a.mode, a.info, b.mode, b.info)
