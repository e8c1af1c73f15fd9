"""A processor's geometry with its resize by our loops (multimodal/pixel_table.py: Geometry): taken
only where it is the processor's own resize, equal to the processor, and checked at construction."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from mmserve.multimodal import resample
from mmserve.multimodal.pixel_table import Geometry, geometry
from helpers.tiny_models import make_checkpoint, make_image


@pytest.fixture(scope="module")
def image_processor(tmp_path_factory):
    if resample.library() is None:
        pytest.skip("no C compiler here")
    # the PIL backend's processor, which Geometry replaces; where torchvision exists (GPU machines)
    # AutoProcessor picks the torchvision backend's, which keeps its own resize
    path = make_checkpoint(tmp_path_factory.mktemp("llava"))
    return AutoProcessor.from_pretrained(path, backend="pil").image_processor


def test_a_pil_clip_processor_resizes_by_our_loops_and_equals_itself(image_processor):
    ours = Geometry(image_processor)
    assert ours.shortest_edge == image_processor.size.shortest_edge  # the fast path is taken here
    for size in ((640, 480), (480, 640), (17, 93), (300, 20), (20, 20), (1000, 999)):
        image = make_image(size[0], size)
        np.testing.assert_array_equal(ours(image)["pixel_values"].numpy(),
                                      geometry(image_processor, image)["pixel_values"].numpy(), err_msg=str(size))


def test_a_processor_that_resizes_its_own_way_keeps_its_resize(image_processor):
    class OwnResize(type(image_processor)):  # a model's processor overriding resize: not ours to replace
        def resize(self, *args, **kwargs):
            return super().resize(*args, **kwargs)

    assert Geometry(OwnResize(**image_processor.to_dict())).shortest_edge is None


def test_a_resize_unlike_the_processors_is_caught_at_construction(image_processor, monkeypatch, caplog):
    def off_by_one(image: Image.Image, size: tuple[int, int], filter_: int) -> np.ndarray:
        return np.asarray(image.resize((size[0] + 1, size[1]), filter_))

    monkeypatch.setattr(resample, "resize_rgb", off_by_one)
    with caplog.at_level(logging.WARNING, logger="mmserve.multimodal.pixel_table"):
        ours = Geometry(image_processor)
    assert ours.shortest_edge is None and "differs" in caplog.text
    image = make_image(1, (64, 48))
    assert torch.equal(ours(image)["pixel_values"], geometry(image_processor, image)["pixel_values"])
