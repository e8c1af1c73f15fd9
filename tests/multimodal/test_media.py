"""Tests for loading images: every accepted source and every refusal."""

from __future__ import annotations

import base64
import io
import os
import struct
import urllib.request
import zlib
from pathlib import Path

import pytest
from PIL import Image

from mmserve.multimodal.http_fetch import RedirectGuard, check_http_url
from mmserve.multimodal.media import MediaError, MediaLimits, decode_image, load_image


def encode(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims `width` x `height` (the pixel data is a few bytes)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


@pytest.fixture
def red() -> Image.Image:
    return Image.new("RGB", (8, 6), (255, 0, 0))


@pytest.fixture
def media_dir(tmp_path: Path, red: Image.Image) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "red.png").write_bytes(encode(red, "PNG"))
    (tmp_path / "secret.png").write_bytes(encode(red, "PNG"))
    return root


# --- accepted sources ---------------------------------------------------------------------


def test_pil_image_is_returned_as_rgb(red: Image.Image) -> None:
    assert load_image(red, MediaLimits()) is red
    gray = load_image(Image.new("L", (4, 4), 7), MediaLimits())
    assert gray.mode == "RGB" and gray.getpixel((0, 0)) == (7, 7, 7)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_data_url_formats(red: Image.Image, fmt: str) -> None:
    image = load_image(data_url(encode(red, fmt), f"image/{fmt.lower()}"), MediaLimits())
    assert image.mode == "RGB" and image.size == (8, 6)
    r, g, b = image.getpixel((3, 3))
    assert r > 200 and g < 60 and b < 60


def test_gif_first_frame() -> None:
    frames = [Image.new("RGB", (4, 4), color) for color in [(255, 0, 0), (0, 0, 255)]]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=10)
    image = load_image(data_url(buffer.getvalue(), "image/gif"), MediaLimits())
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P", "CMYK"])
def test_modes_become_rgb(mode: str) -> None:
    source = Image.new("RGB", (4, 4), (10, 200, 30)).convert(mode)
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    assert load_image(data_url(encode(source, fmt)), MediaLimits()).mode == "RGB"


def test_transparent_pixels_become_white() -> None:
    rgba = Image.new("RGBA", (2, 2), (0, 0, 0, 0))
    assert load_image(data_url(encode(rgba, "PNG")), MediaLimits()).getpixel((0, 0)) == (255, 255, 255)
    palette = Image.new("P", (2, 2), 0)
    palette.info["transparency"] = 0
    assert load_image(palette, MediaLimits()).getpixel((1, 1)) == (255, 255, 255)


def test_local_path_and_file_url(media_dir: Path) -> None:
    limits = MediaLimits(allowed_local_media_path=str(media_dir))
    assert load_image(str(media_dir / "red.png"), limits).size == (8, 6)
    assert load_image((media_dir / "red.png").as_uri(), limits).size == (8, 6)
    assert load_image(f"file://localhost{media_dir}/red.png", limits).size == (8, 6)


def test_symlink_inside_allowed_dir_is_fine(media_dir: Path) -> None:
    os.symlink(media_dir / "red.png", media_dir / "link.png")
    assert load_image(str(media_dir / "link.png"), MediaLimits(allowed_local_media_path=str(media_dir)))


# --- refusals -------------------------------------------------------------------------------


def refused(source: object, limits: MediaLimits, *words: str) -> str:
    with pytest.raises(MediaError) as info:
        load_image(source, limits)
    message = str(info.value)
    for word in words:
        assert word in message, message
    return message


def test_not_an_image_object() -> None:
    refused(b"\x89PNG", MediaLimits(), "bytes")
    refused(42, MediaLimits(), "PIL image")


@pytest.mark.parametrize("payload", ["not base64!", "aGVsbG8", "aGVs\nbG8="])
def test_bad_base64(payload: str) -> None:
    refused(f"data:image/png;base64,{payload}", MediaLimits(), "base64")


@pytest.mark.parametrize("url", ["data:text/plain;base64,aGk=", "data:image/png,rawdata", "data:image/png;base64"])
def test_malformed_data_url(url: str) -> None:
    refused(url, MediaLimits(), "data:image/<type>;base64")


def test_garbage_and_truncated_bytes(red: Image.Image) -> None:
    refused(data_url(b"hello, not an image"), MediaLimits(), "not a supported image")
    big = Image.effect_noise((64, 64), 50).convert("RGB")
    png = encode(big, "PNG")
    refused(data_url(png[: len(png) // 2]), MediaLimits(), "truncated or corrupt")
    refused(data_url(encode(red, "BMP")), MediaLimits(), "not a supported image")


def test_too_many_bytes(red: Image.Image, media_dir: Path) -> None:
    png = encode(red, "PNG")
    small = MediaLimits(max_bytes=len(png) - 1, allowed_local_media_path=str(media_dir))
    refused(data_url(png), small, "bytes", "--max-media-bytes")
    refused(data_url(png * 10), small, "--max-media-bytes")
    refused(str(media_dir / "red.png"), small, "--max-media-bytes")
    with pytest.raises(MediaError, match="--max-media-bytes"):
        decode_image(png, small)


def test_decompression_bomb_from_header() -> None:
    bomb = png_claiming(100_000, 100_000)
    assert len(bomb) < 200
    refused(data_url(bomb), MediaLimits(), "--max-media-pixels")
    refused(data_url(png_claiming(5000, 5000)), MediaLimits(max_pixels=1_000_000), "25000000 pixels",
            "--max-media-pixels")


def test_pil_image_over_pixel_limit() -> None:
    refused(Image.new("RGB", (100, 100)), MediaLimits(max_pixels=9999), "--max-media-pixels")


def test_local_files_disabled_by_default(media_dir: Path) -> None:
    refused(str(media_dir / "red.png"), MediaLimits(), "--allowed-local-media-path")
    refused((media_dir / "red.png").as_uri(), MediaLimits(), "--allowed-local-media-path")


def test_path_outside_allowed_dir(media_dir: Path) -> None:
    limits = MediaLimits(allowed_local_media_path=str(media_dir))
    refused(str(media_dir.parent / "secret.png"), limits, "outside the allowed directory")
    refused(str(media_dir / ".." / "secret.png"), limits, "outside")
    refused(f"file://{media_dir}/../secret.png", limits, "outside")
    refused(str(media_dir) + "-sibling/x.png", limits, "outside")


def test_symlink_escape(media_dir: Path) -> None:
    os.symlink(media_dir.parent / "secret.png", media_dir / "escape.png")
    refused(str(media_dir / "escape.png"), MediaLimits(allowed_local_media_path=str(media_dir)), "outside")


def test_missing_file_and_directory(media_dir: Path) -> None:
    limits = MediaLimits(allowed_local_media_path=str(media_dir))
    refused(str(media_dir / "nope.png"), limits, "does not exist")
    refused(str(media_dir), limits, "not a regular file")
    refused("file://example.com/red.png", limits, "local path")


def test_http_refused_without_allowed_domain() -> None:
    refused("https://example.com/cat.png", MediaLimits(), "disabled", "--allowed-media-domains")
    limits = MediaLimits(allowed_media_domains=("images.example.org",))
    refused("http://example.com/cat.png", limits, "'example.com' is not allowed", "--allowed-media-domains")
    refused("http://images.example.org.evil.com/cat.png", limits, "not allowed")


def test_http_url_check_for_allowed_host() -> None:
    check_http_url("https://Images.Example.org/cat.png", MediaLimits(allowed_media_domains=(" IMAGES.example.org",)))


def test_redirect_to_other_host_is_refused() -> None:
    limits = MediaLimits(allowed_media_domains=("a.example",))
    guard = RedirectGuard(limits)
    request = urllib.request.Request("https://a.example/cat.png")
    follow = guard.redirect_request(request, None, 302, "Found", {}, "https://a.example/other.png")
    assert follow is not None and follow.full_url == "https://a.example/other.png"
    with pytest.raises(MediaError, match="not allowed"):
        guard.redirect_request(request, None, 302, "Found", {}, "https://b.example/cat.png")
    with pytest.raises(MediaError, match="scheme"):
        guard.redirect_request(request, None, 302, "Found", {}, "file:///etc/passwd")


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "gopher://x/y", "javascript:alert(1)"])
def test_unsupported_scheme(url: str) -> None:
    refused(url, MediaLimits(), "unsupported image URL scheme")


def test_limits_validation() -> None:
    with pytest.raises(ValueError):
        MediaLimits(max_bytes=0)
    with pytest.raises(ValueError):
        MediaLimits(max_pixels=-1)
    assert issubclass(MediaError, ValueError)


def test_an_upper_case_data_scheme_is_read(red: Image.Image) -> None:
    """Regression: `DATA:` was refused though URL schemes are case-insensitive."""
    url = data_url(encode(red, "PNG"), "image/png")
    assert load_image("DATA:" + url[len("data:"):], MediaLimits()).size == (8, 6)


def test_a_file_swapped_for_a_symlink_is_not_followed(tmp_path, red: Image.Image) -> None:
    """The check and the open are two steps: the open refuses a symlink (O_NOFOLLOW)."""
    import os

    from mmserve.multimodal import media

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    red.save(allowed / "a.png")
    secret = tmp_path / "secret.png"
    red.save(secret)
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    real_realpath = os.path.realpath

    def swap_after_check(path):  # the attacker swaps the file between the check and the open
        resolved = real_realpath(path)
        if resolved.endswith("a.png") and not os.path.islink(resolved):
            os.remove(resolved)
            os.symlink(secret, resolved)
        return resolved

    media.os.path.realpath = swap_after_check
    try:
        refused(str(allowed / "a.png"), limits, "could not read")
    finally:
        media.os.path.realpath = real_realpath
