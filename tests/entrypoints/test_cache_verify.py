"""The shadow cache verifier catches a cache that serves wrong values: a server whose prefix-cache
KV blocks or encoder-cache outputs are altered on every hit (`MMSERVE_DEBUG_CACHE_FAULT`, a
debugging hook in the model runner) reports mismatches at `--cache-verify-rate 1`, naming the
request, the layers that served it and its items; and on issue 38's case (the same frames as a
video at another fps, Qwen2.5-VL) its verdict agrees with a run that no cache serves. (A clean run
reporting none is in `test_cache_report.py`.)"""

from __future__ import annotations

import base64
import time

import httpx
import pytest

from mmserve.worker.cache_fault import ENV
from helpers.server_process import ServerProcess, data_url
from helpers.tiny_models import make_checkpoint, make_image, make_qwen_checkpoint
from helpers.tiny_videos import encode_video, make_frames

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

SYSTEM = {"role": "system", "content": "You describe pictures of foxes in a few words. " * 3}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("cache_verify"))


def faulty_server(model_path: str, kind: str) -> ServerProcess:
    return ServerProcess(model_path, "--max-model-len", "512", "--cache-verify-rate", "1", env={ENV: kind})


def ask(server: ServerProcess, content: list[dict] | str) -> httpx.Response:
    body = {"messages": [SYSTEM, {"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    response.raise_for_status()
    return response


def outcomes(server: ServerProcess, wait_for: str | None, timeout_s: float = 30.0) -> dict[str, float]:
    """The verifier's counts, once `wait_for` (None: either outcome) has been counted (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        _, text = server.get("/metrics")
        counts = {line.split('"')[1]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith("mmserve_cache_verify_total{")}
        counted = sum(counts.values()) if wait_for is None else counts.get(wait_for, 0)
        if counted > 0 or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def test_an_altered_prefix_block_is_reported(model_path):
    server = faulty_server(model_path, "kv")
    try:
        ask(server, "Is a fox a dog?")
        second = ask(server, "Is a fox a cat?")  # the system turn's blocks hit the (altered) prefix cache
        assert "prefix=" in second.headers["x-mmserve-cache"]
        counts = outcomes(server, "mismatch")
        assert counts["mismatch"] >= 1, server.output()[-3000:]
        log = server.output()
        assert "cache verification MISMATCH for request" in log and "served by prefix" in log
        assert server.metric("mmserve_cache_verify_max_abs_diff") > 1e-3
    finally:
        server.stop()


def test_an_altered_encoder_output_is_reported(model_path):
    server = faulty_server(model_path, "encoder")
    try:
        url = data_url(make_image(7))
        image = {"type": "image_url", "image_url": {"url": url}}
        ask(server, [{"type": "text", "text": "Describe it."}, image])
        second = ask(server, [{"type": "text", "text": "What animal is this?"}, image])
        assert "encoder=1/1" in second.headers["x-mmserve-cache"]
        counts = outcomes(server, "mismatch")
        assert counts["mismatch"] >= 1, server.output()[-3000:]
        line = next(line for line in server.output().splitlines() if "cache verification MISMATCH" in line)
        assert "encoder" in line and second.json()["id"] in line
    finally:
        server.stop()


def test_on_a_video_at_another_fps_the_verdict_agrees_with_an_uncached_run(tmp_path):
    """Before issue 38's position keys, the 4 fps video was served the 2 fps video's KV (a
    mismatch); after them, its blocks differ and what is served is right (a match). Either way the
    verifier must say what a run with a fresh `cache_salt` (no cache can serve it) shows."""
    server = ServerProcess(make_qwen_checkpoint(tmp_path, family="qwen2_5_vl"), "--max-model-len", "1024",
                           "--cache-verify-rate", "1")
    try:
        frames = make_frames(3, 4, (64, 48))
        answers = []
        for fps, salt in ((2, None), (4, None), (4, "fresh")):
            url = "data:video/quicktime;base64," + base64.b64encode(encode_video(frames, fps=fps)).decode()
            body = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                               {"type": "text", "text": "What happens?"}]}],
                    "max_tokens": 8, "temperature": 0, "media_io_kwargs": {"video": {"num_frames": 4}}}
            if salt is not None:
                body["cache_salt"] = salt
            response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
            response.raise_for_status()
            answers.append(response.json()["choices"][0]["message"]["content"])
            if fps == 4 and salt is None:
                assert "ipc=2/2" in response.headers["x-mmserve-cache"]  # its frames' groups were cached
                counts = outcomes(server, None)
        served_right = answers[1] == answers[2]
        assert counts == {"match": float(served_right), "mismatch": float(not served_right)}, server.output()[-3000:]
    finally:
        server.stop()
