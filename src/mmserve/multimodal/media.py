"""Loading images from the places a request may name: PIL objects, data URLs, files, http(s).

Every refusal is a `MediaError` whose message says what was wrong, which limit was hit and
which server flag changes it. Sizes are checked before a full decode: the encoded byte count
first, then the pixel count read from the image header, so a small file that claims a huge
canvas (a decompression bomb) is refused without allocating it.
"""

from __future__ import annotations

import binascii
import io
import os
import stat
import urllib.parse
import warnings
from dataclasses import dataclass
from typing import Any

import pybase64
from PIL import Image, UnidentifiedImageError

from mmserve.errors import ClientError
from mmserve.multimodal.png import decode_png

# Flag names quoted in error messages; keep in step with the CLI flags made from the config.
FLAG_MAX_BYTES = "--max-media-bytes"
FLAG_MAX_PIXELS = "--max-media-pixels"
FLAG_LOCAL_PATH = "--allowed-local-media-path"
FLAG_DOMAINS = "--allowed-media-domains"

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_WHITE = (255, 255, 255)


class MediaError(ClientError):
    """A media item was refused or could not be read; the message is meant for the client."""

    code = "invalid_media"


@dataclass(frozen=True)
class MediaLimits:
    """What media a request may load, and how large it may be.

    `max_bytes` bounds the encoded size (after base64 decoding), `max_pixels` the decoded
    width * height. `allowed_local_media_path` is the only directory local files may come from
    (None refuses all local files); `allowed_media_domains` lists the exact host names http(s)
    URLs may name (empty refuses all), and `allow_private_addresses` lets those names resolve to
    loopback, link-local or private addresses. `fetch_timeout_s` bounds a whole http(s) fetch
    (see multimodal/http_fetch.py).
    """

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0
    allow_private_addresses: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive integer; got {self.max_bytes!r}")
        if not isinstance(self.max_pixels, int) or self.max_pixels < 1:
            raise ValueError(f"max_pixels must be a positive integer; got {self.max_pixels!r}")
        if self.fetch_timeout_s <= 0:
            raise ValueError(f"fetch_timeout_s must be positive; got {self.fetch_timeout_s!r}")
        domains = tuple(d.strip().lower() for d in self.allowed_media_domains if d.strip())
        object.__setattr__(self, "allowed_media_domains", domains)

    @property
    def local_root(self) -> str | None:
        """The allowed local directory with symlinks and `..` resolved, or None."""
        if self.allowed_local_media_path is None:
            return None
        return os.path.realpath(self.allowed_local_media_path)


def read_image_source(source: object, limits: MediaLimits) -> bytes | Image.Image:
    """What identifies an image's content, before decoding: the encoded bytes of a URL or
    path (read and size-checked), or a PIL image as given (pixel count checked).

    Raises `MediaError` for anything refused or unreadable.
    """
    if isinstance(source, Image.Image):
        check_pixels(source.width, source.height, limits)
        return source
    if not isinstance(source, str):
        raise MediaError(f"an image must be a PIL image or a URL/path string; got {type(source).__name__}")
    return read_media_bytes(source, limits)


def load_image(source: object, limits: MediaLimits) -> Image.Image:
    """Load one image as RGB from a PIL image, a data/file/http(s) URL or a local path.

    Raises `MediaError` for anything refused or unreadable.
    """
    raw = read_image_source(source, limits)
    return to_rgb(raw) if isinstance(raw, Image.Image) else decode_image(raw, limits)


def read_media_bytes(url: str, limits: MediaLimits, kind: str = "image") -> bytes:
    """Return the encoded bytes a data URL, file URL, local path or http(s) URL names; a data
    URL's media type must be `kind`/<type> ("image" or "video")."""
    if url[:5].lower() == "data:":  # schemes are case-insensitive (RFC 3986)
        return _read_data_url(url, limits, kind)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "":
        return _read_local_file(url, limits)
    if scheme == "file":
        return _read_local_file(_file_url_path(url), limits)
    if scheme in ("http", "https"):
        from mmserve.multimodal.http_fetch import fetch_http  # imports this module

        return fetch_http(url, limits)
    raise MediaError(f"unsupported image URL scheme {scheme!r}: use data:, file:// or http(s)://")


def check_image(image: Any) -> None:
    """ValueError unless `image` is a PIL image."""
    if not isinstance(image, Image.Image):
        kind = type(image)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        raise ClientError(f"an image must be a PIL.Image.Image, got {name}")

def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """Decode encoded image bytes (PNG, JPEG, WebP, GIF first frame) to an RGB image."""
    check_bytes(len(data), limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
            check_pixels(image.width, image.height, limits)
            ours = decode_png(data) if image.format == "PNG" else None  # None: not ours, Pillow decodes
            if ours is None:
                image.load()
            return to_rgb(image if ours is None else ours)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaError(f"image refused as a possible decompression bomb: {exc} The server's limit is "
                         f"{limits.max_pixels} pixels ({FLAG_MAX_PIXELS})") from exc
    except UnidentifiedImageError as exc:
        raise MediaError("the data is not a supported image (PNG, JPEG, WebP or GIF)") from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        if isinstance(exc, MediaError):
            raise
        raise MediaError(f"the image is truncated or corrupt: {exc}") from exc


def header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from encoded image bytes' header, no pixel decoded; None when unreadable
    (`decode_image` then says what is wrong)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS) as image:
                return image.size
    except Exception:  # any unreadable header: the decoder reports it
        return None


def check_bytes(n_bytes: int, limits: MediaLimits) -> None:
    """Refuse an encoded item larger than `limits.max_bytes`."""
    if n_bytes > limits.max_bytes:
        raise MediaError(f"image is {n_bytes} bytes, over the limit of {limits.max_bytes} bytes "
                         f"(raise it with {FLAG_MAX_BYTES})")


def check_pixels(width: int, height: int, limits: MediaLimits) -> None:
    """Refuse an image whose width * height exceeds `limits.max_pixels`."""
    if width * height > limits.max_pixels:
        raise MediaError(f"image is {width}x{height} = {width * height} pixels, over the limit of "
                         f"{limits.max_pixels} pixels (raise it with {FLAG_MAX_PIXELS})")


def to_rgb(image: Image.Image) -> Image.Image:
    """Return `image` in RGB mode as transformers' `convert_to_rgb` does: transparency (an alpha
    band, or `info["transparency"]`) is alpha-composited onto white. The one conversion every
    image goes through; what it reads (mode, size, palette, `info["transparency"]`, pixels) is
    what the item hash covers (multimodal/hasher.py)."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*_WHITE, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _read_data_url(url: str, limits: MediaLimits, kind: str = "image") -> bytes:
    """The bytes of `data:<kind>/<type>;base64,<payload>`. On the warm path (a repeated image is
    hashed from these bytes and decoded no further), so no copy of the multi-MB URL is made but
    the payload's, and the payload is decoded with pybase64 (SIMD; ~40x stdlib)."""
    comma = url.find(",", 0, 256)  # the header is short; never scan the payload for it
    media_type, _, encoding = url[len("data:"):max(comma, 0)].partition(";")
    if comma < 0 or not media_type.lower().startswith(f"{kind}/") or encoding.lower() != "base64":
        raise MediaError(f"a data URL must look like data:{kind}/<type>;base64,<data>")
    payload = url[comma + 1:]
    check_bytes(len(payload) * 3 // 4 - 2, limits)  # a lower bound, checked before decoding
    try:
        data = pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"the data URL's base64 payload is invalid: {exc}") from exc
    check_bytes(len(data), limits)
    return data


def _file_url_path(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"a file URL must name a local path (file:///...); got host {parts.netloc!r}")
    return urllib.parse.unquote(parts.path)


def _read_local_file(path: str, limits: MediaLimits) -> bytes:
    root = limits.local_root
    if root is None:
        raise MediaError(f"loading local image files is disabled; allow a directory with {FLAG_LOCAL_PATH}")
    if "\0" in path:
        raise MediaError("an image path must not contain a NUL character")
    real = os.path.realpath(path)
    if os.path.commonpath([real, root]) != root:
        raise MediaError(f"image path {path!r} is outside the allowed directory {root!r} ({FLAG_LOCAL_PATH})")
    missing = MediaError(f"image file {path!r} does not exist or is not a regular file")
    try:
        fd = _open_beneath(root, real)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise missing
        with os.fdopen(fd, "rb") as file:
            check_bytes(info.st_size, limits)
            data = file.read(limits.max_bytes + 1)
    except FileNotFoundError as exc:
        raise missing from exc
    except OSError as exc:
        raise MediaError(f"could not read image file {path!r}: {exc.strerror}") from exc
    check_bytes(len(data), limits)
    return data


def _open_beneath(root: str, real: str) -> int:
    """A read-only fd of `real` (a path under `root`, both resolved), opened one component at a
    time from `root` with O_NOFOLLOW: a component swapped for a symlink after the check is
    refused (ELOOP / ENOTDIR), never followed; O_NONBLOCK keeps a swapped-in FIFO from blocking."""
    rel = os.path.relpath(real, root)
    parts = [] if rel == os.curdir else rel.split(os.sep)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            parent, fd = fd, os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(parent)
        return os.open(parts[-1] if parts else os.curdir, flags | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
