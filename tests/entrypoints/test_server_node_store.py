"""Two API servers with the node's shared store (`--mm-cache-type shm`, their default): one item
store for the node, owned by the launcher and written by both servers. A repeat skips the image
processor whichever server takes it (the
other server processed it: its processor cache finds it in the store), answers equal one
engine's, a killed engine core is replaced on the same store, and the store's segment is gone
after shutdown."""

from __future__ import annotations

import time

import httpx
import pytest

from mmserve import LLM
from helpers.server_process import (ServerProcess, answers_through_a_kill, children_titled, data_url, expected,
                                    post, scrape)
from helpers.shm_listing import shm_listing
from helpers.tiny_models import make_checkpoint, make_image

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')


def segments() -> set[str]:
    return {name for name in shm_listing() if name.startswith("mmserve_")}


def test_a_repeat_on_either_server_skips_the_processor(tmp_path):
    model = make_checkpoint(tmp_path)
    offline = LLM(model=model, max_model_len=256)
    before = segments()
    # no --mm-cache-type: with several API servers the node's store is the default (issue 41)
    server = ServerProcess(model, "--api-server-count", "2", "--mm-shm-cache-gb", "0.25", "--max-model-len", "256",
                           env={"VLLM_SERVER_DEV_MODE": "1"})
    server.model = model
    try:
        assert "share the node's item store" in server.output()
        assert len(segments() - before) == 1  # one store for the node, not one per API server
        urls = [data_url(make_image(500 + i)) for i in range(8)]
        want = [expected(offline, u) for u in urls]
        first = [post(server, u) for u in urls]  # a connection each: the kernel picks the server
        time.sleep(0.2)  # every API server shares its own cache figures within 0.1 s of a request's end
        mid = scrape(server)
        repeats = [post(server, u) for u in urls for _ in range(2)]
        time.sleep(0.2)
        after = scrape(server)
        assert [r.json()["choices"][0]["message"]["content"] for r in first] == want
        assert [r.json()["choices"][0]["message"]["content"] for r in repeats] == [w for w in want for _ in (0, 1)]

        def delta(name: str, **labels: str) -> float:
            return after.value(name, **labels) - mid.value(name, **labels)

        assert mid.value("mmserve_cache_hits_total", layer="processor") == 0
        # every repeat skipped the processor, also the ones that landed on the server that had not seen
        # the image (about half of them: with per-server processor caches those would have missed)
        assert delta("mmserve_cache_queries_total", layer="processor") == 16
        assert delta("mmserve_cache_hits_total", layer="processor") == 16
        assert delta("mmserve_cache_hits_total", layer="shm") == 16  # and crossed to the engine as a handle
        per_server = [after.value("mmserve_api_server_requests_total", api_server=str(i)) for i in (0, 1)]
        assert min(per_server) > 0, per_server  # the kernel handed connections to both servers
        # /reset_mm_cache through either server empties the node's store: no repeat crosses as a handle
        reset = httpx.post(server.base_url + "/reset_mm_cache", timeout=60)
        assert reset.status_code == 200 and reset.json()["store_items"] == 8, reset.text
        again = [post(server, u) for u in urls]
        time.sleep(0.2)
        assert [r.json()["choices"][0]["message"]["content"] for r in again] == want
        assert scrape(server).value("mmserve_cache_hits_total", layer="shm") == after.value(
            "mmserve_cache_hits_total", layer="shm")
        # kill -9 of the engine core under load: the launcher starts a new one on the same store, every
        # request answers (each waited for the new engine), and the store keeps serving by handle
        victim = children_titled(server, "engine_dp0")["mmserve::engine_dp0"]
        answers_through_a_kill(server, urls, [expected(offline, u, max_tokens=40) for u in urls], victim)
        last = post(server, urls[5]).json()
        assert last.get("choices", [{}])[0].get("message", {}).get("content") == want[5], last
    finally:
        assert server.stop() == 0
    assert segments() == before
