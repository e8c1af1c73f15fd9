"""The shadow cache verifier catches a cache that serves wrong values: a server whose prefix-cache
KV blocks or encoder-cache outputs are altered on every hit (`MMSERVE_DEBUG_CACHE_FAULT`, a
debugging hook in the model runner) reports mismatches at `--cache-verify-rate 1`, naming the
request, the layers that served it and its items. (A clean run reporting none is in
`test_cache_report.py`.)"""

from __future__ import annotations

import time

import httpx
import pytest

from mmserve.worker.cache_fault import ENV
from server_process import ServerProcess, data_url
from tiny_models import make_checkpoint, make_image

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


def outcomes(server: ServerProcess, wait_for: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The verifier's counts, once `wait_for` has been counted (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        _, text = server.get("/metrics")
        counts = {line.split('"')[1]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith("mmserve_cache_verify_total{")}
        if counts.get(wait_for, 0) > 0 or time.monotonic() > deadline:
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
