"""The soak's request mix (see tests/soak.py): good, hostile, cancelled and uuid-only chat
requests over a small pool of images, drawn deterministically from a seed.

A `Spec` says what to send and what may come back. Good requests carry `key` (what decides
their answer: images, text, max_tokens) and a `reference` body that gives the same answer from
a fresh server (uuid-only parts are sent there with their image).
"""

from __future__ import annotations

import base64
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from helpers.tiny_models import make_image

TEXTS = ("What is this?", "Describe the picture.")
MAX_TOKENS = (1, 8)
KINDS = (("good", 45), ("hostile", 25), ("cancel", 15), ("uuid_only", 15))  # (kind, weight)
# and "costly" (`with_costly`): requests whose cost must be bounded before it is paid, and
# "stalled" (`with_stalled`): streams whose client stops reading for `stall_s`


@dataclass
class Spec:
    """One request: `body` (a dict sent as JSON, or raw bytes), whether to stream, and for a
    cancelled one when the client walks away (`cancel_after_s`; None: after the first chunk)."""

    kind: str
    name: str
    body: dict[str, Any] | bytes
    stream: bool = False
    cancel_after_s: float | None = None
    stall_s: float | None = None  # a stalled stream: the client reads nothing for this long
    key: str | None = None  # good requests: what decides the answer
    reference: dict[str, Any] | None = None  # good requests: the body a fresh server answers alike


@dataclass
class Pool:
    """The images requests use: data URLs (some `DATA:` upper case), file URLs, and a pair of
    palette images that differ only in `info["transparency"]` (one hash each, issue 14 case 3)."""

    urls: list[str]
    model: str
    max_model_len: int
    max_body_bytes: int
    media_dir: Path
    hostile: dict[str, dict[str, Any] | bytes] = field(default_factory=dict)  # see `hostile_bodies`


def make_pool(media_dir: Path, model: str, max_model_len: int, max_body_bytes: int, n: int = 8) -> Pool:
    urls = []
    for i in range(n):
        image = make_image(1000 + i, size=(40 + 8 * i, 48))
        if i % 4 == 3:
            image.save(media_dir / f"img{i}.png")
            urls.append(f"file://{media_dir}/img{i}.png")
        else:
            url = data_url(image, "JPEG" if i % 4 == 2 else "PNG")
            urls.append("DATA:" + url[5:] if i % 4 == 1 else url)
    palette = make_image(2000).convert("P", palette=Image.ADAPTIVE, colors=16)
    for index in (0, 5):
        palette.info["transparency"] = index
        urls.append(data_url(palette, "PNG"))
    pool = Pool(urls, model, max_model_len, max_body_bytes, media_dir)
    pool.hostile = hostile_bodies(pool)
    return pool


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"transparency": image.info["transparency"]} if "transparency" in image.info
                                   else {}))
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def draw(rng: random.Random, pool: Pool, n: int) -> list[Spec]:
    """`n` specs; the kinds in proportion to `KINDS`' weights."""
    kinds, weights = zip(*KINDS)
    makers = {"good": _good, "hostile": _hostile, "cancel": _cancel, "uuid_only": _uuid_only}
    return [makers[kind](rng, pool) for kind in rng.choices(kinds, weights, k=n)]


def chat_body(pool: Pool, text: str, **extra: Any) -> dict[str, Any]:
    """A text-only chat body (greedy) for `pool`'s model."""
    return _chat(pool, [], text, **extra)


def _chat(pool: Pool, parts: list[dict[str, Any]], text: str, **extra: Any) -> dict[str, Any]:
    return {"model": pool.model, "temperature": 0, "messages": [
        {"role": "user", "content": [*parts, {"type": "text", "text": text}]}], **extra}


def _image_part(pool: Pool, index: int, with_uuid: bool) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": pool.urls[index]}}
    if with_uuid:
        part["uuid"] = f"img-{index}"  # a uuid always names the same image
    return part


def _good(rng: random.Random, pool: Pool) -> Spec:
    images = rng.sample(range(len(pool.urls)), rng.choice((1, 1, 1, 2)))
    text, max_tokens = rng.choice(TEXTS), rng.choice(MAX_TOKENS)
    extra: dict[str, Any] = {"max_tokens": max_tokens}
    if rng.random() < 0.2:
        extra["cache_salt"] = rng.choice(("tenant-a", "tenant-b"))
    parts = [_image_part(pool, i, rng.random() < 0.5) for i in images]
    body = _chat(pool, parts, text, **extra)
    key = json.dumps([images, text, max_tokens])
    return Spec("good", "good", body, stream=rng.random() < 0.4, key=key,
                reference=_chat(pool, [_image_part(pool, i, False) for i in images], text, max_tokens=max_tokens))


def _uuid_only(rng: random.Random, pool: Pool) -> Spec:
    index, text, max_tokens = rng.randrange(len(pool.urls)), rng.choice(TEXTS), rng.choice(MAX_TOKENS)
    body = _chat(pool, [{"type": "image_url", "uuid": f"img-{index}"}], text, max_tokens=max_tokens)
    return Spec("uuid_only", "uuid_only", body, stream=rng.random() < 0.3, key=json.dumps([[index], text, max_tokens]),
                reference=_chat(pool, [_image_part(pool, index, False)], text, max_tokens=max_tokens))


def _cancel(rng: random.Random, pool: Pool) -> Spec:
    body = _chat(pool, [_image_part(pool, rng.randrange(len(pool.urls)), rng.random() < 0.3)],
                 rng.choice(TEXTS), max_tokens=64, ignore_eos=True)
    if rng.random() < 0.5:
        return Spec("cancel", "cancel mid-stream", body, stream=True)
    return Spec("cancel", "cancel before the answer", body, cancel_after_s=rng.uniform(0.002, 0.3))


def _hostile(rng: random.Random, pool: Pool) -> Spec:
    name, body = rng.choice(list(pool.hostile.items()))
    return Spec("hostile", name, body, stream=isinstance(body, dict) and rng.random() < 0.3)


def hostile_bodies(pool: Pool) -> dict[str, dict[str, Any] | bytes]:
    """Requests a hostile client sends; each must be a 4xx that changes nothing."""
    def chat(**extra: Any) -> dict[str, Any]:
        return _chat(pool, [_image_part(pool, 0, False)], "What is this?", **extra)

    bomb = io.BytesIO()
    Image.new("1", (9000, 9000)).save(bomb, format="PNG")  # a few KB claiming 81 M pixels
    bodies: dict[str, dict[str, Any] | bytes] = {
        "max_tokens 2**64": chat(max_tokens=2**64), "top_k 2**64": chat(top_k=2**64, max_tokens=2),
        "seed 2**64": chat(seed=2**64, max_tokens=2), "stop_token_ids 2**64": chat(stop_token_ids=[2**64]),
        "stop token past the vocabulary": chat(stop_token_ids=[10**7], max_tokens=2),
        "max_tokens past the model length": chat(max_tokens=pool.max_model_len + 1),
        "negative seed": chat(seed=-1), "bad temperature": chat(temperature=-1), "n 0": chat(n=0),
        "top_logprobs 21": chat(logprobs=True, top_logprobs=21),
        "unsupported schema": chat(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "patternProperties": {"^a": {}}}}}),
        "bad base64": _chat(pool, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}], "x"),
        "not an image": _chat(pool, [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(b"hello").decode()}}], "x"),
        "decompression bomb": _chat(pool, [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(bomb.getvalue()).decode()}}], "x"),
        "too many images": _chat(pool, [_image_part(pool, i, False) for i in range(3)], "x"),
        "file outside the allowed dir": _chat(pool, [{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}],
                                              "x"),
        "dotdot": _chat(pool, [{"type": "image_url", "image_url": {"url": f"file://{pool.media_dir}/../../etc/hostname"}}],
                        "x"),
        "http to loopback": _chat(pool, [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}], "x"),
        "uuid never sent": _chat(pool, [{"type": "image_url", "uuid": "never-sent"}], "x"),
        "prompt too long": _chat(pool, [], "word " * (pool.max_model_len + 8), max_tokens=2),
        "unknown model": {**chat(), "model": "nope"}, "no messages": {"model": pool.model},
        "malformed json": b'{"model": ', "body over the limit": _oversized(pool.max_body_bytes),
    }
    return bodies


def with_costly(specs: list[Spec], pool: Pool, every: int = 10) -> list[Spec]:
    """`specs` with the `costly_bodies` spread among them, one every `every` (the draw unchanged)."""
    costly = [Spec("costly", name, body) for name, body in costly_bodies(pool).items()]
    out: list[Spec] = []
    for i, spec in enumerate(specs):
        if i % every == every - 1 and costly:
            out.append(costly.pop(0))
        out.append(spec)
    return out + costly


def with_stalled(specs: list[Spec], pool: Pool, count: int = 2, stall_s: float = 3.0) -> list[Spec]:
    """`specs` with `count` stalled streams spread among them: `n` 8, logprobs 20, as long as the
    model allows, read by nobody for `stall_s` (longer than the soak's `--stalled-stream-abort-s`).
    On the tiny soak models such a stream may end before the abort: either way is allowed, and
    the end checks must hold (tests/frontend/test_backpressure.py shows the abort itself)."""
    body = _chat(pool, [], "Tell me a story.", n=8, logprobs=True, top_logprobs=20, ignore_eos=True,
                 max_tokens=pool.max_model_len - 32, temperature=1.0)
    out = list(specs)
    for i in range(count):
        out.insert((i + 1) * len(out) // (count + 1), Spec("stalled", "stream never read", body, stream=True,
                                                          stall_s=stall_s))
    return out


def costly_bodies(pool: Pool) -> dict[str, dict[str, Any]]:
    """Requests whose cost the server must bound before paying it (issue 40): each a 400."""
    def schema(value: Any) -> dict[str, Any]:
        return _chat(pool, [], "x", max_tokens=4,
                     response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": value}})

    def chat(**extra: Any) -> dict[str, Any]:
        return _chat(pool, [], "x", **extra)

    deep = '{"type": "array", "items": ' * 330 + '{"type": "string"}' + "}" * 330
    return {
        "huge enum schema": schema({"type": "string", "enum": [f"v{i}" for i in range(20_000)]}),
        "1,500 optional properties": schema({"type": "object", "properties": {
            f"p{i}": {"type": "integer"} for i in range(1500)}}),
        "schema text nested 330 deep": schema(deep),
        "unsatisfiable schema": schema({"$ref": "#"}),
        "stop-string flood": chat(max_tokens=4, stop=[f"{i:05d}" + "s" * 195 for i in range(1_000)]),
        "tool_choice function as a string": chat(tools=[{"type": "function", "function": {
            "name": "a", "parameters": {"type": "object"}}}], tool_choice={"function": "a"}),
    }


def _oversized(limit: int) -> bytes:
    """A body one MiB past the server's limit (refused with 413 before it is read)."""
    return b'{"messages": "' + b"x" * (limit + (1 << 20)) + b'"}'
