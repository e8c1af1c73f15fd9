"""Pillow's resize of an RGB image, exactly, by our C loops (`csrc/resample.c`): `resize_rgb`.

Resizing is most of P0's work on a new image (Qwen's processors resize every image to a multiple of
its patch). Pillow's own loops are scalar; these are vectorized and give Pillow's bytes:
- Pillow resizes by two passes of a convolution, one per axis, each rounded to uint8 by integer
  arithmetic on int32 weights. Integer sums have one value in any order, so the loops may run in
  any order; the weights and the order of the passes must be Pillow's.
- The weights are Pillow's own, read from Pillow (`pass_weights`): resizing an "I" (int32) image
  runs Pillow's same coefficients in double, and its rounding of `2^22 * w` is the one it rounds the
  8-bit weights by. A probe with one 2^22 every `ksize` pixels therefore gives each output's weights.
- The pass order is Pillow's: horizontal first, except that Pillow 13 runs the vertical pass first
  when the height shrinks by more than twice the width does (`horizontal_first`).
- `library` runs a set of small resizes through both once per process: any difference, or no C
  compiler, leaves Pillow doing every resize.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from pathlib import Path

import numpy as np
import PIL
from PIL import Image

from mmserve import native

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "resample.c"
ONE = 1 << 22  # Pillow's fixed-point 1.0 for 8-bit images (PRECISION_BITS)
# each convolution filter's support at scale 1 (libImaging/Resample.c); NEAREST is not a convolution
SUPPORTS = {Image.Resampling.BOX: 0.5, Image.Resampling.BILINEAR: 1.0, Image.Resampling.HAMMING: 1.0,
            Image.Resampling.BICUBIC: 2.0, Image.Resampling.LANCZOS: 3.0}
VERTICAL_FIRST_SINCE = 13  # the Pillow major version that picks the pass order
PILLOW_MAJOR = int(PIL.__version__.split(".")[0])
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
# (width, height) -> (width, height) resizes that `library` checks, each with every filter: both
# pass orders, one axis alone, shrinking and growing, an output of one pixel
CHECKS = (((64, 48), (70, 40)), ((48, 64), (40, 70)), ((50, 37), (19, 23)), ((33, 17), (33, 40)),
          ((29, 31), (61, 31)), ((12, 9), (1, 1)))


def resize_rgb(image: Image.Image, size: tuple[int, int], resample: int) -> np.ndarray:
    """`np.array(image.resize(size, resample))` of an RGB image, [H, W, 3] uint8 (a new array): by
    our loops where they can (a convolution filter, the library built and checked), else by Pillow."""
    library_ = library()
    ours = None
    if library_ is not None and image.mode == "RGB" and resample in SUPPORTS and min(size) >= 1:
        ours = _resize(library_, image, size, resample)
    return np.array(image.resize(size, resample)) if ours is None else ours


def horizontal_first(width: int, height: int, out_width: int, out_height: int) -> bool:
    """Whether Pillow resizes along the width first (its `ImagingResampleInner`)."""
    if PILLOW_MAJOR < VERTICAL_FIRST_SINCE:
        return True
    return not (height - out_height > 0 and height - out_height > (width - out_width) * 2)


@functools.lru_cache(maxsize=256)
def pass_weights(n_in: int, n_out: int, resample: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Pillow's weights for resizing n_in pixels to n_out along one axis: (first [n_out] int32, the
    first input pixel of each output; weights [n_out, taps] int32, over pixels first .. first +
    taps - 1, all inside the input), or None where the probe does not read as expected."""
    scale = n_in / n_out
    support = SUPPORTS[Image.Resampling(resample)] * max(scale, 1.0)
    ksize = math.ceil(support) * 2 + 1  # Pillow's most weights an output has
    centers = (np.arange(n_out) + 0.5) * scale
    lo = np.maximum(np.trunc(centers - support + 0.5), 0).astype(np.int64)  # Pillow's window [lo, hi)
    hi = np.minimum(np.trunc(centers + support + 0.5), n_in).astype(np.int64)
    probe = np.zeros((ksize, n_in), np.int32)  # row j: ONE at every pixel x with x % ksize == j
    x = np.arange(n_in)
    probe[x % ksize, x] = ONE
    got = np.asarray(Image.fromarray(probe).resize((n_out, ksize), Image.Resampling(resample)), np.int64)
    taps = min(ksize, n_in)
    first = np.minimum(lo, n_in - taps)
    pixel = first[:, None] + np.arange(taps)  # [n_out, taps]
    inside = (pixel >= lo[:, None]) & (pixel < hi[:, None])
    outputs = np.broadcast_to(np.arange(n_out)[:, None], pixel.shape)
    weights = np.where(inside, got[pixel % ksize, outputs], 0)
    read = np.zeros_like(got, dtype=bool)  # each window holds one probe pixel per row it reads
    read[(pixel % ksize)[inside], outputs[inside]] = True
    if got[~read].any() or (hi - lo > ksize).any():
        return None
    return first.astype(np.int32), weights.astype(np.int32)


def _resize(library_: ctypes.CDLL, image: Image.Image, size: tuple[int, int], resample: int) -> np.ndarray | None:
    """[H, W, 3] uint8 (a new array): both passes, in Pillow's order; None where a pass's weights
    are not had."""
    if size == image.size:
        return np.array(image)
    pixels: np.ndarray | None = np.asarray(image)
    passes = (_horizontal, _vertical)
    for one_pass in passes if horizontal_first(image.width, image.height, *size) else passes[::-1]:
        pixels = one_pass(library_, pixels, size, resample) if pixels is not None else None
    return pixels


def _horizontal(library_: ctypes.CDLL, pixels: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray | None:
    """[H, W, 3] -> [H, size[0], 3]: the combination of the transposed image's rows."""
    height, in_width = pixels.shape[:2]
    width = size[0]
    if width == in_width:
        return pixels
    columns = np.empty((in_width, height, 4), np.uint8)
    library_.mmserve_transpose(pixels.ctypes.data, height, in_width, 3, 4, columns.ctypes.data)
    out_columns = _combine(library_, columns.reshape(in_width, -1), width, resample)
    if out_columns is None:
        return None
    out = np.empty((height, width, 3), np.uint8)
    library_.mmserve_transpose(out_columns.ctypes.data, width, height, 4, 3, out.ctypes.data)
    return out


def _vertical(library_: ctypes.CDLL, pixels: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray | None:
    """[H, W, 3] -> [size[1], W, 3]."""
    height = size[1]
    if height == pixels.shape[0]:
        return pixels
    rows = _combine(library_, np.ascontiguousarray(pixels).reshape(pixels.shape[0], -1), height, resample)
    return None if rows is None else rows.reshape(height, pixels.shape[1], 3)


def _combine(library_: ctypes.CDLL, rows: np.ndarray, n_out: int, resample: int) -> np.ndarray | None:
    """[n_in, X] uint8 -> [n_out, X]: each output row Pillow's weighted sum of input rows."""
    weights = pass_weights(rows.shape[0], n_out, resample)
    if weights is None:
        return None
    first, w = weights
    out = np.empty((n_out, rows.shape[1]), np.uint8)
    library_.mmserve_combine(rows.ctypes.data, rows.strides[0], rows.shape[1], first.ctypes.data,
                             w.ctypes.data, w.shape[1], n_out, out.ctypes.data)
    return out


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, once it has resized the `CHECKS` as Pillow does; else None (logged)."""
    library_ = native.build(SOURCE)
    if library_ is None:
        return None
    library_.mmserve_transpose.argtypes = [_P, _I64, _I64, _I64, _I64, _P]
    library_.mmserve_transpose.restype = ctypes.c_int
    library_.mmserve_combine.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I64, _P]
    library_.mmserve_combine.restype = None
    rng = np.random.default_rng(0)
    for (size, out), resample in ((c, r) for c in CHECKS for r in SUPPORTS):
        image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
        ours = _resize(library_, image, out, resample)
        if ours is None or not np.array_equal(np.asarray(image.resize(out, resample)), ours):
            logger.warning("our resize differs from Pillow %s's (%s -> %s, %s); Pillow resizes every image",
                           PIL.__version__, size, out, Image.Resampling(resample).name)
            return None
    return library_

