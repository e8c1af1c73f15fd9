"""Our PNG decoding (multimodal/png.py, csrc/png.c) gives Pillow's image for the PNGs it takes, and
leaves every other PNG, and every irregular one, to Pillow."""

from __future__ import annotations

import io
import os
import shutil
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from mmserve.multimodal import png
from mmserve.multimodal.media import MediaError, MediaLimits, decode_image, to_rgb
from helpers.tiny_models import make_image


@pytest.fixture(autouse=True)
def ours():
    """Ours must be had wherever a compiler and zlib-ng are."""
    if shutil.which(os.environ.get("CC") or "cc") is None or png.zlib_ng() is None:
        pytest.skip("no C compiler or no zlib-ng here")
    assert png.library() is not None


def chunk(name: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + name + body + struct.pack(">I", zlib.crc32(name + body))


def filtered(pixels: np.ndarray, types: np.ndarray) -> bytes:
    """Rows of [H, W, C] uint8 pixels filtered by the spec's five filters, row y by types[y]."""
    height, width, bpp = pixels.shape
    rows = pixels.reshape(height, width * bpp).astype(np.int64)
    out = []
    for y in range(height):
        x, up = rows[y], rows[y - 1] if y else np.zeros_like(rows[y])
        left = np.concatenate([np.zeros(bpp, np.int64), x[:-bpp]])
        up_left = np.concatenate([np.zeros(bpp, np.int64), up[:-bpp]])
        predictor = {0: 0, 1: left, 2: up, 3: (left + up) // 2, 4: paeth(left, up, up_left)}[int(types[y])]
        out.append(bytes([int(types[y])]) + ((x - predictor) % 256).astype(np.uint8).tobytes())
    return b"".join(out)


def paeth(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    p = a + b - c
    pa, pb, pc = np.abs(p - a), np.abs(p - b), np.abs(p - c)
    return np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))


def encode(pixels: np.ndarray, types: np.ndarray, extra: tuple[tuple[bytes, bytes], ...] = (),
           idat_parts: int = 3, level: int = 6) -> bytes:
    """A PNG of 8-bit RGB or RGBA pixels: IHDR, `extra` chunks, the image data in `idat_parts`
    IDAT chunks, IEND."""
    height, width, channels = pixels.shape
    header = struct.pack(">IIBBBBB", width, height, 8, {3: 2, 4: 6}[channels], 0, 0, 0)
    stream = zlib.compress(filtered(pixels, types), level)
    cut = np.linspace(0, len(stream), idat_parts + 1).astype(int)
    data = b"".join(chunk(b"IDAT", stream[a:b]) for a, b in zip(cut[:-1], cut[1:]))
    return (png.SIGNATURE + chunk(b"IHDR", header) + b"".join(chunk(n, b) for n, b in extra) + data
            + chunk(b"IEND", b""))


def pillows(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


@pytest.mark.parametrize("channels", [3, 4])
def test_every_filter_type_at_many_widths_equals_pillow(channels: int):
    rng = np.random.default_rng(channels)
    for width, height in ((1, 1), (1, 7), (2, 5), (3, 4), (17, 9), (64, 33), (101, 20)):
        smooth = make_image(width * height, (width, height), mode="RGBA" if channels == 4 else "RGB")
        for pixels in (np.asarray(smooth), rng.integers(0, 256, (height, width, channels), dtype=np.uint8)):
            for types in (rng.integers(0, 5, height), np.full(height, 4)):  # mixed; every row Paeth (done in pairs)
                data = encode(pixels, types)
                ours = png.decode_png(data)
                assert ours is not None and ours.mode == pillows(data).mode
                np.testing.assert_array_equal(np.asarray(ours), np.asarray(pillows(data)), err_msg=f"{width}x{height}")
                np.testing.assert_array_equal(np.asarray(ours), pixels)


def test_pillows_own_pngs_and_decode_image_are_unchanged():
    for mode in ("RGB", "RGBA"):
        image = make_image(4, (300, 200), mode=mode)
        for level in (0, 1, 9):
            buffer = io.BytesIO()
            image.save(buffer, "PNG", compress_level=level)
            data = buffer.getvalue()
            ours = png.decode_png(data)
            assert ours is not None
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(pillows(data)))
            decoded = decode_image(data, MediaLimits())  # RGBA composited onto white, as before
            assert decoded.mode == "RGB"
            np.testing.assert_array_equal(np.asarray(decoded), np.asarray(to_rgb(pillows(data))))


def test_pngs_that_are_not_ours_are_left_to_pillow():
    pixels = np.asarray(make_image(1, (8, 6)))
    types = np.zeros(6, np.int64)
    not_ours = {
        "transparency": encode(pixels, types, extra=((b"tRNS", b"\x00\x01\x00\x02\x00\x03"),)),
        "animation": encode(pixels, types, extra=((b"acTL", struct.pack(">II", 1, 0)),)),
        "unknown chunk": encode(pixels, types, extra=((b"zzZz", b"x"),)),
        "bad crc": encode(pixels, types)[:-4] + b"\x00\x00\x00\x00",
        "after IEND": encode(pixels, types) + b"junk",
        "data split by another chunk": _split_data(pixels, filtered(pixels, types)),  # Pillow: truncated
        "bad filter type": _with_stream(pixels, b"\x07" + filtered(pixels, types)[1:]),
        "short data": _with_stream(pixels, filtered(pixels, types)[:-1]),
        "long data": _with_stream(pixels, filtered(pixels, types) + b"\x00"),
        "broken stream": _with_stream(pixels, b"", stream=b"\x78\x9c\xff\xff"),
    }
    for name, data in not_ours.items():
        assert png.decode_png(data) is None, name
    for mode in ("L", "P", "I;16"):  # other colour types and depths
        buffer = io.BytesIO()
        make_image(2, (8, 6), mode="RGB").convert(mode).save(buffer, "PNG")
        assert png.decode_png(buffer.getvalue()) is None, mode
    interlaced = _with_stream(pixels, filtered(pixels, types), interlace=1)  # Adam7 (Pillow saves none)
    assert png.decode_png(interlaced) is None


def _split_data(pixels: np.ndarray, rows: bytes) -> bytes:
    height, width, _ = pixels.shape
    stream = zlib.compress(rows)
    half = len(stream) // 2
    return (png.SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", stream[:half]) + chunk(b"tEXt", b"a\x00b") + chunk(b"IDAT", stream[half:])
            + chunk(b"IEND", b""))


def _with_stream(pixels: np.ndarray, rows: bytes, stream: bytes | None = None, interlace: int = 0) -> bytes:
    height, width, _ = pixels.shape
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, interlace)
    return (png.SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows) if stream is None else stream)
            + chunk(b"IEND", b""))


def test_a_broken_png_is_still_a_client_error():
    pixels = np.zeros((4, 4, 3), np.uint8)
    broken = _with_stream(pixels, b"", stream=b"\x78\x9c\xff\xff")
    for data in (broken, _split_data(pixels, filtered(pixels, np.zeros(4)))):  # the second: ours would decode it
        with pytest.raises(MediaError):
            decode_image(data, MediaLimits())
