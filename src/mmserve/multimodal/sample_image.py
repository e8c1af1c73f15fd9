"""A deterministic sample picture, so the demo needs no file and no download."""

from __future__ import annotations

from PIL import Image, ImageDraw


def sample_image(size: int = 336, variant: int = 0) -> Image.Image:
    """A gradient with a few shapes; `variant` moves and recolours them."""
    img = Image.new("RGB", (size, size))
    px = img.load()
    assert px is not None
    for y in range(size):
        for x in range(size):
            px[x, y] = ((x * 255) // size, (y * 255) // size, (variant * 53) % 256)
    draw = ImageDraw.Draw(img)
    s = size // 8
    shift = (variant * 37) % (size // 2)
    draw.ellipse((s + shift, s, 4 * s + shift, 4 * s), fill=(255, 200 - variant % 200, 0))
    draw.rectangle((4 * s, 5 * s - shift // 2, 7 * s, 7 * s), fill=(20, 60 + variant % 190, 220))
    draw.polygon([(s, 7 * s), (3 * s, 5 * s), (5 * s - shift // 3, 7 * s)], fill=(240, 240, 240))
    return img
