"""The benchmark's datasets: random-mm's exact, seeded repeat rate; jsonl and image-dir files."""

from __future__ import annotations

import base64
import json

import pytest

from mmserve.bench.dataset_files import image_dir_requests, jsonl_requests
from mmserve.bench.datasets import (parse_image_size, random_mm_requests, repeat_count, repeat_rate,
                                    synthetic_image)
from helpers.tiny_models import make_image

SMALL = (8, 8)


def image_urls(request) -> list[str]:
    return [part["image_url"]["url"] for m in request.messages for part in m["content"]
            if part["type"] == "image_url"]


@pytest.mark.parametrize("n", [1, 2, 10, 37, 64])
@pytest.mark.parametrize("rate", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_repeat_rate_is_exact(n, rate):
    requests = random_mm_requests(n, image_size=SMALL, image_repeat_rate=rate, seed=n, input_len=2)
    assert len(requests) == n
    assert repeat_count(n, rate) == min(round(rate * n), n - 1)
    assert repeat_rate(requests) == repeat_count(n, rate) / n


def test_repeats_reuse_identical_bytes_and_fresh_images_are_distinct():
    requests = random_mm_requests(40, image_size=SMALL, images_per_prompt=2, image_repeat_rate=0.5, seed=3)
    url_of: dict[str, str] = {}
    for req in requests:
        assert len(req.image_keys) == 2
        for key, url in zip(req.image_keys, image_urls(req)):
            assert url_of.setdefault(key, url) == url  # one key, one byte string
    assert len(set(url_of.values())) == len(url_of)  # distinct keys, distinct images
    assert repeat_rate(requests) == 0.5


def test_random_mm_is_deterministic_given_the_seed():
    a = random_mm_requests(12, image_size=SMALL, image_repeat_rate=0.5, seed=7, input_len=5)
    b = random_mm_requests(12, image_size=SMALL, image_repeat_rate=0.5, seed=7, input_len=5)
    c = random_mm_requests(12, image_size=SMALL, image_repeat_rate=0.5, seed=8, input_len=5)
    assert a == b
    assert a != c
    assert all(len(r.messages[0]["content"][-1]["text"].split()) == 5 and r.output_len == 32 for r in a)


def test_synthetic_image_and_sizes():
    image = synthetic_image(1, (20, 10))
    assert image.size == (20, 10) and image.mode == "RGB"
    assert parse_image_size("336") == (336, 336)
    assert parse_image_size("640x480") == (640, 480)
    for bad in ("", "x", "0", "3x4x5", "-2"):
        with pytest.raises(ValueError):
            parse_image_size(bad)
    with pytest.raises(ValueError):
        random_mm_requests(4, image_size=SMALL, image_repeat_rate=1.5)


def test_jsonl_inlines_paths_and_keeps_data_urls(tmp_path):
    make_image(1).save(tmp_path / "a.png")
    data_url = "data:image/png;base64," + base64.b64encode((tmp_path / "a.png").read_bytes()).decode()
    part = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    lines = [
        [{"role": "user", "content": [part("a.png"), {"type": "text", "text": "hi"}]}],
        {"messages": [{"role": "user", "content": [part(f"file://{tmp_path / 'a.png'}")]}], "max_tokens": 3},
        {"messages": [{"role": "user", "content": [part(data_url)]}]},
        [{"role": "user", "content": "text only"}],
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    requests = jsonl_requests(path, None, output_len=9)
    assert [r.output_len for r in requests] == [9, 3, 9, 9]
    assert [image_urls(r) for r in requests[:3]] == [[data_url]] * 3  # paths inlined as the same bytes
    assert repeat_rate(requests) == 2 / 3
    assert len(jsonl_requests(path, 2, output_len=9)) == 2


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('[{"role": "user", "content": "ok"}]\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        jsonl_requests(path, None, 4)
    path.write_text(json.dumps([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]))
    with pytest.raises(ValueError, match="not a file"):
        jsonl_requests(path, None, 4)
    with pytest.raises(ValueError, match="not a file"):
        jsonl_requests(tmp_path / "missing.jsonl", None, 4)


def test_image_dir_cycles_images_with_questions(tmp_path):
    for i, name in enumerate(["b.jpg", "a.png", "c.webp"]):
        make_image(i).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not an image")
    assert len(image_dir_requests(tmp_path, None, 4)) == 3
    requests = image_dir_requests(tmp_path, 7, 4, seed=1)
    assert [r.image_keys[0].rsplit("/", 1)[-1] for r in requests] == ["a.png", "b.jpg", "c.webp"] * 2 + ["a.png"]
    assert image_urls(requests[1])[0].startswith("data:image/jpeg;base64,")
    assert repeat_rate(requests) == 4 / 7
    assert requests == image_dir_requests(tmp_path, 7, 4, seed=1)
    with pytest.raises(ValueError, match="not a directory"):
        image_dir_requests(tmp_path / "notes.txt", 2, 4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no images"):
        image_dir_requests(tmp_path / "empty", 2, 4)
