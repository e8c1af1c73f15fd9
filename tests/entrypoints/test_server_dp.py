"""Data parallelism through the server: two engine cores behind one API server, image-aware
routing, pins, per-rank metrics and health, and a killed engine core survived."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from mmserve import LLM, SamplingParams
from helpers.server_process import (ServerProcess, answers_through_a_kill, children_titled, concurrent_answers,
                                    data_url, expected, post, scrape)
from helpers.tiny_models import make_checkpoint, make_image

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')

MAX_TOKENS = 8
DP_ARGS = ("--data-parallel-size", "2", "--max-model-len", "256")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("dp"))


@pytest.fixture(scope="module")
def server(model_path):
    s = ServerProcess(model_path, *DP_ARGS)
    s.model = model_path
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(model_path):
    return LLM(model=model_path, max_model_len=256)


def test_answers_equal_one_engine_and_processes_carry_titles(server, offline):
    urls = [data_url(make_image(100 + i)) for i in range(4)]
    assert concurrent_answers(server, urls) == [expected(offline, u) for u in urls]
    assert set(children_titled(server, "engine_dp")) == {"mmserve::engine_dp0", "mmserve::engine_dp1"}
    assert Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().startswith(b"mmserve::api_server_0")


def test_repeats_go_where_their_image_is_cached(server):
    before = scrape(server)
    urls = [data_url(make_image(200 + i)) for i in range(6)]
    first = [post(server, u) for u in urls]
    mid = scrape(server)
    repeats = [post(server, u, text="Describe it.") for u in urls]  # same image, other question
    after = scrape(server)
    served = [mid.value("mmserve_engine_requests_total", engine=str(r))
              - before.value("mmserve_engine_requests_total", engine=str(r)) for r in (0, 1)]
    # the first sights spread over both ranks: with no load and nothing cached to tell them apart,
    # the rank routed to least takes the next, so the module's requests so far stay even (the
    # concurrent requests of the test before may have left one rank a request or two ahead)
    totals = [mid.value("mmserve_engine_requests_total", engine=str(r)) for r in (0, 1)]
    assert min(served) >= 2 and abs(totals[0] - totals[1]) <= 1, (served, totals)
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in repeats]
    assert all(c >= 16 for c in cached), cached  # each repeat found its image's blocks on its rank
    assert all(r.status_code == 200 for r in first)
    decisions = after.value("mmserve_dp_routing_decisions_total", reason="cache") \
        - mid.value("mmserve_dp_routing_decisions_total", reason="cache")
    assert decisions == 6
    for rank in (0, 1):
        hits = after.value("mmserve_engine_cache_hits_total", engine=str(rank), layer="prefix") \
            - mid.value("mmserve_engine_cache_hits_total", engine=str(rank), layer="prefix")
        assert hits > 0


def test_a_pinned_request_runs_on_its_rank_and_bad_pins_are_400(server):
    url = data_url(make_image(300))
    for rank in (1, 0):
        before = scrape(server).value("mmserve_engine_requests_total", engine=str(rank))
        assert post(server, url, x_data_parallel_rank=str(rank)).status_code == 200
        assert scrape(server).value("mmserve_engine_requests_total", engine=str(rank)) == before + 1
    for bad in ("2", "one", "-1"):
        r = post(server, url, x_data_parallel_rank=bad)
        assert r.status_code == 400 and "rank" in r.json()["error"]["message"], r.text
    health = json.loads(server.get("/health")[1])
    assert [(r["rank"], r["status"]) for r in health["ranks"]] == [(0, "ready"), (1, "ready")]


def shm_segments(pids: set[int]) -> set[str]:
    """Shared-memory segments made by these processes (mmserve names them mmserve_<pid>_...)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("mmserve_")
            and name.split("_")[1].isdigit() and int(name.split("_")[1]) in pids}


def test_a_killed_engine_core_is_survived(model_path, offline):
    """kill -9 of one rank under concurrent whole-answer load: every request answers 200 with the
    answer it would have had; the rank comes back and serves; a cache reset while the other rank
    dies answers; nothing is left after shutdown."""
    s = ServerProcess(model_path, *DP_ARGS, "--mm-cache-type", "shm", "--mm-shm-cache-gb", "0.05",
                      env={"VLLM_SERVER_DEV_MODE": "1"})
    s.model = model_path
    pids = {s.proc.pid}
    try:
        urls = [data_url(make_image(400 + i)) for i in range(8)]
        want = [expected(offline, u, max_tokens=40) for u in urls]
        victim = children_titled(s, "engine_dp0")["mmserve::engine_dp0"]
        answers_through_a_kill(s, urls, want, victim)
        ranks = ranks_when(s, [("ready", 1), ("ready", 0)])
        assert ranks[0]["restarts"] == 1 and ranks[0]["status"] == "ready", ranks
        again = post(s, urls[0], "What is this?", 40, x_data_parallel_rank="0")
        assert again.json()["choices"][0]["message"]["content"] == want[0]
        assert scrape(s).value("mmserve_engine_restarts_total", engine="0") == 1
        # a cache reset that meets a rank's death answers (the dead rank's caches went with it)
        os.kill(children_titled(s, "engine_dp1")["mmserve::engine_dp1"], signal.SIGKILL)
        reset = httpx.post(s.base_url + "/reset_prefix_cache", timeout=30)
        assert reset.status_code == 200, reset.text
        ranks_when(s, [("ready", 1), ("ready", 1)])
        again = post(s, urls[1], "What is this?", 40, x_data_parallel_rank="1")  # the restarted rank serves
        assert again.json().get("choices", [{}])[0].get("message", {}).get("content") == want[1], again.text
        pids |= set(children_titled(s, "").values())
        assert shm_segments(pids)  # the store, written by the API server
    finally:
        assert s.stop() == 0
    assert shm_segments(pids) == set()


def test_offline_data_parallel_equals_one_engine(model_path, offline):
    prompts = [{"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": make_image(500 + i)}}
               for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    dp = LLM(model=model_path, max_model_len=256, data_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in dp.generate(prompts, params)]
        again = [o.outputs[0].token_ids for o in dp.generate(prompts, params)]
        figures = dp.engine.dp_figures()
    finally:
        dp.shutdown()
    assert got == again == [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    assert [r.requests for r in figures.ranks] == [4, 4] and figures.decisions["cache"] == 4


def ranks_when(s: ServerProcess, want: list[tuple[str, int]], timeout_s: float = 60.0) -> list[dict]:
    """/health's ranks once their (status, restarts) are `want`, or when `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = json.loads(s.get("/health")[1]).get("ranks", [])
        if [(r["status"], r["restarts"]) for r in ranks] == want or time.monotonic() > deadline:
            return ranks
        time.sleep(0.5)


def test_a_request_during_a_single_engines_restart_waits_for_it(model_path, offline):
    """One rank, killed three times (the default restart limit): each time the server lives on, and
    a request sent at once (or soon after) waits for the restarted engine core instead of failing."""
    s = ServerProcess(model_path, "--max-model-len", "256")
    s.model = model_path
    try:
        url = data_url(make_image(600))
        want = expected(offline, url)
        for delay in (0.0, 0.1, 0.3):
            victim = children_titled(s, "engine_dp0")["mmserve::engine_dp0"]
            os.kill(victim, signal.SIGKILL)
            time.sleep(delay)
            r = post(s, url)
            assert r.status_code == 200, r.text + "\n" + s.output()[-6000:]
            assert r.json()["choices"][0]["message"]["content"] == want
            assert s.proc.poll() is None
    finally:
        assert s.stop() == 0
