"""In-flight requests survive an engine restart (issue 49): kill -9 of the engine core under
streaming load — greedy and seeded chat streams and a Responses stream, each past its first text
— and every stream completes, its text equal to an undisturbed run's: the client saw a pause, not
an error (regression: every stream in flight ended with "the engine is not running")."""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers.server_process import ServerProcess, children_titled, data_url, messages
from helpers.tiny_models import make_checkpoint, make_image

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')

MAX_TOKENS = 160


def chat_body(server: ServerProcess, seed: int | None, image: int) -> dict:
    body = {"model": "m", "messages": messages(data_url(make_image(image)), "Tell me about it."),
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, "temperature": 0.0}
    if seed is not None:
        body |= {"temperature": 1.0, "seed": seed}
    return body


def stream_text(server: ServerProcess, path: str, body: dict, started: threading.Event | None) -> str:
    """The streamed text (chat deltas or Responses deltas); AssertionError on any error event."""
    text, done = [], False
    with httpx.stream("POST", server.base_url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event and event.get("type") != "response.failed", event
            if path.endswith("responses"):
                text.append(event.get("delta", "") if event["type"] == "response.output_text.delta" else "")
                done = done or event["type"] == "response.completed"
            else:
                text.append(event["choices"][0]["delta"].get("content") or "" if event["choices"] else "")
                done = done or any(c.get("finish_reason") for c in event["choices"])
            if started is not None and "".join(text):
                started.set()
    assert done
    return "".join(text)


def run_all(server: ServerProcess, kill: bool) -> list[str]:
    jobs = [("/v1/chat/completions", chat_body(server, seed, image)) for seed, image in
            ((None, 1), (None, 2), (7, 1), (8, 3), (None, 4))]
    jobs.append(("/v1/responses", {"model": "m", "input": "Write about foxes.", "stream": True,
                                   "max_output_tokens": MAX_TOKENS, "temperature": 0.0}))
    started = [threading.Event() for _ in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(stream_text, server, path, body, event) for (path, body), event in zip(jobs, started)]
        if kill:
            assert all(event.wait(60) for event in started)  # every stream has shown text
            os.kill(children_titled(server, "engine_dp0")["mmserve::engine_dp0"], signal.SIGKILL)
        return [f.result() for f in futures]


def test_streams_resume_exactly_after_the_engine_core_is_killed(tmp_path):
    server = ServerProcess(make_checkpoint(tmp_path), "--served-model-name", "m", "--max-model-len", "512")
    try:
        want = run_all(server, kill=False)
        assert all(want)
        got = run_all(server, kill=True)
        assert got == want
        log = server.output()
        assert "engine rank 0 died" in log and "is serving again" in log
        assert "moved 6 request(s) of a dead engine rank" in log  # all of them were in flight
    finally:
        server.stop()
