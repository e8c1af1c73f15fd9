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
