"""vLLM's cache-reset routes (`VLLM_SERVER_DEV_MODE=1`: `/reset_prefix_cache`, `/reset_mm_cache`,
`/reset_encoder_cache`) on a real server, with the IPC mirror (`lru`) and with the shared-memory
store (`shm`): each drops exactly its layers (the `x-mmserve-cache` report of the next repeat says
which missed), all three make a repeat as cold as the first request, resets while requests run
change none of their answers, and the routes are behind the API key."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mmserve.cache_report import HEADER
from helpers.server_process import ServerProcess, data_url, messages
from helpers.tiny_models import make_checkpoint, make_image

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

KEY = "reset-key"
RESETS = ("/reset_prefix_cache", "/reset_encoder_cache", "/reset_mm_cache")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("cache_reset"))


@pytest.fixture(scope="module", params=["lru", "shm"])
def server(request, model_path):
    s = ServerProcess(model_path, "--max-model-len", "512", "--api-key", KEY, "--mm-cache-type", request.param,
                      env={"VLLM_SERVER_DEV_MODE": "1"})
    s.mirror = "ipc" if request.param == "lru" else "shm"
    yield s
    s.stop()


def chat(server, url: str, max_tokens: int = 6) -> tuple[str, dict[str, tuple[int, int]]]:
    body = {"model": "m", "messages": messages(url), "temperature": 0, "max_tokens": max_tokens}
    r = httpx.post(server.base_url + "/v1/chat/completions", json={**body, "model": server_model(server)},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    counts = {}
    for part in r.headers[HEADER].split():
        layer, _, frac = part.partition("=")
        hits, queries = frac.split("/")
        counts[layer] = (int(hits), int(queries))
    return r.json()["choices"][0]["message"]["content"], counts


def server_model(server) -> str:
    r = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    return r.json()["data"][0]["id"]


def reset(server, path: str, key: str | None = KEY, **params: str) -> httpx.Response:
    return httpx.post(server.base_url + path, params=params, timeout=60,
                      headers={"Authorization": f"Bearer {key}"} if key else {})


def test_each_reset_drops_its_layers_and_the_answer_stays(server):
    url = data_url(make_image(60))
    text, cold = chat(server, url)
    n = cold["prefix"][1]
    m = server.mirror
    assert cold == {"processor": (0, 1), m: (0, 1), "encoder": (0, 1), "prefix": (0, n)}
    warm = {"processor": (1, 1), m: (1, 1), "prefix": (n, n), "last_block": (1, 1), "first_token": (1, 1)}
    assert chat(server, url) == (text, warm)

    r = reset(server, "/reset_prefix_cache", reset_running_requests="true", reset_external="false")
    assert r.status_code == 200 and r.json()["prefix_blocks"] >= n // 16 and r.json()["first_tokens"] >= 1
    cold_prefix = {"processor": (1, 1), m: (1, 1), "prefix": (0, n), "encoder": (1, 1)}  # the tower's output kept
    assert chat(server, url) == (text, cold_prefix)
    r = reset(server, "/reset_encoder_cache")
    assert r.status_code == 200 and r.json()["encoder_items"] >= 1
    assert chat(server, url) == (text, warm)  # the prefix (computed again) covers the image: no tower asked
    r = reset(server, "/reset_mm_cache")
    assert r.status_code == 200 and r.json()["processor_items"] >= 1
    assert chat(server, url) == (text, {**warm, "processor": (0, 1), m: (0, 1)})
    for path in RESETS:
        assert reset(server, path).status_code == 200
    assert chat(server, url) == (text, cold)  # all three: as cold as the first time


def test_resets_while_requests_run_change_no_answer(server):
    urls = [data_url(make_image(70 + i)) for i in range(4)]
    expected = [chat(server, url, max_tokens=24)[0] for url in urls]
    done = threading.Event()

    def keep_resetting() -> int:
        count = 0
        while not done.is_set():
            for path in RESETS:
                assert reset(server, path).status_code == 200
                count += 1
        return count

    with ThreadPoolExecutor(5) as pool:
        resets = pool.submit(keep_resetting)
        answers = list(pool.map(lambda url: chat(server, url, max_tokens=24)[0], urls * 2))
        done.set()
        assert resets.result() >= 3
    assert answers == expected * 2
    for path in RESETS:
        reset(server, path)
    _, counts = chat(server, urls[0])
    assert counts["processor"] == (0, 1) and counts["prefix"][0] == 0  # nothing a finished request held stayed


def test_the_routes_are_behind_the_api_key(server):
    assert reset(server, "/reset_prefix_cache", key=None).status_code == 401
    assert reset(server, "/reset_mm_cache", key="wrong").status_code == 401
    r = reset(server, "/reset_prefix_cache", reset_running_requests="perhaps")
    assert r.status_code == 400 and "reset_running_requests" in r.text


def test_the_server_logs_each_reset_and_no_error(server):
    chat(server, data_url(make_image(80)))
    for path in RESETS:
        assert reset(server, path).status_code == 200
    log = server.output()
    assert "reset the prefix cache" in log and "reset the multimodal cache" in log and "reset the encoder cache" in log
    assert "Traceback" not in log and "ERROR" not in log and "ignoring" not in log, log[-3000:]
