"""The OpenAI-compatible server as a real process on loopback, driven by the official client."""

from __future__ import annotations

import base64
import glob
import importlib.metadata
import json
import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from mmserve import LLM, SamplingParams
from mmserve.entrypoints.openai.api_server import ENGINE_DEAD_EXIT_CODE
from helpers.server_process import ServerProcess, child_pids, data_url, labelled, messages, pid_alive
from helpers.tiny_models import make_checkpoint, make_image

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    make_image(11).save(d / "ok.png")
    return d


@pytest.fixture(scope="module")
def server(model_path, media_dir):
    s = ServerProcess(model_path, "--max-model-len", "256", "--allowed-local-media-path", str(media_dir),
                      "--limit-mm-per-prompt", '{"image": 2}', "--max-media-bytes", "300000")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(model_path):
    return LLM(model=model_path, max_model_len=256)


def expected_text(offline, url: str) -> str:
    return offline.chat(messages(url), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].outputs[0].text


def chat(client, model_path, url, **kw):
    return client.chat.completions.create(model=model_path, messages=messages(url), temperature=0,
                                          max_tokens=MAX_TOKENS, **kw)


def assert_all_blocks_free(server, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (server.metric("mmserve_num_requests_running") == 0
                and server.metric("mmserve_kv_cache_free_blocks") == server.metric("mmserve_kv_cache_total_blocks")):
            return
        time.sleep(0.1)
    raise AssertionError("KV blocks were not all freed")


def test_models_and_health(server, client, model_path):
    """/v1/models lists the model and /v1/models/{id} retrieves it (a 404 naming it for another);
    vLLM's /health, /ping (GET and POST) and /version answer too."""
    assert [m.id for m in client.models.list().data] == [model_path]
    card = client.models.retrieve(model_path)
    assert card.id == model_path and card.object == "model" and card.model_extra["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("other-model")
    assert err.value.body["code"] == "model_not_found" and model_path in err.value.body["message"]
    assert server.get("/health")[0] == 200 and server.get("/ping")[0] == 200
    assert httpx.post(server.base_url + "/ping").status_code == 200
    status, body = server.get("/version")
    assert status == 200 and json.loads(body)["version"] == importlib.metadata.version("mmserve")


def test_streamed_and_whole_agree_with_offline(client, model_path, offline):
    url = data_url(make_image(1))
    whole = chat(client, model_path, url)
    assert whole.choices[0].message.content == expected_text(offline, url)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == MAX_TOKENS and whole.usage.prompt_tokens > 0
    chunks = list(chat(client, model_path, url, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_32_concurrent_requests_with_different_images(client, model_path, offline, server):
    urls = [data_url(make_image(100 + i)) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda u: chat(client, model_path, u).choices[0].message.content, urls))
    expected = [o.outputs[0].text for o in offline.chat([messages(u) for u in urls],
                                                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))]
    assert got == expected
    assert len(set(got)) > 1
    assert_all_blocks_free(server)


def bad_requests(model_path, media_dir):
    good = messages(data_url(make_image(2)))
    noise = np.random.default_rng(0).integers(0, 256, (700, 700, 3), dtype=np.uint8)
    big_noise = data_url(Image.fromarray(noise))  # ~1.5 MB of PNG, over --max-media-bytes
    return {
        "malformed json": b"{not json",
        "no messages": {"model": model_path},
        "bad temperature": {"model": model_path, "messages": good, "temperature": -1},
        "bad max_tokens": {"model": model_path, "messages": good, "max_tokens": 0},
        "n 0": {"model": model_path, "messages": good, "n": 0},
        "top_logprobs 21": {"model": model_path, "messages": good, "logprobs": True, "top_logprobs": 21},
        "tools": {"model": model_path, "messages": good, "tools": [{"type": "function", "function": {"name": "f"}}]},
        "unknown model": {"model": "nope", "messages": good},
        "bad base64": {"model": model_path, "messages": messages("data:image/png;base64,@@@notbase64")},
        "not an image": {"model": model_path, "messages": messages("data:image/png;base64,"
                                                                   + base64.b64encode(b"hello").decode())},
        "too many bytes": {"model": model_path, "messages": messages(big_noise)},
        "file outside allowed dir": {"model": model_path, "messages": messages("file:///etc/hostname")},
        "dotdot escape": {"model": model_path, "messages": messages(f"file://{media_dir}/../../etc/hostname")},
        "http not allowed": {"model": model_path, "messages": messages("http://example.com/cat.png")},
        "too many images": {"model": model_path, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(make_image(i))}} for i in range(3)]}]},
        "prompt too long": {"model": model_path, "messages": [{"role": "user", "content": "word " * 400}]},
        "bad role": {"model": model_path, "messages": [{"role": "wizard", "content": "hi"}]},
    }


def test_bad_input_is_4xx_and_leaves_nothing(server, client, model_path, media_dir, offline):
    url = data_url(make_image(4))
    before = chat(client, model_path, url).choices[0].message.content
    for name, body in bad_requests(model_path, media_dir).items():
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(server.base_url + "/v1/chat/completions", content=content,
                       headers={"Content-Type": "application/json"}, timeout=30)
        assert 400 <= r.status_code < 500, f"{name}: {r.status_code} {r.text}"
        error = r.json()["error"]
        assert error["message"] and error["type"], name
    assert_all_blocks_free(server)
    assert chat(client, model_path, url).choices[0].message.content == before
    local = chat(client, model_path, f"file://{media_dir}/ok.png").choices[0].message.content
    assert local == expected_text(offline, f"file://{media_dir}/ok.png")


def test_client_disconnect_mid_stream_frees_the_request(server, model_path):
    body = {"model": model_path, "messages": messages(data_url(make_image(5))), "max_tokens": 200,
            "stream": True, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
        assert server.metric("mmserve_num_requests_running") >= 0
    assert_all_blocks_free(server)


def engine_core_pid(server) -> int:
    children = [p for p in child_pids(server.proc.pid) if pid_alive(p)]
    # spawn may add a resource tracker child; P1 is the one running mmserve's engine core
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                return pid
    raise AssertionError(f"no engine core child among {children}")


def leftover_sockets(pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"mmserve-{pid}*"))


def test_sigterm_leaves_no_process_and_no_socket(model_path):
    s = ServerProcess(model_path)
    p1 = engine_core_pid(s)
    assert leftover_sockets(s.proc.pid)
    assert s.stop(signal.SIGTERM) == 0
    deadline = time.monotonic() + 10
    while pid_alive(p1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(p1)
    assert leftover_sockets(s.proc.pid) == []


def test_killed_engine_core_fails_requests_and_exits_nonzero(model_path):
    """Fail-stop, as asked for with --engine-restart-limit 0 (tests/entrypoints/test_server_dp.py
    has the default: the engine core is restarted)."""
    s = ServerProcess(model_path, "--engine-restart-limit", "0")
    p1 = engine_core_pid(s)
    os.kill(p1, signal.SIGKILL)
    code = s.proc.wait(timeout=20)
    assert code == ENGINE_DEAD_EXIT_CODE  # 3: the documented exit for a supervisor to restart on
    assert leftover_sockets(s.proc.pid) == []


def test_a_repeated_image_is_processed_once_and_crosses_once(server, client, model_path):
    image = data_url(make_image(900))
    keys = [("mmserve_cache_hits_total", "processor"), ("mmserve_cache_hits_total", "ipc"),
            ("mmserve_cache_bytes_saved_total", "ipc")]
    before = {key: labelled(server, *key) for key in keys}
    first = chat(client, model_path, image).choices[0].message.content
    second = chat(client, model_path, image).choices[0].message.content
    assert first == second
    after = {key: labelled(server, *key) for key in keys}
    assert after[keys[0]] == before[keys[0]] + 1 and after[keys[1]] == before[keys[1]] + 1  # exactly the repeat
    assert after[keys[2]] > before[keys[2]]


def test_uuid_parts_over_the_api(server, client, model_path):
    image = data_url(make_image(901))
    with_uuid = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}, "uuid": "img-901"},
                                              {"type": "text", "text": "What is this?"}]}]
    alone = [{"role": "user", "content": [{"type": "image_url", "uuid": "img-901"},
                                          {"type": "text", "text": "What is this?"}]}]
    kw = dict(model=model_path, temperature=0, max_tokens=MAX_TOKENS)
    first = client.chat.completions.create(messages=with_uuid, **kw).choices[0].message.content
    assert client.chat.completions.create(messages=alone, **kw).choices[0].message.content == first
    unknown = [{"role": "user", "content": [{"type": "image_url", "uuid": "never-sent"}]}]
    with pytest.raises(openai.BadRequestError, match="send the image again"):
        client.chat.completions.create(messages=unknown, **kw)


def test_a_repeated_prompt_reports_cached_tokens_in_usage_and_metrics(server, client, model_path):
    msgs = [{"role": "system", "content": "You answer about foxes. " * 6},
            {"role": "user", "content": "How quick is the brown fox?"}]
    kw = dict(model=model_path, messages=msgs, temperature=0, max_tokens=MAX_TOKENS)
    hits_before = labelled(server, "mmserve_cache_hits_total", "prefix")
    first_before = labelled(server, "mmserve_cache_hits_total", "first_token")
    first = client.chat.completions.create(**kw)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = whole.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached == whole.usage.prompt_tokens  # every prompt token, the first output token cached too
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    assert whole.choices[0].message.content == first.choices[0].message.content
    assert labelled(server, "mmserve_cache_hits_total", "prefix") == hits_before + 2 * cached
    assert labelled(server, "mmserve_cache_hits_total", "first_token") == first_before + 2  # no forward for either


def test_each_request_gets_one_access_log_line(server, client, model_path):
    """Written by AccessLogMiddleware after the first bytes (uvicorn's own line is off): one line
    per request, with its method, path and status, streamed, refused or unknown alike."""
    def count(line: str) -> int:
        return server.output().count(line)

    lines = ['"POST /v1/chat/completions HTTP/1.1" 200', '"POST /v1/chat/completions HTTP/1.1" 400',
             '"GET /v1/nothing?x=1 HTTP/1.1" 404']
    before = [count(line) for line in lines]
    list(chat(client, model_path, data_url(make_image(3)), stream=True))
    assert httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": model_path}).status_code == 400
    assert httpx.get(f"{server.base_url}/v1/nothing?x=1").status_code == 404
    deadline = time.monotonic() + 5
    while [count(line) for line in lines] != [b + 1 for b in before] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [count(line) for line in lines] == [b + 1 for b in before]
