"""Several API servers (`--api-server-count 2`) in front of two engine cores: one listening
socket, answers equal to one engine's, routing alike on every server (through the coordinator),
one /metrics for every process, and a killed engine core survived with nothing left behind."""

from __future__ import annotations

import glob
import json
import os
import signal
import tempfile
import time

import httpx
import pytest

from mmserve import LLM
from helpers.server_process import (ServerProcess, answers_through_a_kill, children_titled, concurrent_answers,
                                    data_url, expected, pid_alive, post, scrape)
from helpers.tiny_models import make_checkpoint, make_image

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')

# lru asked for: these tests are about per-server processor and IPC caches (shm is the default here)
ARGS = ("--api-server-count", "2", "--data-parallel-size", "2", "--mm-cache-type", "lru", "--max-model-len", "256")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("api_servers"))


@pytest.fixture(scope="module")
def offline(model_path):
    return LLM(model=model_path, max_model_len=256)


@pytest.fixture(scope="module")
def server(model_path):
    s = ServerProcess(model_path, *ARGS, env={"VLLM_SERVER_DEV_MODE": "1"})
    s.model = model_path
    yield s
    assert s.stop() == 0


def settled_scrape(server):
    time.sleep(0.2)  # every API server shares its own cache figures within 0.1 s of a request's end
    return scrape(server)


def test_answers_equal_one_engine_and_every_process_is_there(server, offline):
    urls = [data_url(make_image(100 + i)) for i in range(6)]
    assert concurrent_answers(server, urls) == [expected(offline, u) for u in urls]
    titles = set(children_titled(server, ""))  # the launcher itself and its children
    assert titles == {"mmserve::launcher", "mmserve::api_server_0", "mmserve::api_server_1",
                      "mmserve::engine_dp0", "mmserve::engine_dp1"}


def test_repeats_hit_where_their_image_went_whichever_server_took_them(server):
    before = settled_scrape(server)
    urls = [data_url(make_image(200 + i)) for i in range(6)]
    assert all(post(server, u).status_code == 200 for u in urls)
    mid = settled_scrape(server)
    repeats = [post(server, u, text="Describe it.") for u in urls for _ in range(2)]
    after = settled_scrape(server)
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in repeats]
    assert all(c >= 16 for c in cached), cached  # every repeat found its image's blocks on its rank

    def delta(a, b, name, **labels):
        return b.value(name, **labels) - a.value(name, **labels)

    first = [delta(before, mid, "mmserve_engine_requests_total", engine=str(r)) for r in (0, 1)]
    # the first sights spread over both ranks (not evenly: a request that ended on one server may
    # still count as in flight when the other server's next request is routed; 1/5 was seen)
    assert sum(first) == 6 and min(first) >= 1, first
    assert delta(mid, after, "mmserve_dp_routing_decisions_total", reason="cache") == 12
    # one /metrics for every process: the request counts and P0's cache layers of both servers
    assert delta(before, after, "mmserve_requests_total", outcome="success") == 18
    assert delta(before, after, "mmserve_cache_queries_total", layer="processor") == 18
    for vllm, ours in (("vllm:prompt_tokens_total", "mmserve_prompt_tokens_total"),  # vLLM's names, summed alike
                       ("vllm:time_to_first_token_seconds_count", "mmserve_time_to_first_token_seconds_count"),
                       ("vllm:request_prompt_tokens_count", "mmserve_time_to_first_token_seconds_count"),
                       ("vllm:inter_token_latency_seconds_count", "mmserve_inter_token_latency_seconds_count"),
                       ("vllm:request_queue_time_seconds_count", "mmserve_time_to_first_token_seconds_count"),
                       ("vllm:request_inference_time_seconds_count", "mmserve_time_to_first_token_seconds_count")):
        assert delta(before, after, vllm, model_name=server.model) == delta(before, after, ours) > 0, vllm
    assert delta(before, after, "vllm:request_success_total", model_name=server.model, finished_reason="length") \
        + delta(before, after, "vllm:request_success_total", model_name=server.model, finished_reason="stop") == 18
    per_server = [after.value("mmserve_api_server_requests_total", api_server=str(i)) for i in (0, 1)]
    assert sum(per_server) == after.value("mmserve_requests_total", outcome="success")
    assert min(per_server) > 0, per_server  # the kernel handed connections to both servers


def test_a_multimodal_reset_through_one_server_empties_every_servers_caches(server, offline):
    """`/reset_mm_cache` lands on one API server; the engine cores tell the other, which empties its own
    processor cache and IPC senders too: no repeat afterwards is served by either layer, on either server."""
    urls = [data_url(make_image(700 + i)) for i in range(4)]
    assert all(post(server, u).status_code == 200 for u in urls for _ in range(4))  # both servers hold most
    assert httpx.post(server.base_url + "/reset_mm_cache", timeout=60).status_code == 200
    time.sleep(0.3)  # the other server takes the engine cores' word with their next outputs
    before = settled_scrape(server)
    again = [post(server, u) for u in urls]
    after = settled_scrape(server)
    assert [r.json()["choices"][0]["message"]["content"] for r in again] == [expected(offline, u) for u in urls]
    for layer in ("processor", "ipc"):
        assert after.value("mmserve_cache_queries_total", layer=layer) - \
            before.value("mmserve_cache_queries_total", layer=layer) == 4, layer
        assert after.value("mmserve_cache_hits_total", layer=layer) == before.value("mmserve_cache_hits_total",
                                                                                     layer=layer), layer


def test_a_killed_engine_core_is_survived_by_every_api_server(model_path, offline):
    # a launcher killed by SIGKILL earlier (test_nothing_outlives_a_killed_launcher) cannot remove its
    # folder, and where pids wrap its pid may be this launcher's: only a folder that is new counts
    stale = set(glob.glob(os.path.join(tempfile.gettempdir(), "mmserve-*")))
    s = ServerProcess(model_path, *ARGS)
    s.model = model_path
    try:
        urls = [data_url(make_image(400 + i)) for i in range(8)]
        want = [expected(offline, u, max_tokens=40) for u in urls]
        pattern = os.path.join(tempfile.gettempdir(), f"mmserve-{s.proc.pid}-*", "*")
        ipc_dirs = {os.path.dirname(p) for p in glob.glob(pattern)} - stale
        assert len(ipc_dirs) == 1
        victim = children_titled(s, "engine_dp0")["mmserve::engine_dp0"]
        answers_through_a_kill(s, urls, want, victim)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            back = children_titled(s, "engine_dp0").get("mmserve::engine_dp0")
            ranks = json.loads(s.get("/health")[1]).get("ranks", [])
            if back not in (None, victim) and [r["status"] for r in ranks] == ["ready", "ready"]:
                break
            time.sleep(0.5)
        assert back not in (None, victim) and [r["status"] for r in ranks] == ["ready", "ready"], ranks
        for _ in range(4):  # whichever server answers, rank 0 serves again
            assert post(s, urls[0], "What is this?", 40).json()["choices"][0]["message"]["content"] == want[0]
    finally:
        assert s.stop() == 0
    assert not any(os.path.exists(d) for d in ipc_dirs)


def test_nothing_outlives_a_killed_launcher(model_path):
    s = ServerProcess(model_path, "--api-server-count", "2", "--mm-cache-type", "lru", "--max-model-len", "256")
    deadline = time.monotonic() + 30  # /health answered: one API server is up, the other may still start
    while len(children := set(children_titled(s, "").values()) - {s.proc.pid}) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(children) == 3  # two API servers, one engine core
    s.stop(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(pid_alive(p) for p in children):
        time.sleep(0.5)
    assert not any(pid_alive(p) for p in children)


def test_previous_response_id_is_found_whichever_server_takes_the_follow_up(server):
    """The node keeps one response store, in the launcher (regression: each API server kept its own,
    and 12 of 20 follow-ups on new connections were 404s)."""
    import httpx

    body = {"model": server.model, "input": "Hello there.", "max_output_tokens": 3, "temperature": 0}
    first = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    assert first.status_code == 200, first.text
    for _ in range(20):  # a new connection each: the kernel spreads them over the two servers
        follow = {**body, "input": "And now?", "previous_response_id": first.json()["id"]}
        r = httpx.post(server.base_url + "/v1/responses", json=follow, timeout=60, headers={"Connection": "close"})
        assert r.status_code == 200, r.text
    salted = {**follow, "cache_salt": "another tenant"}
    r = httpx.post(server.base_url + "/v1/responses", json=salted, timeout=60)
    assert r.status_code == 404 and "cache_salt" in r.json()["error"]["message"]
