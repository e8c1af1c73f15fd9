"""A PNG's pixels by zlib-ng and our row filters (`csrc/png.c`), for the PNGs that are ours: `decode_png`.

Screenshots, what an agent sends at every step, are PNGs, and a new one is decoded before anything
else can happen to it. Pillow's decoder inflates a row at a time, where zlib-ng's fast paths do not
run, and undoes the filters a byte at a time; here the image data is inflated in one call by
zlib-ng and unfiltered a pixel at a time. Without zlib-ng (or a C compiler) Pillow decodes every PNG:
the stdlib's zlib alone would gain nothing.

Ours is the common case alone: 8-bit RGB or RGBA, not interlaced, one image (no animation chunk),
no transparency chunk, no chunk outside `KNOWN`, each chunk's CRC right, one IHDR, the IDAT chunks
consecutive (Pillow stops reading the image data at the first other chunk), IEND last, and the
image data inflating to exactly its rows, each with one of the five filter types. Anything else returns
None, and Pillow decodes the bytes as before (with its own errors). The pixels of a PNG are defined
exactly by its data, so where both decode they give the same image (the tests compare with Pillow
over every filter type).
"""

from __future__ import annotations

import ctypes
import functools
import struct
from pathlib import Path
from types import ModuleType

import numpy as np
from PIL import Image

from mmserve import native

SOURCE = Path(__file__).with_name("csrc") / "png.c"
SIGNATURE = b"\x89PNG\r\n\x1a\n"
MODES = {2: ("RGB", 3), 6: ("RGBA", 4)}  # color type -> (Pillow's mode, bytes per pixel) at 8 bits
# chunks that leave the pixels as the image data makes them (Pillow keeps them as info, if at all)
KNOWN = {b"IHDR", b"IDAT", b"IEND", b"gAMA", b"cHRM", b"sRGB", b"iCCP", b"pHYs", b"tEXt", b"zTXt", b"iTXt",
         b"tIME", b"bKGD", b"sBIT", b"eXIf"}
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def decode_png(data: bytes) -> Image.Image | None:
    """The PNG's image (mode RGB or RGBA) where it is ours to decode, else None."""
    library_, zlib = library(), zlib_ng()
    if library_ is None or zlib is None or not data.startswith(SIGNATURE):
        return None
    chunks = _chunks(zlib, data)
    if not chunks or chunks[0][0] != b"IHDR" or chunks[-1][0] != b"IEND" or len(chunks[0][1]) != 13:
        return None
    width, height, depth, color, compression, method, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    if depth != 8 or color not in MODES or compression or method or interlace or not width or not height:
        return None
    names = [name for name, _ in chunks]
    data_at = [i for i, name in enumerate(names) if name == b"IDAT"]
    if any(name not in KNOWN for name in names) or b"IHDR" in names[1:] or not data_at \
            or data_at[-1] - data_at[0] + 1 != len(data_at):  # the image data in one run, as Pillow reads it
        return None
    mode, bpp = MODES[color]
    row_bytes = width * bpp
    raw = _inflate(zlib, b"".join(body for name, body in chunks if name == b"IDAT"), height * (row_bytes + 1))
    if raw is None:
        return None
    pixels = np.empty((height, row_bytes), np.uint8)
    if library_.mmserve_png_unfilter(raw, height, row_bytes, bpp, pixels.ctypes.data):
        return None
    return Image.frombuffer(mode, (width, height), pixels, "raw", mode, 0, 1)


def _chunks(zlib: ModuleType, data: bytes) -> list[tuple[bytes, bytes]] | None:
    """(name, body) of each chunk, up to IEND; None where a chunk is cut short, its CRC is wrong,
    or bytes follow IEND."""
    chunks, at = [], len(SIGNATURE)
    view = memoryview(data)
    while at + 12 <= len(data):
        length, name = struct.unpack_from(">I4s", data, at)
        end = at + 8 + length
        if end + 4 > len(data) or zlib.crc32(view[at + 4:end]) != struct.unpack_from(">I", data, end)[0]:
            return None
        chunks.append((name, bytes(view[at + 8:end])))
        at = end + 4
        if name == b"IEND":
            return chunks if at == len(data) else None
    return None


def _inflate(zlib: ModuleType, stream: bytes, size: int) -> bytes | None:
    """The zlib stream's `size` bytes, or None where it holds more or fewer, or is broken."""
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(stream, size + 1)
        if len(out) == size and not inflater.eof:  # the output was complete; the end marker may follow
            out += inflater.decompress(inflater.unconsumed_tail, 1)
    except zlib.error:
        return None
    return out if len(out) == size and inflater.eof and not inflater.unused_data else None


@functools.cache
def zlib_ng() -> ModuleType | None:
    """zlib-ng's zlib module (the stdlib's interface), or None where it is not installed."""
    try:
        from zlib_ng import zlib_ng as module
    except ImportError:
        return None
    return module


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None (no C compiler, `MMSERVE_CPU_KERNELS=0`): Pillow decodes."""
    library_ = native.build(SOURCE)
    if library_ is not None:
        library_.mmserve_png_unfilter.argtypes = [ctypes.c_char_p, _I64, _I64, _I64, _P]
        library_.mmserve_png_unfilter.restype = ctypes.c_int
    return library_
