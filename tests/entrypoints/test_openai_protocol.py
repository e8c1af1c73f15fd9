"""The HTTP layer alone: the FastAPI app over a fake engine that follows `AsyncLLM`'s interface."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient

from helpers.fake_engine import CACHED, GOOD, MODEL, PIECES, FakeEngine, messages, post
from mmserve.entrypoints.openai.app import build_app
from mmserve.ipc.messages import CacheStats, SchedulerStats


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine) -> TestClient:
    return TestClient(build_app(engine, [MODEL, "alias"]), raise_server_exceptions=False)


def sse_events(text: str) -> list[Any]:
    assert text.endswith("data: [DONE]\n\n")
    events = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in text.split("\n\n") if block)
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def metric(client: TestClient, sample: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise KeyError(sample)


# ---- successes ---------------------------------------------------------------------------------


def test_whole_completion_and_usage(client, engine):
    r = post(client, {"model": MODEL, "messages": messages(url="data:image/png;base64,AA=="), "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) == len("chatcmpl-") + 32
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello wor"},
                                "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": CACHED}}
    part = engine.prompts[0]["messages"][0]["content"][0]
    assert part == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}, "uuid": "img-1"}


def test_sampling_params_mapping(client, engine):
    assert post(client, {"messages": messages(), "temperature": 0, "top_k": 5, "seed": 7, "stop": "x",
                         "ignore_eos": True, "max_tokens": 2, "max_completion_tokens": 9}).status_code == 200
    assert post(client, {"model": "alias", "messages": [{"role": "user", "content": "plain"}]}).status_code == 200
    first, default = engine.params
    assert (first.max_tokens, first.temperature, first.top_k, first.seed, first.stop, first.ignore_eos) == (
        9, 0.0, 5, 7, ["x"], True)
    assert default.max_tokens == FakeEngine.max_model_len  # the engine stops at max_model_len


def test_null_optional_fields_are_defaults(client, engine):
    body = {"messages": GOOD, "n": None, "logprobs": None, "stream": None, "temperature": None, "stop": None,
            "ignore_eos": None, "tools": None, "tool_choice": None, "max_tokens": None}
    assert post(client, body).json()["choices"][0]["finish_reason"] == "stop"
    assert engine.params[0].temperature == 1.0 and engine.params[0].max_tokens == FakeEngine.max_model_len


def test_stream_chunks_usage_and_done(client):
    body = {"model": MODEL, "messages": messages(), "stream": True, "stream_options": {"include_usage": True}}
    r = post(client, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    chunks, done = events[:-1], events[-1]
    assert done == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c["choices"][0]["delta"].get("content") for c in chunks[1:-2]]
    assert "".join(content) == "Hello world" and content == PIECES
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": CACHED}}


def test_stream_without_usage_has_no_usage_field(client):
    events = sse_events(post(client, {"messages": messages(), "stream": True}).text)
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_models(client):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL, "alias"]
    assert data[0]["object"] == "model" and data[0]["max_model_len"] == 64


def test_unknown_field_accepted_with_one_warning(client, caplog):
    with caplog.at_level(logging.WARNING, logger="mmserve"):
        r = post(client, {"model": MODEL, "messages": messages(), "frobnicate": 1, "zeta": {}})
    assert r.status_code == 200
    warnings = [rec.getMessage() for rec in caplog.records if "unknown field" in rec.getMessage()]
    assert len(warnings) == 1 and "frobnicate, zeta" in warnings[0]


# ---- client faults ---------------------------------------------------------------------------------


CLIENT_FAULTS = {
    "malformed json": (b"{not json", 400, "invalid_json", None),
    "not an object": (b"[1, 2]", 400, "invalid_value", None),
    "no messages": ({"model": MODEL}, 400, "invalid_value", "messages"),
    "empty messages": ({"messages": []}, 400, "invalid_value", "messages"),
    "bad part type": ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400, "invalid_value",
                      "messages[0].content[0]"),
    "part without url": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                         400, "invalid_value", "messages[0].content[0]"),
    "content a number": ({"messages": [{"role": "user", "content": 5}]}, 400, "invalid_value",
                         "messages[0].content"),
    "temperature a word": ({"messages": GOOD, "temperature": "hot"}, 400, "invalid_value", "temperature"),
    "stop a number": ({"messages": GOOD, "stop": 3}, 400, "invalid_value", "stop"),
    "negative temperature": ({"messages": GOOD, "temperature": -1}, 400, "invalid_value", None),
    "zero max_tokens": ({"messages": GOOD, "max_tokens": 0}, 400, "invalid_value", None),
    "top_p zero": ({"messages": GOOD, "top_p": 0}, 400, "invalid_value", None),
    "n=0": ({"messages": GOOD, "n": 0}, 400, "invalid_value", None),
    "top_logprobs 21": ({"messages": GOOD, "logprobs": True, "top_logprobs": 21}, 400, "invalid_value",
                        "top_logprobs"),
    "top_logprobs without logprobs": ({"messages": GOOD, "top_logprobs": 3}, 400, "invalid_value", "top_logprobs"),
    "malformed schema": ({"messages": GOOD, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": 3}}}}}, 400, "invalid_value", "response_format"),
    "bad logit_bias key": ({"messages": GOOD, "logit_bias": {"x": 1}}, 400, "invalid_value", "logit_bias"),
    "tools, auto without a parser": ({"messages": GOOD, "tools": [{"type": "function", "function": {"name": "f"}}]},
                                     400, "invalid_value", "tool_choice"),
    "stream_options without stream": ({"messages": GOOD, "stream_options": {"include_usage": True}}, 400,
                                      "invalid_value", "stream_options"),
    "a request's chat_template, untrusted": ({"messages": GOOD, "chat_template": "{{ messages }}"}, 400,
                                             "invalid_value", "chat_template"),
    "continue and a generation prompt": ({"messages": GOOD, "continue_final_message": True}, 400, "invalid_value",
                                         "continue_final_message"),
    "chat_template_kwargs sets tokenize": ({"messages": GOOD, "chat_template_kwargs": {"tokenize": True}}, 400,
                                           "invalid_value", "chat_template_kwargs"),
    "unknown model": ({"model": "nope", "messages": GOOD}, 404, "model_not_found", "model"),
    "bad role": ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_value", None),
    "media error": ({"messages": messages(url="bad:x")}, 400, "invalid_media", None),
    "prompt too long": ({"messages": messages("too long")}, 400, "invalid_value", None),
    "prompt too long, streamed": ({"messages": messages("too long"), "stream": True}, 400, "invalid_value", None),
}


@pytest.mark.parametrize("name", CLIENT_FAULTS)
def test_client_faults_get_4xx_openai_errors(client, engine, name):
    body, status, code, param = CLIENT_FAULTS[name]
    r = post(client, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["param"] == param
    assert error["message"] and "Traceback" not in error["message"]
    if param:
        assert param.split("[")[0] in error["message"]
    assert engine.aborted == [] and engine.finished == []


def test_api_key(engine):
    client = TestClient(build_app(engine, [MODEL], api_key="sekret"))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sekret"}):
        r = client.post("/v1/chat/completions", json={"messages": GOOD}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models", headers=headers).status_code == 401
    ok = {"Authorization": "Bearer sekret"}
    assert client.post("/v1/chat/completions", json={"messages": GOOD}, headers=ok).status_code == 200
    assert client.get("/v1/models", headers=ok).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_the_cache_reset_routes_exist_in_vllms_dev_mode_only(engine, monkeypatch):
    for value in ("", "0", "false"):
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", value)
        client = TestClient(build_app(engine, [MODEL]))
        for path in ("/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache"):
            assert client.post(path).status_code == 404
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    client = TestClient(build_app(engine, [MODEL]))
    assert [client.post(path).status_code for path in ("/reset_prefix_cache", "/reset_mm_cache",
                                                        "/reset_encoder_cache")] == [200] * 3
    assert engine.resets == [{"prefix": True}, {"mm": True}, {"encoder": True}]


def test_unknown_route_and_internal_error_use_the_error_body(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(client, {"messages": messages(url="crash")})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "secret" not in r.text


# ---- engine health -----------------------------------------------------------------------------


def test_health_and_dead_engine(client, engine):
    assert client.get("/health").status_code == 200
    engine.healthy = False
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    for stream in (False, True):
        r = post(client, {"messages": GOOD, "stream": stream})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_engine_death_mid_stream_is_an_error_event(client, engine):
    engine.die_after = 2
    events = sse_events(post(client, {"messages": GOOD, "stream": True}).text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_dead" and "error" not in events[-3]
    assert metric(client, 'mmserve_requests_total{outcome="error"}') == 1


# ---- metrics -------------------------------------------------------------------------------------


def test_metrics_names_and_outcomes(client, engine):
    text = client.get("/metrics").text
    for name in ("mmserve_requests_total", "mmserve_prompt_tokens_total", "mmserve_generation_tokens_total",
                 "mmserve_time_to_first_token_seconds", "mmserve_e2e_request_latency_seconds",
                 "mmserve_num_requests_running", "mmserve_num_requests_waiting", "mmserve_kv_cache_free_blocks",
                 "mmserve_kv_cache_total_blocks", "mmserve_num_preemptions_total", "mmserve_cache_queries_total",
                 "mmserve_cache_hits_total"):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert post(client, {"messages": GOOD}).status_code == 200
    assert post(client, {"messages": GOOD, "stream": True}).status_code == 200
    assert post(client, {"messages": GOOD, "n": 0}).status_code == 400
    assert metric(client, 'mmserve_requests_total{outcome="success"}') == 2
    assert metric(client, 'mmserve_requests_total{outcome="error"}') == 1
    assert metric(client, 'mmserve_requests_total{outcome="abort"}') == 0
    assert metric(client, "mmserve_prompt_tokens_total") == 10
    assert metric(client, "mmserve_generation_tokens_total") == 8
    assert metric(client, "mmserve_time_to_first_token_seconds_count") == 2
    assert metric(client, "mmserve_e2e_request_latency_seconds_count") == 2
    engine._stats = SchedulerStats(num_running=3, num_waiting=1, num_free_blocks=7, num_total_blocks=9,
                                   num_preemptions=2, caches={"processor": CacheStats(queries=3, hits=1)},
                                   weight_bytes=5 << 20)
    assert metric(client, "mmserve_model_weight_bytes") == 5 << 20
    assert metric(client, "mmserve_num_requests_running") == 3
    assert metric(client, "mmserve_num_requests_waiting") == 1
    assert metric(client, "mmserve_kv_cache_free_blocks") == 7
    assert metric(client, "mmserve_kv_cache_total_blocks") == 9
    assert metric(client, "mmserve_num_preemptions_total") == 2
    assert metric(client, 'mmserve_cache_hits_total{layer="processor"}') == 1
    assert metric(client, 'mmserve_cache_queries_total{layer="processor"}') == 3
    assert metric(client, 'mmserve_cache_queries_total{layer="prefix"}') == 0


def test_vllms_metric_names_read_the_same_figures(client, engine):
    """What reads a vLLM server's /metrics (dashboards, autoscalers, routers) reads ours: vLLM's names
    and `model_name` label (the first served name), the same figures as mmserve's own."""
    label = f'{{model_name="{MODEL}"}}'
    assert post(client, {"messages": GOOD}).status_code == 200
    engine._stats = SchedulerStats(num_running=3, num_waiting=4, num_free_blocks=6, num_total_blocks=8,
                                   num_preemptions=2, caches={"processor": CacheStats(queries=3, hits=1),
                                                              "prefix": CacheStats(queries=40, hits=16)})
    for vllm, ours in (("vllm:num_requests_running", "mmserve_num_requests_running"),
                       ("vllm:num_requests_waiting", "mmserve_num_requests_waiting"),
                       ("vllm:num_preemptions_total", "mmserve_num_preemptions_total"),
                       ("vllm:prompt_tokens_total", "mmserve_prompt_tokens_total"),
                       ("vllm:generation_tokens_total", "mmserve_generation_tokens_total"),
                       ("vllm:time_to_first_token_seconds_count", "mmserve_time_to_first_token_seconds_count"),
                       ("vllm:e2e_request_latency_seconds_sum", "mmserve_e2e_request_latency_seconds_sum"),
                       ("vllm:prefix_cache_queries_total", 'mmserve_cache_queries_total{layer="prefix"}'),
                       ("vllm:prefix_cache_hits_total", 'mmserve_cache_hits_total{layer="prefix"}'),
                       ("vllm:mm_cache_queries_total", 'mmserve_cache_queries_total{layer="processor"}'),
                       ("vllm:mm_cache_hits_total", 'mmserve_cache_hits_total{layer="processor"}')):
        assert metric(client, vllm + label) == metric(client, ours) != 0, vllm
    assert metric(client, "vllm:kv_cache_usage_perc" + label) == metric(client, "vllm:gpu_cache_usage_perc" + label)
    assert metric(client, "vllm:kv_cache_usage_perc" + label) == pytest.approx(0.25)
    assert metric(client, 'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="' + MODEL + '"}') == 1


def test_vllms_per_request_families(client, engine):
    """vLLM's per-request histograms, finish reasons and inter-token latency, from the same requests."""
    def vllm(name: str, **labels: str) -> float:
        inner = ",".join(f'{k}="{v}"' for k, v in {**labels, "model_name": MODEL}.items())
        return metric(client, f"{name}{{{inner}}}")

    assert post(client, {"messages": GOOD, "max_tokens": 2}).status_code == 200  # 2 tokens: length
    assert post(client, {"messages": GOOD, "stream": True}).status_code == 200  # 4 tokens: stop
    engine.die_after = 1
    assert post(client, {"messages": GOOD, "stream": True}).status_code == 200  # 1 token, then an error event
    assert [vllm("vllm:request_success_total", finished_reason=r) for r in ("stop", "length", "abort", "error")] \
        == [1, 1, 0, 1]
    assert vllm("vllm:request_prompt_tokens_count") == vllm("vllm:request_generation_tokens_count") == 3
    assert vllm("vllm:request_generation_tokens_sum") == 2 + 4 + 1
    assert vllm("vllm:request_max_num_generation_tokens_bucket", le="2.0") == 2  # the first and the failed one
    assert vllm("vllm:request_params_n_sum") == 3 and vllm("vllm:request_params_max_tokens_bucket", le="2.0") == 1
    # the gaps between token outputs: 1 + 3 + 0, with its older name alike
    assert vllm("vllm:inter_token_latency_seconds_count") == vllm("vllm:time_per_output_token_seconds_count") == 4
    assert vllm("vllm:request_decode_time_seconds_count") == 3
    assert vllm("vllm:request_time_per_output_token_seconds_count") == 2  # the one-token answer has no second
    # the engine core's times (the fake engine's: queued 10, admitted 10.25, first token 10.5, then one per 0.25)
    assert vllm("vllm:request_decode_time_seconds_sum") == 0.25 + 0.75 + 0  # its clock, not the server's
    assert vllm("vllm:request_queue_time_seconds_sum") == vllm("vllm:request_prefill_time_seconds_sum") == 3 * 0.25
    assert vllm("vllm:request_inference_time_seconds_sum") == 3 * 0.25 + 0.25 + 0.75
    assert metric(client, "mmserve_request_finished_total{finished_reason=\"stop\"}") == 1


# ---- client disconnects abort the request ---------------------------------------------------------


async def call_asgi(app: Any, body: dict, disconnect_after_s: float) -> list[dict]:
    """POST `body` straight to the ASGI app; the client disconnects after `disconnect_after_s`."""
    sent: list[dict] = []
    messages_in = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        if messages_in:
            return messages_in.pop(0)
        await asyncio.sleep(disconnect_after_s)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    return sent


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_the_request(engine, stream):
    engine.step_s = 0.05
    app = build_app(engine, [MODEL])
    sent = asyncio.run(call_asgi(app, {"messages": GOOD, "stream": stream, "max_tokens": 4}, 0.12))
    assert len(engine.aborted) == 1 and engine.finished == []
    assert app.state.metrics.requests.labels(outcome="abort")._value.get() == 1
    if stream:
        assert sent[0]["status"] == 200


def test_a_stream_writes_each_step_once_and_the_first_before_anything_else(engine):
    """The status line, then the first step's events (role chunk and first text) in one body
    message; one message per later step; an answer finished in its first step is one message
    ending in [DONE] (it was one write per event, the first after a task group had started)."""
    app = build_app(engine, [MODEL])
    for max_tokens, steps in ((1, 1), (3, 3)):
        sent = asyncio.run(call_asgi(app, {"messages": GOOD, "stream": True, "max_tokens": max_tokens}, 5))
        bodies = [m["body"].decode() for m in sent if m["type"] == "http.response.body" and m["body"]]
        assert sent[0]["type"] == "http.response.start" and len(bodies) == steps
        first = [json.loads(e[6:]) for e in bodies[0].split("\n\n") if e.startswith("data: {")]
        assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert first[1]["choices"][0]["delta"]["content"] == PIECES[0]
        assert bodies[-1].endswith("data: [DONE]\n\n") and bodies[0].count("[DONE]") == (steps == 1)
        text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content", "") for b in bodies
                       for e in b.split("\n\n") if e.startswith("data: {"))
        assert text == "".join(PIECES[:max_tokens])
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_a_non_ascii_api_key_can_match(engine):
    """Regression: the header arrives decoded as latin-1, so a UTF-8 key never matched."""
    client = TestClient(build_app(engine, [MODEL], api_key="clé-秘密"))
    raw = "Bearer clé-秘密".encode("utf-8")
    assert client.get("/v1/models", headers=[(b"authorization", raw)]).status_code == 200
    assert client.get("/v1/models", headers=[(b"authorization", b"Bearer cle")]).status_code == 401


def test_a_body_over_the_limit_is_413_before_it_is_read(engine):
    """Regression: there was no limit on the body; a 200 MiB JSON was read and parsed whole."""
    client = TestClient(build_app(engine, [MODEL], max_body_bytes=10_000), raise_server_exceptions=False)
    big = {"messages": [{"role": "user", "content": "x" * 20_000}]}
    r = client.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it streams in
        for _ in range(30):
            yield b"x" * 1000

    r = client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert engine.prompts == []  # nothing reached the engine
    assert client.post("/v1/chat/completions", json={"messages": GOOD}).status_code == 200
