"""Loading images from the places a request may name: PIL objects, data URLs, files, http(s).

Every refusal is a `MediaError` whose message says what was wrong, which limit was hit and
which server flag changes it. Sizes are checked before a full decode: the encoded byte count
first, then the pixel count read from the image header, so a small file that claims a huge
canvas (a decompression bomb) is refused without allocating it.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from typing import Any

from PIL import Image, UnidentifiedImageError

# Flag names quoted in error messages; keep in step with the CLI flags made from the config.
FLAG_MAX_BYTES = "--max-media-bytes"
FLAG_MAX_PIXELS = "--max-media-pixels"
FLAG_LOCAL_PATH = "--allowed-local-media-path"
FLAG_DOMAINS = "--allowed-media-domains"

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_WHITE = (255, 255, 255)


class MediaError(ValueError):
    """A media item was refused or could not be read; the message is meant for the client."""


@dataclass(frozen=True)
class MediaLimits:
    """What media a request may load, and how large it may be.

    `max_bytes` bounds the encoded size (after base64 decoding), `max_pixels` the decoded
    width * height. `allowed_local_media_path` is the only directory local files may come from
    (None refuses all local files); `allowed_media_domains` lists the exact host names http(s)
    URLs may name (empty refuses all). `fetch_timeout_s` bounds each http(s) connect and read.
    """

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0

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


def read_media_bytes(url: str, limits: MediaLimits) -> bytes:
    """Return the encoded bytes a data URL, file URL, local path or http(s) URL names."""
    if url[:5].lower() == "data:":  # schemes are case-insensitive (RFC 3986)
        return _read_data_url(url, limits)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "":
        return _read_local_file(url, limits)
    if scheme == "file":
        return _read_local_file(_file_url_path(url), limits)
    if scheme in ("http", "https"):
        return _fetch_http(url, limits)
    raise MediaError(f"unsupported image URL scheme {scheme!r}: use data:, file:// or http(s)://")


def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """Decode encoded image bytes (PNG, JPEG, WebP, GIF first frame) to an RGB image."""
    check_bytes(len(data), limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
            check_pixels(image.width, image.height, limits)
            image.load()
            return to_rgb(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaError(f"image refused as a possible decompression bomb: {exc} The server's limit is "
                         f"{limits.max_pixels} pixels ({FLAG_MAX_PIXELS})") from exc
    except UnidentifiedImageError as exc:
        raise MediaError("the data is not a supported image (PNG, JPEG, WebP or GIF)") from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        if isinstance(exc, MediaError):
            raise
        raise MediaError(f"the image is truncated or corrupt: {exc}") from exc


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


def check_http_url(url: str, limits: MediaLimits) -> None:
    """Refuse an http(s) URL whose host is not in `limits.allowed_media_domains`."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise MediaError(f"unsupported image URL scheme {parts.scheme!r} in {url!r}: only http(s) may be fetched")
    host = (parts.hostname or "").lower()
    if not limits.allowed_media_domains:
        raise MediaError(f"fetching images over http(s) is disabled; allow host {host!r} with {FLAG_DOMAINS}")
    if host not in limits.allowed_media_domains:
        raise MediaError(f"image host {host!r} is not allowed; allowed hosts: "
                         f"{', '.join(limits.allowed_media_domains)} (set with {FLAG_DOMAINS})")


class RedirectGuard(urllib.request.HTTPRedirectHandler):
    """Follows an http(s) redirect only when its target passes `check_http_url`."""

    def __init__(self, limits: MediaLimits) -> None:
        super().__init__()
        self.limits = limits

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        check_http_url(urllib.parse.urljoin(req.full_url, newurl), self.limits)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _read_data_url(url: str, limits: MediaLimits) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    media_type, _, encoding = header.partition(";")
    if not sep or not media_type.lower().startswith("image/") or encoding.lower() != "base64":
        raise MediaError("a data URL must look like data:image/<type>;base64,<data>")
    check_bytes(len(payload) * 3 // 4 - 2, limits)  # a lower bound, checked before decoding
    try:
        data = base64.b64decode(payload, validate=True)
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
    if not os.path.isfile(real):
        raise MediaError(f"image file {path!r} does not exist or is not a regular file")
    try:  # O_NOFOLLOW: a file swapped for a symlink after the check above is refused, not followed
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as file:
            check_bytes(os.fstat(file.fileno()).st_size, limits)
            data = file.read(limits.max_bytes + 1)
    except OSError as exc:
        raise MediaError(f"could not read image file {path!r}: {exc.strerror}") from exc
    check_bytes(len(data), limits)
    return data


def _read_until(response: Any, max_bytes: int, deadline: float, url: str) -> bytes:
    """Read up to `max_bytes` in pieces, refusing once the fetch's total deadline has passed (a
    server trickling bytes under the per-call timeout cannot hold a worker longer)."""
    parts, total = [], 0
    while total < max_bytes:
        if time.monotonic() > deadline:
            raise MediaError(f"fetching image {url!r} took longer than its deadline")
        piece = response.read(min(1 << 16, max_bytes - total))
        if not piece:
            break
        parts.append(piece)
        total += len(piece)
    return b"".join(parts)


def _fetch_http(url: str, limits: MediaLimits) -> bytes:
    check_http_url(url, limits)
    opener = urllib.request.build_opener(RedirectGuard(limits))
    deadline = time.monotonic() + limits.fetch_timeout_s  # for the whole fetch, not per socket call
    try:
        with opener.open(url, timeout=limits.fetch_timeout_s) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit():
                check_bytes(int(length), limits)
            data = _read_until(response, limits.max_bytes + 1, deadline, url)
    except urllib.error.HTTPError as exc:
        raise MediaError(f"fetching image {url!r} failed with HTTP status {exc.code}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise MediaError(f"could not fetch image {url!r}: {exc}") from exc
    check_bytes(len(data), limits)
    return data
