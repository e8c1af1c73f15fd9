"""Datasets read from the user's files: `jsonl` (conversations) and `image-dir` (a folder of images).

`jsonl`: one request per line, either a list of OpenAI chat messages or an object
`{"messages": [...], "max_tokens": N}` (`max_tokens` optional, else `--output-len`). An
`image_url` whose URL is a local path (absolute, or relative to the file's folder) or a
`file://` URL is read here and sent as a data URL; `data:` and http(s) URLs are sent as they are.

`image-dir`: the folder's PNG, JPEG, WebP and GIF files in name order; request i asks a
generated question about image i mod (number of images), so with more prompts than images each
image comes back with another question.
"""

from __future__ import annotations

import copy
import hashlib
import json
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np

from mmserve.bench.datasets import BenchRequest, chat_messages, image_data_url

IMAGE_MIME = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
              ".gif": "image/gif"}
QUESTIONS = (
    "What is in this image?",
    "Describe the image in detail.",
    "How many objects can you see?",
    "What colors are in this picture?",
    "Write a short caption for this photo.",
    "What is happening in this scene?",
    "Is there a person in this image?",
    "What is in the center of the picture?",
)


def jsonl_requests(path: str | Path, num_prompts: int | None, output_len: int) -> list[BenchRequest]:
    """The first `num_prompts` lines of a JSONL file (all when None) as requests."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--dataset-path {str(path)!r} is not a file")
    requests: list[BenchRequest] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if num_prompts is not None and len(requests) >= num_prompts:
                break
            if line.strip():
                requests.append(_jsonl_request(line, path.parent, output_len, f"{path}:{lineno}"))
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


def _jsonl_request(line: str, base_dir: Path, output_len: int, where: str) -> BenchRequest:
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON: {e}") from None
    messages = entry.get("messages") if isinstance(entry, dict) else entry
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"{where}: expected a list of messages or an object with 'messages'")
    max_tokens = entry.get("max_tokens", output_len) if isinstance(entry, dict) else output_len
    messages = copy.deepcopy(messages)
    keys = [_inline_image(part, base_dir, where) for part in _image_parts(messages)]
    return BenchRequest(messages, int(max_tokens), tuple(keys))


def _image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [part for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image_url"]


def _inline_image(part: dict[str, Any], base_dir: Path, where: str) -> str:
    """Turn a path or file:// image URL into a data URL in place; return the image's key."""
    image_url: Any = part.get("image_url")
    if isinstance(image_url, str):  # accept the shorthand {"image_url": "..."}
        image_url = part["image_url"] = {"url": image_url}
    url = image_url.get("url") if isinstance(image_url, dict) else None
    if not isinstance(url, str):
        raise ValueError(f"{where}: an image_url part without a url")
    if not url.startswith(("data:", "http://", "https://")):
        file = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)) if url.startswith("file://") else Path(url)
        file = file if file.is_absolute() else base_dir / file
        if not file.is_file():
            raise ValueError(f"{where}: image {url!r} is not a file")
        url = image_url["url"] = image_data_url(file.read_bytes(), IMAGE_MIME.get(file.suffix.lower(), "image/png"))
    return hashlib.blake2b(url.encode(), digest_size=16).hexdigest()


def image_dir_requests(path: str | Path, num_prompts: int | None, output_len: int,
                       seed: int = 0) -> list[BenchRequest]:
    """Requests about the images of a folder (see the module docstring); one per image when None."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"--dataset-path {str(folder)!r} is not a directory")
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_MIME)
    if not files:
        raise ValueError(f"{folder} holds no images ({', '.join(IMAGE_MIME)})")
    n = len(files) if num_prompts is None else num_prompts
    rng = np.random.default_rng(seed)
    urls: dict[Path, str] = {}
    requests = []
    for i in range(n):
        file = files[i % len(files)]
        if file not in urls:
            urls[file] = image_data_url(file.read_bytes(), IMAGE_MIME[file.suffix.lower()])
        question = QUESTIONS[int(rng.integers(0, len(QUESTIONS)))]
        requests.append(BenchRequest(chat_messages([urls[file]], question), output_len, (str(file),)))
    return requests
