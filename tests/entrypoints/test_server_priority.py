"""`--scheduling-policy priority` through a real server started from a `--config` file: a
request's `priority` (vLLM's field) orders the queue. One slot (`--max-num-seqs 1`) is held by a
long stream while a lax and an urgent request wait; once the stream is closed the urgent one runs
first, though it arrived last. Both get the same answer: the order changes when a request runs,
never what it says."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from helpers.server_process import ServerProcess
from helpers.tiny_models import make_checkpoint

PROMPT = "USER: count to a thousand ASSISTANT:"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Started as vLLM's deployments start it, from a `--config` file; the command line's
    `--max-num-seqs 1` wins over the file's 8."""
    folder = tmp_path_factory.mktemp("server_priority")
    path = make_checkpoint(folder, text_config={"max_position_embeddings": 8192})
    config = folder / "serve.yaml"
    config.write_text("max-model-len: 8192\nmax-num-seqs: 8\nscheduling-policy: priority\nserved-model-name: [m]\n"
                      "disable-fastapi-docs: true\n")
    s = ServerProcess(path, "--config", str(config), "--max-num-seqs", "1")
    yield s
    s.stop()


def complete(server: ServerProcess, priority: int, done: list[tuple[int, str]]) -> None:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "priority": priority}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    done.append((priority, r.json()["choices"][0]["text"]))


def until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_urgent_request_runs_before_the_lax_one_that_came_first(server):
    done: list[tuple[int, str]] = []
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 8000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client, client.stream("POST", server.base_url + "/v1/completions",
                                                            json=body) as held:
        lines = held.iter_lines()  # kept: a dropped iterator would close the stream
        next(lines)  # the stream has the one slot
        lax = threading.Thread(target=complete, args=(server, 5, done))
        lax.start()
        until(lambda: server.metric("mmserve_num_requests_waiting") == 1)
        urgent = threading.Thread(target=complete, args=(server, -5, done))
        urgent.start()
        until(lambda: server.metric("mmserve_num_requests_waiting") == 2)
    # closing the stream aborts it: the slot is free
    lax.join(120)
    urgent.join(120)
    assert [p for p, _ in done] == [-5, 5]
    assert done[0][1] == done[1][1]


def test_the_config_files_switch_took_the_api_pages_away(server):
    assert [server.get(page)[0] for page in ("/docs", "/redoc", "/openapi.json")] == [404, 404, 404]
    assert server.get("/v1/models")[0] == 200
