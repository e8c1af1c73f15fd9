"""The requests a benchmark sends: `BenchRequest`, and the seeded synthetic `random-mm` dataset.

`random-mm` makes `num_prompts` chat requests, each with `images_per_prompt` synthetic images
(random colour blocks plus noise, PNG data URLs) and a text of `input_len` random words. Exactly
`repeat_count(num_prompts, image_repeat_rate)` prompts re-use the images of an earlier prompt;
the others get images never seen before. The same arguments always give the same requests,
byte for byte, so a server's caches see identical items when a workload is replayed.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from PIL import Image

# Common words of the built-in model's tokenizer corpus: about one token each there.
WORDS = (
    "the a photo of red car on street next to small green door two cats are sleeping blue sofa while "
    "dog watches them from kitchen floor image shows busy market where people buy fruit bread fish "
    "fresh what is in this picture describe detail and count objects you can see there white boat "
    "lake mountains behind it covered with snow young woman reading book under large tree park sunny "
    "man yellow jacket riding bicycle across bridge over river chart monthly sales numbers rise"
).split()


@dataclass(frozen=True)
class BenchRequest:
    """One chat request: OpenAI `messages`, the output length asked for, and its images' keys.

    `image_keys` name the request's images (equal keys, equal bytes): a request whose keys all
    appeared in earlier requests is a repeat.
    """

    messages: list[dict[str, Any]]
    output_len: int
    image_keys: tuple[str, ...] = field(default=())


def parse_image_size(text: str) -> tuple[int, int]:
    """`"336"` -> (336, 336); `"640x480"` -> (640, 480) (width x height)."""
    parts = text.lower().split("x")
    try:
        width, height = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        raise ValueError(f"image size must be N or WxH; got {text!r}") from None
    if len(parts) > 2 or width < 1 or height < 1:
        raise ValueError(f"image size must be N or WxH with positive numbers; got {text!r}")
    return width, height


def synthetic_image(seed: int | Sequence[int], size: tuple[int, int]) -> Image.Image:
    """A deterministic RGB image of `size` (width, height): 8x8 colour blocks plus noise."""
    rng = np.random.default_rng(seed)
    width, height = size
    blocks = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    base = np.asarray(blocks.resize((width, height), Image.Resampling.NEAREST), dtype=np.int16)
    noise = rng.integers(-16, 17, (height, width, 3), dtype=np.int16)
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def image_data_url(data: bytes, mime: str = "image/png") -> str:
    """`data:<mime>;base64,...` for encoded image bytes."""
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def chat_messages(image_urls: list[str], text: str) -> list[dict[str, Any]]:
    """One user message: the images first, then the text (llava's order)."""
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def random_words(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


def repeat_count(num_prompts: int, rate: float) -> int:
    """How many of `num_prompts` prompts re-use earlier images: round(rate * n), at most n - 1.

    The first prompt cannot repeat anything, so a rate of 1.0 means every prompt but the first.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"image repeat rate must be in [0, 1]; got {rate}")
    return min(round(rate * num_prompts), max(num_prompts - 1, 0))


def repeat_rate(requests: list[BenchRequest]) -> float:
    """The fraction of requests (with images) whose images all appeared in earlier requests."""
    seen: set[str] = set()
    repeats = with_images = 0
    for req in requests:
        if req.image_keys:
            with_images += 1
            repeats += all(k in seen for k in req.image_keys)
            seen.update(req.image_keys)
    return repeats / with_images if with_images else 0.0


def parse_image_sizes(text: str) -> list[tuple[int, int]]:
    """`"336"` -> [(336, 336)]; `"224,640x480"` -> [(224, 224), (640, 480)] (mixed sizes)."""
    return [parse_image_size(part.strip()) for part in text.split(",")]


def random_mm_requests(num_prompts: int, *, image_size: tuple[int, int] | list[tuple[int, int]] = (336, 336),
                       images_per_prompt: int = 1, input_len: int = 32, output_len: int = 32,
                       image_repeat_rate: float = 0.0, seed: int = 0) -> list[BenchRequest]:
    """The `random-mm` dataset (see the module docstring); deterministic given the arguments.
    With a list of sizes, new images take them in turn (dynamic-resolution models)."""
    sizes = image_size if isinstance(image_size, list) else [image_size]
    if num_prompts < 1 or images_per_prompt < 0 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be positive, images_per_prompt >= 0")
    rng = np.random.default_rng(seed)
    repeats = set(rng.choice(np.arange(1, num_prompts), repeat_count(num_prompts, image_repeat_rate),
                             replace=False).tolist()) if num_prompts > 1 else set()
    urls: dict[str, str] = {}
    fresh: list[tuple[str, ...]] = []  # image keys of the prompts with new images, in order
    requests = []
    for i in range(num_prompts):
        if i in repeats and images_per_prompt:
            keys = fresh[int(rng.integers(0, len(fresh)))]
        else:
            keys = tuple(f"random-{seed}-{i}-{j}" for j in range(images_per_prompt))
            fresh.append(keys)
            for j, key in enumerate(keys):
                image_seed = [seed, i, j]  # a distinct pixel stream per image
                size = sizes[(len(urls)) % len(sizes)]
                urls[key] = image_data_url(png_bytes(synthetic_image(image_seed, size)))
        text = random_words(rng, input_len)
        requests.append(BenchRequest(chat_messages([urls[k] for k in keys], text), output_len, keys))
    return requests
