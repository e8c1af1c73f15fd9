"""Our resize (multimodal/resample.py, csrc/resample.c) gives Pillow's bytes, or leaves the work to Pillow."""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import PIL
import pytest
from PIL import Image

from mmserve.multimodal import resample

FILTERS = tuple(resample.SUPPORTS)


@pytest.fixture
def library():
    """Our library, which must be had (and agree with Pillow at load) wherever a compiler is."""
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler here")
    assert resample.library() is not None, "built, but unlike Pillow at load (see the log)"
    return resample.library()


def random_image(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def photo(width: int, height: int) -> Image.Image:
    """A smooth picture: a photo's statistics, where rounding ties are likelier than in noise."""
    base = np.random.default_rng(3).integers(0, 256, (9, 12, 3), dtype=np.uint8)
    return Image.fromarray(base).resize((width, height), Image.Resampling.BILINEAR)


def test_equals_pillow_on_random_sizes_and_every_filter(library):
    rng = np.random.default_rng(0)
    for _ in range(150):
        width, height, out_width, out_height = (int(v) for v in rng.integers(1, 160, 4))
        image, resample_ = random_image(rng, width, height), FILTERS[int(rng.integers(len(FILTERS)))]
        ours = resample.resize_rgb(image, (out_width, out_height), resample_)
        assert ours.flags.writeable and ours.flags.c_contiguous
        np.testing.assert_array_equal(ours, np.asarray(image.resize((out_width, out_height), resample_)),
                                      err_msg=f"{(width, height)} -> {(out_width, out_height)}, {resample_!r}")


@pytest.mark.parametrize(("size", "out"), [((1024, 768), (1036, 756)), ((1920, 1080), (1344, 756)),
                                           ((640, 480), (644, 476)), ((3000, 400), (700, 112)),
                                           ((448, 448), (448, 448))])
def test_equals_pillow_at_qwens_sizes(library, size: tuple[int, int], out: tuple[int, int]):
    image = photo(*size)
    for resample_ in (Image.Resampling.BICUBIC, Image.Resampling.LANCZOS):
        ours = resample.resize_rgb(image, out, resample_)
        np.testing.assert_array_equal(ours, np.asarray(image.resize(out, resample_)))


def test_the_pass_order_is_pillows(library):
    """Where the height shrinks much more than the width, Pillow 13 runs the vertical pass first;
    the two orders round differently, so only Pillow's order gives its bytes."""
    image, out = photo(1024, 768), (1036, 756)
    wide_first = image.resize((out[0], image.height), Image.Resampling.BICUBIC).resize(out, Image.Resampling.BICUBIC)
    high_first = image.resize((image.width, out[1]), Image.Resampling.BICUBIC).resize(out, Image.Resampling.BICUBIC)
    assert not np.array_equal(np.asarray(wide_first), np.asarray(high_first))
    pillows = high_first if int(PIL.__version__.split(".")[0]) >= resample.VERTICAL_FIRST_SINCE else wide_first
    np.testing.assert_array_equal(resample.resize_rgb(image, out, Image.Resampling.BICUBIC), np.asarray(pillows))


def test_the_probe_reads_pillows_weights():
    """Bicubic weights by Pillow's formula (libImaging/Resample.c: precompute_coeffs, then
    normalize_coeffs_8bpc), in double as Pillow computes them, equal what the probe reads."""
    def bicubic(x: float) -> float:
        x = abs(x)
        return (1.5 * x - 2.5) * x * x + 1 if x < 1 else ((((x - 5) * x + 8) * x - 4) * -0.5 if x < 2 else 0.0)

    for n_in, n_out in ((1024, 1036), (768, 756), (4000, 1148), (7, 3)):
        weights = resample.pass_weights(n_in, n_out, Image.Resampling.BICUBIC)
        assert weights is not None
        first, w = weights
        scale = n_in / n_out
        support = 2.0 * max(scale, 1.0)
        for o in range(n_out):
            center = (o + 0.5) * scale
            lo, hi = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), n_in)
            k = [bicubic((x - center + 0.5) / max(scale, 1.0)) for x in range(lo, hi)]
            fixed = [int(v / sum(k) * resample.ONE + (0.5 if v >= 0 else -0.5)) for v in k]
            row = np.zeros(n_in, np.int64)
            row[first[o]:first[o] + w.shape[1]] = w[o]
            assert row[lo:hi].tolist() == fixed and not row[:lo].any() and not row[hi:].any()


def test_a_resize_unlike_pillows_is_caught_at_load_and_pillow_resizes(library, monkeypatch, caplog):
    """The check at load compares with Pillow: here our pass order made wrong on purpose."""
    pillows_order = resample.horizontal_first
    monkeypatch.setattr(resample, "horizontal_first", lambda *sizes: not pillows_order(*sizes))
    resample.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="mmserve.multimodal.resample"):
            assert resample.library() is None
        assert "differs from Pillow" in caplog.text
        image = photo(1024, 768)
        np.testing.assert_array_equal(resample.resize_rgb(image, (1036, 756), Image.Resampling.BICUBIC),
                                      np.asarray(image.resize((1036, 756), Image.Resampling.BICUBIC)))
    finally:
        monkeypatch.undo()
        resample.library.cache_clear()


def test_without_the_library_or_outside_its_cases_pillow_resizes(monkeypatch):
    image = photo(64, 48)
    for other in (image.convert("L"), image.convert("RGBA")):  # not RGB: Pillow's own resize
        np.testing.assert_array_equal(resample.resize_rgb(other, (30, 20), Image.Resampling.BICUBIC),
                                      np.asarray(other.resize((30, 20), Image.Resampling.BICUBIC)))
    np.testing.assert_array_equal(resample.resize_rgb(image, (30, 20), Image.Resampling.NEAREST),
                                  np.asarray(image.resize((30, 20), Image.Resampling.NEAREST)))
    monkeypatch.setenv("MMSERVE_CPU_KERNELS", "0")
    resample.library.cache_clear()
    try:
        assert resample.library() is None
        out = resample.resize_rgb(image, (30, 20), Image.Resampling.BICUBIC)
        assert out.flags.writeable
        np.testing.assert_array_equal(out, np.asarray(image.resize((30, 20), Image.Resampling.BICUBIC)))
    finally:
        monkeypatch.undo()
        resample.library.cache_clear()
